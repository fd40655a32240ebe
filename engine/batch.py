"""What a step computes, on the host: the decode rows and the prefill pieces.

``scheduler.Scheduler`` fills both; ``runner.ModelRunner`` runs them.
``DecodeRows`` is the decode batch, one row per running sequence. Rows are
stable while a sequence runs (a leaving row is filled by the last one), so a
step touches only what changed: the block table gains an entry every
``block_size`` tokens, sampling parameters change when rows join or move.
Everything here is numpy on the host; the runner copies it to the device
buffers that the CUDA graphs read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from wsinfer.sessions.schema import GenerationParams

from .sampling import row_values

# Columns of ``DecodeRows.params``, as ``sampling.SamplingTensors`` orders its fields.
PARAM_COLUMNS = ("temperature", "top_k", "top_p", "penalty", "seed")


class DecodeRows:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int) -> None:
        self.max_rows = max_rows
        self.block_size = block_size
        self.seqs: list[Any] = []  # by row
        self.block_table = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self.positions = np.zeros(max_rows, dtype=np.int64)  # position of the row's next input
        self.src = np.zeros(max_rows, dtype=np.int64)  # where its next input token is on device
        self.active = np.ones(max_rows, dtype=bool)  # False: the row needs no token this step
        # temperature, top_p, penalty, presence, frequency, typical_p
        self.floats = np.zeros((6, max_rows), dtype=np.float32)
        self.ints = np.zeros((3, max_rows), dtype=np.int64)  # top_k, seed, min_tokens
        # position - index_base = which token of the turn the row's next draw produces
        self.index_base = np.zeros(max_rows, dtype=np.int64)
        self.tables_dirty = True
        self.params_dirty = True

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Any, blocks: list[int], position: int, src: int, seed: int) -> int:
        row = len(self.seqs)
        self.seqs.append(seq)
        self.block_table[row, : len(blocks)] = blocks
        self.positions[row] = position
        self.src[row] = src
        self.index_base[row] = len(seq.request.prompt_ids) - 1
        self.set_params(row, seq.request.params, seed)
        self.tables_dirty = True
        return row

    def set_params(self, row: int, params: GenerationParams, seed: int) -> None:
        values = row_values(params, seed, 0)
        temperature, top_k, top_p, penalty, signed_seed, _, min_tokens = values[:7]
        self.floats[:, row] = (temperature, top_p, penalty, *values[7:])
        self.ints[:, row] = (top_k, signed_seed, min_tokens)
        self.params_dirty = True

    def remove(self, row: int) -> Any | None:
        """Drop ``row``, moving the last row into its place; the moved sequence, if any."""
        last = len(self.seqs) - 1
        moved = None
        if row != last:
            moved = self.seqs[last]
            self.seqs[row] = moved
            for array in (self.block_table, self.positions, self.src, self.index_base):
                array[row] = array[last]
            self.floats[:, row] = self.floats[:, last]
            self.ints[:, row] = self.ints[:, last]
            self.tables_dirty = self.params_dirty = True
        self.seqs.pop()
        return moved

    def draw_index(self, rows: int) -> np.ndarray:
        return self.positions[:rows] - self.index_base[:rows]

    def slots(self, rows: int) -> np.ndarray:
        """Flat pool slot of each row's next input token."""
        pos = self.positions[:rows]
        blocks = self.block_table[np.arange(rows), pos // self.block_size]
        return blocks.astype(np.int64) * self.block_size + pos % self.block_size


@dataclass
class PrefillPiece:
    """Tokens ``start:end`` of one sequence's context, in one prefill forward."""

    seq: Any
    tokens: list[int]  # the sequence's whole known context
    blocks: list[int]
    start: int
    end: int
