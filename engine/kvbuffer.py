"""KV-cache storage for the eager path: right-aligned batch buffers.

A ``KVBuffer`` holds, per layer, keys and values of shape
``[row_capacity, kv_heads, column_capacity, head_dim]``. Rows are right-aligned:
row ``i``'s valid tokens fill columns ``[width - lens[i], width)``, so one
decode step appends one column for every row at once, and the attention mask
hides each row's left padding. Capacity grows geometrically, so appending does
not copy the whole cache every step the way ``DynamicCache``'s ``torch.cat`` does.

``BufferCache`` adapts a buffer to the transformers ``Cache`` interface for one
forward call.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

# Columns added beyond what is needed when a buffer grows, at least.
MIN_GROWTH = 64


class KVBuffer:
    def __init__(self, devices: list[torch.device], dtype: torch.dtype) -> None:
        self.num_layers = len(devices)
        self.devices = devices  # per layer: a model split over GPUs keeps each layer's KV local
        self.dtype = dtype
        self.keys: list[torch.Tensor | None] = [None] * self.num_layers
        self.values: list[torch.Tensor | None] = [None] * self.num_layers
        self.rows = 0  # rows in use
        self.width = 0  # columns in use
        self.row_capacity = 0
        self.col_capacity = 0

    # --- capacity ---------------------------------------------------------

    def reserve(self, rows: int, cols: int, *, exact: bool = False) -> None:
        """Make room for ``rows`` x ``cols`` (existing data kept in place)."""
        if rows <= self.row_capacity and cols <= self.col_capacity:
            return
        if not exact:
            rows = max(rows, min(2 * self.row_capacity, rows + self.row_capacity))
            cols = max(cols, self.col_capacity + self.col_capacity // 2, cols + MIN_GROWTH)
        rows, cols = max(rows, self.row_capacity), max(cols, self.col_capacity)
        for i in range(self.num_layers):
            self.keys[i] = self._regrow(self.keys[i], rows, cols)
            self.values[i] = self._regrow(self.values[i], rows, cols)
        self.row_capacity, self.col_capacity = rows, cols

    def _regrow(self, old: torch.Tensor | None, rows: int, cols: int) -> torch.Tensor | None:
        if old is None:
            return None  # allocated on first write, when the head shape is known
        # Zeros, not empty: masked padding still flows through softmax(.) @ V, and 0 * NaN = NaN.
        new = old.new_zeros((rows, old.shape[1], cols, old.shape[3]))
        new[: self.rows, :, : self.width] = old[: self.rows, :, : self.width]
        return new

    def _ensure_layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or values is None:
            shape = (self.row_capacity, like.shape[1], self.col_capacity, like.shape[3])
            keys = torch.zeros(shape, dtype=self.dtype, device=self.devices[layer])
            values = torch.zeros(shape, dtype=self.dtype, device=self.devices[layer])
            self.keys[layer], self.values[layer] = keys, values
        return keys, values

    # --- writes during a forward -------------------------------------------

    def write(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new columns of ``layer`` after ``width``; return the whole valid window."""
        keys, values = self._ensure_layer(layer, key)
        end = self.width + key.shape[2]
        keys[: self.rows, :, self.width : end] = key
        values[: self.rows, :, self.width : end] = value
        return keys[: self.rows, :, :end], values[: self.rows, :, :end]

    def advance(self, columns: int) -> None:
        """Every layer has written ``columns`` new columns."""
        self.width += columns

    # --- row management ------------------------------------------------------

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pairs = []
        for keys, values in zip(self.keys, self.values, strict=True):
            if keys is None or values is None:
                raise RuntimeError("KV buffer layer was never written")
            pairs.append((keys, values))
        return pairs

    def add_row(self, src: KVBuffer, src_row: int, length: int) -> int:
        """Append a row: the last ``length`` columns of ``src``'s row ``src_row``."""
        if length > self.width:
            self.shift_right(length - self.width)
        self.reserve(self.rows + 1, self.width)
        row = self.rows
        start = self.width - length
        for i, (key, value) in enumerate(src.layers()):
            keys, values = self._ensure_layer(i, key)
            if length:
                keys[row, :, start : self.width] = key[src_row, :, src.width - length : src.width]
                values[row, :, start : self.width] = value[
                    src_row, :, src.width - length : src.width
                ]
        self.rows += 1
        return row

    def remove_row(self, row: int) -> int | None:
        """Drop ``row`` by moving the last row into its place; return the moved row's old index."""
        last = self.rows - 1
        if row != last:
            for keys, values in self.layers():
                keys[row, :, : self.width] = keys[last, :, : self.width]
                values[row, :, : self.width] = values[last, :, : self.width]
        self.rows -= 1
        if self.rows == 0:
            self.width = 0
        return last if row != last else None

    def shift_right(self, columns: int) -> None:
        """Insert ``columns`` padding columns on the left of every row."""
        self.reserve(self.row_capacity, self.width + columns)
        for keys, values in self.layers() if self.rows else []:
            keys[: self.rows, :, columns : columns + self.width] = keys[
                : self.rows, :, : self.width
            ].clone()
            values[: self.rows, :, columns : columns + self.width] = values[
                : self.rows, :, : self.width
            ].clone()
        self.width += columns

    def trim_left(self, columns: int) -> None:
        """Drop ``columns`` leading columns that are padding in every row."""
        if columns <= 0:
            return
        kept = self.width - columns
        for keys, values in self.layers():
            keys[: self.rows, :, :kept] = keys[: self.rows, :, columns : self.width].clone()
            values[: self.rows, :, :kept] = values[: self.rows, :, columns : self.width].clone()
        self.width = kept

    def row_layers(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the last ``length`` columns of ``row``, as [1,H,length,D] per layer."""
        start = self.width - length
        return [
            (
                k[row : row + 1, :, start : self.width].clone(),
                v[row : row + 1, :, start : self.width].clone(),
            )
            for k, v in self.layers()
        ]

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers())


class _BufferLayer(DynamicLayer):
    """One layer of a ``BufferCache``: writes land in the shared ``KVBuffer``."""

    def __init__(self, buffer: KVBuffer, index: int) -> None:
        super().__init__()
        self.buffer = buffer
        self.index = index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values = self.buffer.write(self.index, key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.buffer.width

    def get_max_length(self) -> int:
        return -1


class BufferCache(Cache):
    """transformers ``Cache`` view of a ``KVBuffer`` for one forward call.

    Call ``KVBuffer.advance`` after the forward: layers all write at the same
    ``width``, so it must not move while the model runs.
    """

    def __init__(self, buffer: KVBuffer) -> None:
        layers = [_BufferLayer(buffer, i) for i in range(buffer.num_layers)]
        super().__init__(layers=layers)  # type: ignore[arg-type]
