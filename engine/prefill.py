"""Prefill on the eager path: prompt tokens through a transformers forward.

The ``scheduler.Scheduler`` picks each step's pieces (chunks of
``prefill_chunk_tokens`` at most, so running streams never wait long for their
next token); the ``eager_runner.EagerRunner`` runs fresh short ones together
in one padded forward, and a piece that continues a sequence's KV alone.

Rows are left-padded to a common width, so their KV ends right-aligned in the
``KVBuffer``, the same layout as the decode batch they join.
"""

from __future__ import annotations

from typing import Any

import torch

from .kvbuffer import BufferCache, KVBuffer


def prefill(model: Any, kv: KVBuffer, rows: list[list[int]], to_device: Any) -> torch.Tensor:
    """Run ``rows`` (each a context, up to where its piece ends) through ``model`` from
    column ``kv.width`` on, their KV into ``kv``; each row's last logits, [rows, V].
    Rows with KV in ``kv`` already go one at a time: their padding would differ."""
    start = kv.width
    assert start == 0 or len(rows) == 1, "only a fresh forward batches rows"
    width = max(len(r) for r in rows)
    kv.reserve(len(rows), width)
    kv.rows = len(rows)
    pad_of = [width - len(r) for r in rows]
    ids = [([0] * pad + row)[start:] for pad, row in zip(pad_of, rows, strict=True)]
    pads = to_device(pad_of)
    columns = torch.arange(width, device=pads.device)
    queries = columns[start:]
    positions = (queries.unsqueeze(0) - pads.unsqueeze(1)).clamp(min=0)
    out = model(
        input_ids=to_device(ids),
        position_ids=positions,
        attention_mask=prefill_mask(pads, columns, queries),
        past_key_values=BufferCache(kv),
        use_cache=True,
        logits_to_keep=1,
    )
    kv.advance(width - start)
    return out.logits[:, -1, :]


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
