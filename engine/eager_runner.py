"""The eager runner: the scheduler's plan on any transformers causal LM.

``execute`` runs one ``scheduler.ScheduledStep`` as the paged ``runner.ModelRunner``
does, with transformers' own forward and attention:

1. one decode forward over every decode row, in one right-aligned KV batch
   (``eager_kv.EagerKV``; see ``kvbuffer.KVBuffer``);
2. the prefill pieces: fresh ones that fit a chunk padded together in one
   forward, a piece that continues a sequence's KV (a later chunk, or a turn
   resumed from its retained cache) alone; a sequence whose prompt is in
   joins the batch, in the order the scheduler gives it its row;
3. one sampling call for all the draws; its ``Launch``'s ``collect`` is the
   step's one host sync.

Steps are synchronous: the draws reach the host in the step that made them,
so every decode row has its input token and computes at every step.
"""

from __future__ import annotations

from typing import Any

import torch

from .batch import PrefillPiece
from .eager_kv import EagerKV, EagerSequence
from .grammar import Grammars, apply_bitmask
from .kvbuffer import BufferCache
from .logprobs import LogprobBuffers, host_copy, model_logprobs
from .prefill import prefill
from .runner import Launch
from .sampler import sample
from .sampling import RowSampling, to_device
from .scheduler import ScheduledStep


class EagerRunner:
    def __init__(
        self,
        model: Any,
        kv: EagerKV,
        grammars: Grammars,
        ends: torch.Tensor,
        device: torch.device,
        chunk_tokens: int,
    ) -> None:
        self.model, self.kv, self.grammars = model, kv, grammars
        self.ends = ends  # end-of-sequence ids, which a row's min_tokens holds back
        self.device = device
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        self.chunk_tokens = chunk_tokens  # fresh pieces padded together stay within it

    def execute(self, plan: ScheduledStep) -> Launch:
        """Run ``plan``: decode its rows, prefill its pieces, sample every draw (held to
        its sequence's grammar); the draws stay on the device until ``collect``."""
        decode: list[Any] = plan.decode
        complete: list[Any] = plan.completing
        if any(seq is None for seq in decode):
            raise RuntimeError("the eager runner steps synchronously: every row decodes")
        logits = []
        if decode:
            logits.append(self._decode(decode))
        if plan.prefill:
            prefilled = self._prefill(plan.prefill, len(complete))
            if prefilled is not None:
                logits.append(prefilled)
        seqs = decode + complete
        if not seqs:  # only partial pieces: nothing drawn
            return Launch(decode, plan.prefill, [], 0, torch.zeros(0, dtype=torch.long), None)
        all_logits = torch.cat(logits)
        buffers = None
        if any(s.request.params.logprobs for s in seqs):  # before sampling: it may edit them
            buffers = LogprobBuffers(len(seqs), all_logits.device)
            model_lp = model_logprobs(all_logits)
        allowed = self.grammars.bitmask([s.constraint for s in seqs])
        if allowed is not None:
            all_logits = apply_bitmask(all_logits, allowed)
        tokens = self._sample(seqs, all_logits)
        copies = None
        if buffers is not None:
            buffers.record(0, model_lp, tokens)
            copies = host_copy(buffers, len(seqs))
        return Launch(decode, plan.prefill, complete, len(decode), tokens, None, logprobs=copies)

    # --- decode ------------------------------------------------------------------

    def _decode(self, rows: list[EagerSequence]) -> torch.Tensor:
        """One token for every decode row; their logits [rows, vocab]."""
        batch = self.kv.batch
        assert batch.rows == len(rows), "the batch's rows are the scheduler's"
        batch.reserve(batch.rows, batch.width + 1)
        lens = [seq.computed for seq in rows]
        input_ids = self._tensor([[seq.tokens[-1]] for seq in rows])
        positions = self._tensor(lens).unsqueeze(1)
        pads = self._tensor([batch.width - n for n in lens])
        columns = torch.arange(batch.width + 1, device=self.device)
        # A ready-made 4D boolean mask: transformers uses it as is (no host sync to inspect it).
        mask = (columns.unsqueeze(0) >= pads.unsqueeze(1))[:, None, None, :]
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            past_key_values=BufferCache(batch),
            use_cache=True,
        )
        batch.advance(1)
        return out.logits[:, -1, :]

    # --- prefill -----------------------------------------------------------------

    def _prefill(self, pieces: list[PrefillPiece], complete: int) -> torch.Tensor | None:
        """Every piece's forward; the first ``complete`` pieces' last logits (None:
        no piece completes), those sequences joined to the batch in that order."""
        grouped = self._fresh_group(pieces)
        last: dict[int, torch.Tensor] = {}
        held: dict[int, tuple[Any, int]] = {}  # piece -> the buffer and row with its KV
        if grouped:
            kv = self.kv.buffer()
            rows = [pieces[i].tokens[: pieces[i].end] for i in grouped]
            logits = prefill(self.model, kv, rows, self._tensor)
            for r, i in enumerate(grouped):
                last[i], held[i] = logits[r], (kv, r)
        for i, piece in enumerate(pieces):
            if i in held:
                continue
            seq: EagerSequence = piece.seq
            if piece.start == 0:  # fresh, or recomputed after a preemption
                seq.kv = self.kv.buffer()
            assert seq.kv is not None and seq.kv.width == piece.start
            last[i] = prefill(self.model, seq.kv, [piece.tokens[: piece.end]], self._tensor)[0]
            held[i] = (seq.kv, 0)
        for i, piece in enumerate(pieces):
            kv, row = held[i]
            if i < complete:
                self.kv.batch.add_row(kv, row, piece.end)
                piece.seq.kv = None
            elif kv is not piece.seq.kv:  # a partial piece of the padded forward
                piece.seq.kv = self.kv.buffer()
                piece.seq.kv.add_row(kv, row, piece.end)
        return torch.stack([last[i] for i in range(complete)]) if complete else None

    def _fresh_group(self, pieces: list[PrefillPiece]) -> list[int]:
        """The fresh pieces that go through one padded forward: short prompts arriving
        together, while their padded total fits a chunk (one alone gains nothing)."""
        group: list[int] = []
        width = 0
        for i, piece in enumerate(pieces):
            if piece.start != 0:
                continue
            wider = max(width, piece.end)
            if (len(group) + 1) * wider <= self.chunk_tokens:
                group.append(i)
                width = wider
        return group if len(group) > 1 else []

    # --- sampling ----------------------------------------------------------------

    def _sample(self, seqs: list[EagerSequence], logits: torch.Tensor) -> torch.Tensor:
        rows = [RowSampling(s.request.params, s.seed, s.num_generated) for s in seqs]
        seen = None
        if any(s.seen is not None for s in seqs):
            blank = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            seen = torch.stack([s.seen if s.seen is not None else blank for s in seqs])
        generated = None
        if any(s.request.params.counts_tokens for s in seqs):  # the tokens after the prompt
            generated = [s.tokens[len(s.request.prompt_ids) :] for s in seqs]
        return sample(logits, rows, seen, self.ends, generated)

    def _tensor(self, data: Any) -> torch.Tensor:
        return to_device(data, self.device)
