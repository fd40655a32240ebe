"""EagerEngineCore: continuous batching over any transformers causal LM.

The fallback for models the paged fast path (``core.EngineCore``) does not
implement. Its steps are the paged core's (``scheduled.ScheduledCore``): the
same ``scheduler.Scheduler`` admits, chunks prefill and keeps sessions' KV
between turns, over the eager KV space (``eager_kv``: nominal blocks, retained
caches as tensor copies, no prefix cache), and the ``eager_runner.EagerRunner``
runs each plan with an eager transformers forward over a right-aligned KV
batch. Knows nothing of transport: ``add`` / ``abort`` requests, call ``step``
in a loop, publish its outputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .cpu_linear import pack_linear_weights
from .eager_kv import EagerCaches, EagerKV, EagerSequence, NominalBlocks
from .eager_runner import EagerRunner
from .grammar import Grammars
from .lifecycle import EngineConfig, RequestOutput, Sequence
from .model import LoadedModel
from .runner import Launch
from .sampling import to_device
from .scheduled import ScheduledCore
from .scheduler import Scheduler


class EagerEngineCore(ScheduledCore):
    grammars: Grammars

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        super().__init__(loaded, config)
        cfg = self.config
        self.model = loaded.model
        if cfg.pack_cpu_weights:
            pack_linear_weights(self.model)
        text_config = self.model.config.get_text_config()
        num_layers = int(text_config.num_hidden_layers)
        self.vocab_size = int(text_config.vocab_size)
        self.grammars = Grammars(loaded.tokenizer, self.vocab_size, loaded.eos_token_ids)
        dtype = next(self.model.parameters()).dtype
        self.kv = EagerKV(_layer_devices(self.model, num_layers, self.device), dtype)
        # Enough blocks for every row's whole context: none is ever preempted for want of
        # them (the batch's memory is not counted in blocks).
        per_row = -(-self.max_context // cfg.block_size)
        blocks = NominalBlocks(cfg.max_batch_size * per_row, cfg.block_size)
        offload = torch.device("cpu") if cfg.kv_offload_cpu else None
        self.store = EagerCaches(cfg.kv_cache_bytes, blocks, self.kv, offload)
        planned = dataclasses.replace(cfg, prefix_caching=False)  # no blocks to share
        self.scheduler = Scheduler(planned, self.max_context, blocks, self.store, self.kv.row_left)
        ends = to_device(sorted(self.eos), self.device)
        self.runner = EagerRunner(
            self.model, self.kv, self.grammars, ends, self.device, cfg.prefill_chunk_tokens
        )

    def _sequence_type(self) -> type[Sequence]:
        return EagerSequence

    # --- the step (``ScheduledCore._forward``) -------------------------------------------

    def _launch(self) -> Launch | None:
        plan = self.scheduler.schedule()
        self._track_repetition(plan.admitted)
        return None if plan.empty else self.runner.execute(plan)

    def _after_forward(self) -> list[RequestOutput]:
        outputs = super()._after_forward()
        rows = self.scheduler.rows.seqs
        if rows:
            self.kv.trim(max(seq.computed for seq in rows), self.config.compact_min_columns)
        return outputs

    def _fail_all(self, message: str) -> list[RequestOutput]:
        # The batch may be half-written: forget it rather than unpick it row by row.
        self.kv.forget()
        return super()._fail_all(message)


def _layer_devices(model: Any, num_layers: int, default: torch.device) -> list[torch.device]:
    """Device of each decoder layer (they differ when device_map="auto" splits the model)."""
    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    if layers is None or len(layers) != num_layers:
        return [default] * num_layers
    return [next(layer.parameters()).device for layer in layers]
