"""``ScheduledCore``: a core whose steps the ``Scheduler`` plans and a runner runs.

The paged ``core.EngineCore`` and the ``eager.EagerEngineCore`` differ in their
model runner and their KV space, not in what a step is: the scheduler plans it
(``ScheduledStep``), the runner executes the plan (a ``runner.Launch``), the
scheduler takes one ``StepResult`` back, and the draws that reached the host go
to the lifecycle (``CoreBase._accept``). This is that step, once, and the
lifecycle's hooks (a sequence queued, retained, removed) answered by the
scheduler.
"""

from __future__ import annotations

from typing import Any

import torch

from .lifecycle import CoreBase, EngineConfig, RequestOutput, Sequence
from .runner import Launch
from .sampling import to_device
from .scheduler import PagedSequence, Sampled, Scheduler, StepResult


class ScheduledCore(CoreBase):
    scheduler: Scheduler
    vocab_size: int

    def __init__(self, loaded: Any, config: EngineConfig | None = None) -> None:
        super().__init__(loaded, config)
        # Overlap host work with the next step (the draws handed out are the step
        # before's): only a runner whose launch returns before its draws exist.
        self.async_steps = False
        self._pending: Launch | None = None  # async steps: the last step's, not yet handed out
        self._sampled: list[Sampled] = []  # this step's draws on the host, to hand out
        # GPU time spent waiting for the host between steps (CUDA): what async steps and
        # pipelined publishing are meant to keep near zero.
        self.gpu_idle_seconds = 0.0
        self.steps = 0

    # --- public API ---------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self._seqs or self._immediate or self._pending)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # --- the step (``CoreBase.step``) --------------------------------------------------

    def _forward(self) -> list[RequestOutput]:
        """Schedule and launch this step, and apply its result: what it launched, and
        the draws that reached the host (those of the step before, with async steps,
        while this one runs); ``_after_forward`` hands those out. A device fault that
        surfaces at the draws' sync fails the step, as one in the forward does."""
        launched = self._launch()
        if self.async_steps:
            arrived, self._pending = self._pending, launched
        else:
            arrived = launched
        if launched is None and arrived is None:
            return []
        result = launched.result() if launched is not None else StepResult()
        if arrived is not None:
            result.sampled = self._collect(arrived)
        self.scheduler.update(result)
        self._joined(result.joined)
        self._sampled = result.sampled
        return []

    def _after_forward(self) -> list[RequestOutput]:
        """Hand out the draws that reached the host; a failed step left none."""
        sampled, self._sampled = self._sampled, []
        return [self._accept(s.seq, s.token, s.logprob) for s in sampled if not s.seq.status.ended]

    def _launch(self) -> Launch | None:
        """The scheduler's plan, run by the runner; None: nothing to run."""
        raise NotImplementedError

    def _collect(self, launch: Launch) -> list[Sampled]:
        """``launch``'s draws, once on the host (the step's one sync)."""
        sampled = launch.collect()
        self.gpu_idle_seconds += launch.idle_before()
        self.steps += 1
        return sampled

    def _joined(self, joined: list[PagedSequence]) -> None:
        """Newcomers took decode rows: where the runner keeps per-row state, it follows."""

    # --- admission -----------------------------------------------------------------

    def _sequence_type(self) -> type[Sequence]:
        return PagedSequence

    def _enqueue(self, seq: PagedSequence) -> None:
        self.scheduler.add(seq)

    def _track_repetition(self, admitted: list[PagedSequence]) -> None:
        """Mark the context tokens of newly admitted sequences a repetition penalty reads."""
        for seq in admitted:
            if seq.request.params.repetition_penalty != 1.0:
                seq.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                seq.seen[to_device(seq.tokens, self.device)] = True

    # --- leaving ------------------------------------------------------------------------

    def _retain(self, seq: PagedSequence) -> int | None:
        return self.scheduler.retain(seq)

    def _remove(self, seq: PagedSequence) -> None:
        self._seqs.pop(seq.id, None)
        self.scheduler.remove(seq)

    def _fail_all(self, message: str) -> list[RequestOutput]:
        failed = self.scheduler.running_and_prefilling()
        self._pending, self._sampled = None, []
        return self._faulted(failed, message)
