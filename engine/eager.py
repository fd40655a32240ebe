"""EagerEngineCore: continuous batching over any transformers causal LM.

The fallback for models the paged fast path (``core.EngineCore``) does not
implement: an eager transformers forward per step over a right-aligned KV
batch. Knows nothing of transport: ``add`` / ``abort`` requests, call ``step`` in a
loop, publish its outputs. Each step does

1. pending aborts, pauses and immediate errors;
2. one chunk (``prefill_chunk_tokens``) of one newcomer's prefill, so running
   streams wait at most one chunk before their next token;
3. one decode forward over every running row, in one right-aligned KV batch
   (see ``kvbuffer.KVBuffer``);
4. one sampling call for all of them and a single device->host transfer.

A newcomer whose prefill completes joins the batch by copying its KV into a
free row; a finished row leaves by moving the last row into its place.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from .cpu_linear import pack_linear_weights
from .grammar import Grammars, apply_bitmask
from .kvbuffer import BufferCache, KVBuffer, KVStore, RetainedKV
from .kvspace import common_prefix
from .lifecycle import CoreBase, EngineConfig, RequestOutput, Sequence
from .logprobs import HostLogprobs, LogprobBuffers, host_copy, model_logprobs
from .model import LoadedModel
from .prefill import PrefillGroup, new_group, prefill_chunk
from .requests import SequenceStatus
from .sampler import sample
from .sampling import RowSampling, to_device


@dataclass(eq=False)
class _Sequence(Sequence):
    group: PrefillGroup | None = None  # while prefilling
    group_row: int = 0
    row: int | None = None  # batch row while decoding


class EagerEngineCore(CoreBase):
    grammars: Grammars

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        super().__init__(loaded, config)
        self.model = loaded.model
        if self.config.pack_cpu_weights:
            pack_linear_weights(self.model)
        text_config = self.model.config.get_text_config()
        self.num_layers = int(text_config.num_hidden_layers)
        self.vocab_size = int(text_config.vocab_size)
        self.dtype = next(self.model.parameters()).dtype
        # The end-of-sequence ids, which a row's min_tokens keeps from being drawn.
        self.ends = to_device(sorted(self.eos), self.device)
        self.grammars = Grammars(loaded.tokenizer, self.vocab_size, loaded.eos_token_ids)
        offload = torch.device("cpu") if self.config.kv_offload_cpu else None
        self.store = KVStore(self.config.kv_cache_bytes, offload)
        self._waiting: deque[_Sequence] = deque()
        self._prefilling: PrefillGroup | None = None
        self._rows: list[_Sequence] = []  # index = batch row
        self.layer_devices = _layer_devices(self.model, self.num_layers, self.device)
        self._batch = KVBuffer(self.layer_devices, self.dtype)

    # --- public API ---------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._rows)

    @property
    def num_waiting(self) -> int:
        prefilling = self._prefilling.seqs if self._prefilling else []
        return len(self._waiting) + sum(seq is not None for seq in prefilling)

    def _sequence_type(self) -> type[Sequence]:
        return _Sequence

    def _enqueue(self, seq: _Sequence) -> None:
        self._waiting.append(seq)

    # --- the step (``CoreBase.step``) --------------------------------------------------

    def _forward(self) -> list[RequestOutput]:
        """A decode forward over the running rows and a chunk of prefill, sampled as one."""
        seqs: list[_Sequence] = []
        logits: list[torch.Tensor] = []
        if self._rows:
            seqs += self._rows
            logits.append(self._decode_forward())
        prefilled = self._prefill_forward()
        if prefilled is not None:
            seqs += prefilled[0]
            logits.append(prefilled[1])
        if not seqs:
            return []
        all_logits = torch.cat(logits)
        buffers = None
        if any(s.request.params.logprobs for s in seqs):  # before sampling: it may edit them
            buffers = LogprobBuffers(len(seqs), all_logits.device)
            model_lp = model_logprobs(all_logits)
        allowed = self.grammars.bitmask([s.constraint for s in seqs])
        if allowed is not None:
            all_logits = apply_bitmask(all_logits, allowed)
        tokens_t = self._sample(seqs, all_logits)
        if buffers is not None:
            buffers.record(0, model_lp, tokens_t)
        tokens = tokens_t.tolist()  # the step's only sync
        host = HostLogprobs(host_copy(buffers, len(seqs))) if buffers is not None else None
        outputs = []
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            params = seq.request.params
            lp = host.at(i, token, params.top_logprobs) if host and params.logprobs else None
            outputs.append(self._accept(seq, token, lp))
        for seq in prefilled[0] if prefilled else []:
            if not seq.status.ended:
                self._join_batch(seq)
        return outputs

    def _decode_forward(self) -> torch.Tensor:
        """One token for every running row; returns logits [rows, vocab]."""
        batch = self._batch
        batch.reserve(batch.rows, batch.width + 1)
        lens = [seq.computed for seq in self._rows]
        input_ids = self._tensor([[seq.tokens[-1]] for seq in self._rows])
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
        for seq in self._rows:
            seq.computed += 1
        return out.logits[:, -1, :]

    def _prefill_forward(self) -> tuple[list[_Sequence], torch.Tensor] | None:
        """One chunk of the current newcomers; their last logits once their prompts are in."""
        group = self._prefilling or self._start_prefill()
        if group is None:
            return None
        logits = prefill_chunk(self.model, group, self.config.prefill_chunk_tokens, self._tensor)
        for row, seq in enumerate(group.seqs):
            if seq is not None:
                seq.computed = group.computed(row)
        if logits is None:
            return None
        self._prefilling = None
        rows = [row for row, seq in enumerate(group.seqs) if seq is not None]
        seqs = [seq for seq in group.seqs if seq is not None]
        return seqs, logits[rows] if len(rows) < len(group.seqs) else logits

    def _start_prefill(self) -> PrefillGroup | None:
        room = self.config.max_batch_size - len(self._rows)
        if not self._waiting or room <= 0:
            return None
        first = self._waiting.popleft()
        group = self._resume_from_cache(first)
        if group is None:
            seqs = [first]
            while self._waiting and len(seqs) < room and self._joins_group(seqs, self._waiting[0]):
                seqs.append(self._waiting.popleft())
            group = new_group(seqs, [s.tokens for s in seqs], self.layer_devices, self.dtype)
        for row, seq in enumerate(group.seqs):
            seq.group, seq.group_row = group, row
            seq.status = SequenceStatus.RUNNING
            if seq.request.params.repetition_penalty != 1.0:
                seq.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                seq.seen[self._tensor(seq.tokens)] = True
        self._prefilling = group
        return group

    def _joins_group(self, seqs: list[_Sequence], candidate: _Sequence) -> bool:
        """Batch short fresh prompts into one forward while the padded total fits a chunk."""
        key = candidate.request.cache_key
        if key is not None and key in self.store:
            return False  # it may skip most of its prefill: handle it alone
        width = max(len(candidate.tokens), *(len(s.tokens) for s in seqs))
        return (len(seqs) + 1) * width <= self.config.prefill_chunk_tokens

    def _resume_from_cache(self, seq: _Sequence) -> PrefillGroup | None:
        """A group starting from the retained KV of the session's last turn, where it matches."""
        key = seq.request.cache_key
        entry = self.store.take(key) if key else None
        if entry is None:
            return None
        # At least one token must go through the model: its logits pick the next token.
        reuse = min(common_prefix(entry.token_ids, seq.tokens), len(seq.tokens) - 1)
        if reuse <= 0:
            return None
        group = new_group([seq], [seq.tokens], self.layer_devices, self.dtype)
        for layer, (keys, values) in enumerate(entry.layers):
            device = self.layer_devices[layer]
            group.kv.write(
                layer,
                keys[:, :, :reuse].to(device, non_blocking=True),
                values[:, :, :reuse].to(device, non_blocking=True),
            )
        group.kv.advance(reuse)
        seq.computed = seq.cached_tokens = reuse
        return group

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        rows = [RowSampling(s.request.params, s.seed, s.num_generated) for s in seqs]
        seen = None
        if any(s.seen is not None for s in seqs):
            blank = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            seen = torch.stack([s.seen if s.seen is not None else blank for s in seqs])
        generated = None
        if any(s.request.params.counts_tokens for s in seqs):  # the tokens after the prompt
            generated = [s.tokens[len(s.request.prompt_ids) :] for s in seqs]
        return sample(logits, rows, seen, self.ends, generated)

    def _join_batch(self, seq: _Sequence) -> None:
        assert seq.group is not None
        seq.row = self._batch.add_row(seq.group.kv, seq.group_row, seq.computed)
        seq.group = None
        self._rows.append(seq)

    # --- leaving -------------------------------------------------------------------

    def _retain(self, seq: _Sequence) -> int | None:
        key = seq.request.cache_key
        if key is None or seq.computed == 0:
            return None
        if seq.row is not None:
            layers = self._batch.row_layers(seq.row, seq.computed)
        elif seq.group is not None:
            layers = seq.group.kv.row_layers(seq.group_row, seq.computed)
        else:
            return None
        stored = self.store.put(key, RetainedKV(seq.tokens[: seq.computed], layers))
        return seq.computed if stored else None

    def _remove(self, seq: _Sequence) -> None:
        self._seqs.pop(seq.id, None)
        if seq.row is not None:
            moved = self._batch.remove_row(seq.row)
            last = self._rows.pop()
            if moved is not None:
                last.row = seq.row
                self._rows[seq.row] = last
            seq.row = None
        elif seq.group is not None:
            group = seq.group
            group.seqs[seq.group_row] = None
            if self._prefilling is group and not any(group.seqs):
                self._prefilling = None
        elif seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
        seq.group = None

    def _after_forward(self) -> list[RequestOutput]:
        self._maybe_compact()
        return []

    def _maybe_compact(self) -> None:
        """Drop left padding that every row shares (left behind by a long row that ended)."""
        if not self._rows:
            return
        shared = self._batch.width - max(seq.computed for seq in self._rows)
        if shared >= self.config.compact_min_columns and 4 * shared >= self._batch.width:
            self._batch.trim_left(shared)

    def _fail_all(self, message: str) -> list[RequestOutput]:
        prefilling = self._prefilling.seqs if self._prefilling else []
        failed = list(self._rows) + [seq for seq in prefilling if seq is not None]
        # The batch may be half-written: forget it rather than unpick it row by row.
        for seq in failed:
            seq.row = None
        self._rows = []
        self._batch = KVBuffer(self.layer_devices, self.dtype)
        return self._faulted(failed, message)

    def _tensor(self, data: Any) -> torch.Tensor:
        return to_device(data, self.device)


def _layer_devices(model: Any, num_layers: int, default: torch.device) -> list[torch.device]:
    """Device of each decoder layer (they differ when device_map="auto" splits the model)."""
    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    if layers is None or len(layers) != num_layers:
        return [default] * num_layers
    return [next(layer.parameters()).device for layer in layers]
