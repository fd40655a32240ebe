"""Prefill of newcomers: one or more prompts through the model, chunk by chunk.

Short prompts that arrive together are prefilled as one padded batch (one
forward instead of one per prompt); a long prompt, or one that continues from
a retained cache, goes alone in chunks of ``prefill_chunk_tokens`` so running
streams never wait long for their next token.

Rows are left-padded to a common width, so their KV ends right-aligned in the
group's ``KVBuffer``, the same layout as the decode batch they join.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .kvbuffer import BufferCache, KVBuffer


@dataclass
class PrefillGroup:
    seqs: list[Any]  # the engine's sequences, one per row (None once removed)
    rows: list[list[int]]  # each row's whole context (prompt + generated ids)
    pads: list[int]  # left padding per row
    kv: KVBuffer  # may start with a retained prefix (single-row groups only)

    @property
    def width(self) -> int:
        return self.pads[0] + len(self.rows[0])

    @property
    def complete(self) -> bool:
        return self.kv.width >= self.width

    def computed(self, row: int) -> int:
        """Tokens of ``row`` whose KV is in the buffer."""
        return max(0, self.kv.width - self.pads[row])


def new_group(
    seqs: list[Any], rows: list[list[int]], devices: list[torch.device], dtype: torch.dtype
) -> PrefillGroup:
    width = max(len(r) for r in rows)
    kv = KVBuffer(devices, dtype)
    kv.reserve(len(rows), width, exact=True)
    kv.rows = len(rows)
    return PrefillGroup(seqs, rows, [width - len(r) for r in rows], kv)


def prefill_chunk(
    model: Any, group: PrefillGroup, budget: int, to_device: Any
) -> torch.Tensor | None:
    """Run the next chunk (about ``budget`` tokens in all); last-position logits when done."""
    start = group.kv.width
    end = min(group.width, start + max(1, budget // len(group.rows)))
    ids = [([0] * pad + row)[start:end] for pad, row in zip(group.pads, group.rows, strict=True)]
    pads = to_device(group.pads)
    columns = torch.arange(end, device=pads.device)
    queries = columns[start:]
    positions = (queries.unsqueeze(0) - pads.unsqueeze(1)).clamp(min=0)
    out = model(
        input_ids=to_device(ids),
        position_ids=positions,
        attention_mask=prefill_mask(pads, columns, queries),
        past_key_values=BufferCache(group.kv),
        use_cache=True,
        logits_to_keep=1,
    )
    group.kv.advance(end - start)
    return out.logits[:, -1, :] if group.complete else None


def prefill_mask(pads: torch.Tensor, columns: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """[rows, 1, queries, columns] boolean: causal, minus each row's left padding.

    A padding position attends to itself so that its (discarded) output stays
    finite: a row of nothing but masked keys would give NaN, and NaN in the
    cache's padding would leak through softmax(.) @ V as 0 * NaN.
    """
    causal = columns.unsqueeze(0) <= queries.unsqueeze(1)
    valid = columns.unsqueeze(0) >= pads.unsqueeze(1)
    own = columns.unsqueeze(0) == queries.unsqueeze(1)
    return ((causal.unsqueeze(0) & valid.unsqueeze(1)) | own.unsqueeze(0)).unsqueeze(1)
