"""`LoraBank`: a different adapter for every position of one batch (BGMV/SGMV on the CPU)."""

import numpy as np

from . import _convert as cv
from ._lora_cffi import ffi, lib
from .delta import LoraDelta, LoraStack
from .errors import LoraShapeError

__all__ = ["LoraBank"]


class LoraBank:
    """Adapter slots for mixed batches: position ``b`` gets ``entries[adapter_ids[b]]``.

    ``LoraBank(entries)``: each entry a ``LoraDelta``, a ``LoraStack`` or ``None`` (no adapter),
    all of one ``rows x cols`` (else ``LoraShapeError`` naming the entry and both shapes); ranks and
    storage dtypes may differ.  ``len``, ``bank[i]``, ``.resident_bytes``.

    One C call per batch: positions are grouped by adapter (a counting sort, punica's SGMV idea)
    so each adapter's weights stream once per block of positions, threads take blocks, and every
    position's bits equal applying its entry alone with ``add_to`` / ``add_row_to``: results never
    depend on the batch's composition or order.  ``-1`` means no adapter (it never wraps to the
    last slot); any other id outside ``[0, len)`` is an ``IndexError`` naming the id and its
    position, raised before anything is written.
    """

    def __init__(self, entries):
        entries = list(entries)
        shape = None
        for i, e in enumerate(entries):
            if e is not None and not isinstance(e, (LoraDelta, LoraStack)):
                raise TypeError(f"bank entry {i} must be a LoraDelta, a LoraStack or None; "
                                f"got {type(e).__name__}")
            es = e.base_shape if e is not None else None
            if es is None:
                continue
            if shape is None:
                shape, first_i = es, i
            elif es != shape:
                raise LoraShapeError(
                    f"bank entry {i} is [{es[0]} x {es[1]}] but entry {first_i} is "
                    f"[{shape[0]} x {shape[1]}]; every entry must fit one base",
                    rows=es[0], cols=es[1])
        self._entries = entries
        self._shape = shape
        self._flat_version = None
        self._flatten()

    def _versions(self):
        return tuple(e._version if isinstance(e, LoraStack) else 0 for e in self._entries)

    def _flatten(self):
        """The flat delta list the C driver walks; rebuilt if a stack entry was appended to."""
        versions = self._versions()
        if versions == self._flat_version:
            return
        deltas, first = [], [0]
        for i, e in enumerate(self._entries):
            members = [] if e is None else ([e] if isinstance(e, LoraDelta) else list(e))
            for d in members:
                if self._shape is None:
                    self._shape = d.base_shape
                if d.base_shape != self._shape:
                    raise LoraShapeError(
                        f"bank entry {i} now holds a [{d.rows} x {d.cols}] delta but the bank's "
                        f"base is [{self._shape[0]} x {self._shape[1]}]", rows=d.rows, cols=d.cols)
            deltas += members
            first.append(len(deltas))
        self._deltas = deltas
        self._ptrs = ffi.new("lora_delta *[]", [d._ptr for d in deltas])
        self._first = ffi.new("int64_t[]", first)
        self._flat_version = versions

    def __len__(self):
        return len(self._entries)

    def __getitem__(self, i):
        return self._entries[i]

    def __iter__(self):
        return iter(list(self._entries))

    def __repr__(self):
        return f"LoraBank({len(self._entries)} entries, base_shape={self._shape})"

    @property
    def base_shape(self):
        """(rows, cols) shared by every entry; None when no entry holds a delta."""
        return self._shape

    @property
    def resident_bytes(self):
        """Sum of the distinct deltas' resident_bytes over all entries."""
        self._flatten()
        return sum(d.resident_bytes for d in {id(d): d for d in self._deltas}.values())

    def _call_args(self, adapter_ids, n):
        self._flatten()
        ids = cv.as_ids(adapter_ids, "adapter_ids", n)
        scales = cv.effective_scales(self._deltas)
        return ids, scales

    def _raise(self, status, adapter_ids, ids=None, bad=None):
        rows = self._shape[0] if self._shape else 0
        cv.raise_status(status, ids=ids, adapter_ids=adapter_ids, n_entries=len(self._entries),
                        rows=rows, bad=bad)

    def _check_ids_only(self, adapter_ids, n):
        ids = cv.as_ids(adapter_ids, "adapter_ids", n)
        wrong = np.flatnonzero((ids < -1) | (ids >= len(self._entries)))
        if wrong.size:
            bad = ffi.new("int64_t *", int(wrong[0]))
            self._raise(lib.LORA_ERR_ADAPTER, ids, bad=bad)

    def add_batch_to(self, x, out, adapter_ids):
        """``out[b] += entries[adapter_ids[b]]``'s delta of ``x[b]``; returns ``out``.

        ``x``: real float ``[batch, cols]``; ``out``: float32 ``[batch, rows]`` (C-contiguous or
        row-strided); ``adapter_ids``: integer ``[batch]``, ``-1`` = no adapter.  Errors as
        ``LoraDelta.add_batch_to``, plus ValueError for a wrong number of ids and IndexError for
        an id out of range; ``out`` is untouched on every error.
        """
        self._flatten()  # a stack entry may have been appended to since the last call
        if self._shape is None:  # no entry holds a delta: no rows/cols to check against
            cv.check_shapeless(x, out, ndim=2)
            self._check_ids_only(adapter_ids, out.shape[0])
            return out
        rows, cols = self._shape
        x, xp, ldx, op, ldo, batch = cv.prepare_mat(x, out, cols, rows)
        ids, scales = self._call_args(adapter_ids, batch)
        if batch:
            bad = ffi.new("int64_t *")
            status = lib.lora_apply_batch(len(self._entries), self._first, self._ptrs, scales,
                                          ffi.from_buffer("int64_t[]", ids), ffi.NULL, 1, rows, cols,
                                          batch, xp, 0, ldx, op, 0, ldo, bad)
            if status:
                self._raise(status, ids, bad=bad)
        return out

    def add_rows_to(self, ids, out, adapter_ids):
        """``out[i] += entries[adapter_ids[i]]``'s embedding delta of token ``ids[i]``.

        ``ids``: integer ``[n]`` in ``[0, rows)``; ``out``: float32 ``[n, cols]``; ``adapter_ids``:
        integer ``[n]``, ``-1`` = no adapter.  Every id is checked before anything is written.
        """
        self._flatten()
        if self._shape is None:
            cv.check_shapeless(cv._NO_X, out, ndim=2)
            cv.check_shapeless_token_ids(ids, out.shape[0])
            self._check_ids_only(adapter_ids, out.shape[0])
            return out
        rows, cols = self._shape
        op, ldo, n = cv.check_rows_out(out, cols)
        tok = cv.as_ids(ids, "ids", n)
        aid, scales = self._call_args(adapter_ids, n)
        if n:
            bad = ffi.new("int64_t *")
            status = lib.lora_apply_rows(len(self._entries), self._first, self._ptrs, scales,
                                         ffi.from_buffer("int64_t[]", aid), ffi.NULL, 1, rows, cols, n,
                                         ffi.from_buffer("int64_t[]", tok), op, 0, ldo, bad)
            if status:
                self._raise(status, aid, ids=tok, bad=bad)
        return out
