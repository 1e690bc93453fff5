"""The entry table: the one C view of a list of entries that stacks, banks, adapter sets and
`accelerate_peft` share, and the protocol through which an entry type joins it.

An *entry* is what one adapter slot holds: a `LoraDelta`, a `LoraStack` (its members applied
in order, in one fused pass), or None (nothing); later kinds join the same way.  The kernels
see *kernel entries*: ranges of C deltas applied in order, each delta with its effective scale.

The protocol an entry type implements (and registers with `entry_type`):

- ``base_shape``: ``(rows, cols)`` of the base every member fits, or None while it holds none;
- ``expert_shape`` (optional, for a kind that routes): ``(n_experts, rows, cols)``; entries of
  one table agree on it as on ``base_shape`` (a plain entry has none, so the two kinds never
  share a table);
- ``_kernel_entries()``: a tuple of kernel entries, each a tuple of `Member` (pointer, scale
  object, alpha factor, owner, per-member extra).  A delta or a stack gives one kernel entry;
  a kind that routes within an entry (experts: one kernel entry per expert) gives several, and
  its table is built with ``routed=True``, where ``starts[i]`` is entry i's first kernel entry
  (``starts_c``: the same as a C array, what `lora.experts` passes to ``lora_apply_experts``);
- ``_watch(table)`` (optional): an entry that can change after a table holds it (a stack being
  appended to) keeps the tables and sets ``table.stale = True`` on each change.

The table turns members into the C arrays once (rebuilt when stale) and reads the scales only
when some `LoraScale` changed (`scales`).  Per-member extras (DoRA's row data) are kept in
`members`, in kernel order, for a kind whose C call needs them; the plain calls ignore them.
"""

from typing import NamedTuple

import numpy as np

from . import _arrays as arrays
from . import _dispatch as dispatch
from . import _edge
from ._dispatch import (CHARS, DECLINE, DOUBLES, ERR_ALIGN, INT64S, NULL, address, fast_code,
                        from_buffer, ndarray)
from . import scale as _scale_mod
from ._lora_cffi import ffi, lib
from .errors import LoraShapeError

__all__ = ["Member", "entry_type", "entry_types", "stackable_types", "owners", "EntryTable",
           "with_scales"]

_F64 = np.dtype(np.float64)
_I64 = arrays.I64
_lora_apply_batch = lib.lora_apply_batch
_lora_apply_rows = lib.lora_apply_rows
_lora_apply_batch_dora = lib.lora_apply_batch_dora
_lora_apply_rows_dora = lib.lora_apply_rows_dora
_ERR_ADAPTER = lib.LORA_ERR_ADAPTER
_EPOCH = _scale_mod.epoch
_edge_apply = _edge.apply_batch
_F32_OVERFLOW = _scale_mod.F32_OVERFLOW


class Member(NamedTuple):
    """One C delta of a kernel entry: ``ptr`` (the ``lora_delta *``), ``scale`` (the `LoraScale`
    read once per call), ``factor`` (the alpha factor: the effective scale is ``scale.value *
    factor``), ``owner`` (the object whose ``resident_bytes`` count it, once per table) and
    ``extra`` (what a kind adds per member beyond the plain delta; None for LoRA)."""

    ptr: object
    scale: object
    factor: float
    owner: object
    extra: object = None


_TYPES = []      # entry types, in registration order
_STACKABLE = []  # the types a LoraStack may hold


def entry_type(cls=None, *, stackable=False):
    """Class decorator: `cls` implements the entry protocol (see the module docstring);
    ``stackable``: it may also be a member of a `LoraStack` (one kernel entry of one member)."""
    def register(cls):
        _TYPES.append(cls)
        if stackable:
            _STACKABLE.append(cls)
        return cls
    return register(cls) if cls is not None else register


def entry_types():
    return tuple(_TYPES)


def stackable_types():
    return tuple(_STACKABLE)


def owners(entry):
    """The distinct objects holding `entry`'s members' memory (for resident_bytes)."""
    seen = {}
    for group in entry._kernel_entries():
        for m in group:
            seen.setdefault(id(m.owner), m.owner)
    return list(seen.values())


def _kinds(types):
    return ", ".join(f"a {t.__name__}" for t in types)


def _shown(shape, expert_shape):
    """``[rows x cols]``, or ``E experts of [rows x cols]`` for a routed entry."""
    plain = f"[{shape[0]} x {shape[1]}]"
    return plain if expert_shape is None else f"{expert_shape[0]} experts of {plain}"


class EntryTable:
    """The C view of a list of entries (see the module docstring): the flat delta pointers,
    where each kernel entry starts, and the effective scales read once per call.  A
    `LoraStack` is a table of one entry, a `LoraBank` one of many; adapter sets build theirs
    per target.  ``routed``: entries may give several kernel entries each (the apply methods
    then take kernel-entry ids).
    """

    __slots__ = ("_entries", "_shape", "_expert_shape", "_what", "_routed", "stale", "members",
                 "ptrs", "first", "starts", "starts_c", "n_kernel", "_scale_objs", "_scale_idx",
                 "_factors", "_values", "_scales_c", "_epoch", "_c_batch", "_c_rows", "_dora",
                 "_fac_cache", "_edge", "_scales_pair", "__weakref__")

    def __init__(self, entries, what="bank entry", *, routed=False):
        self._entries = list(entries)
        self._shape = self._expert_shape = None
        self._what, self._routed = what, routed
        types = entry_types()
        shape_from = None
        for i, e in enumerate(self._entries):
            if e is not None and not isinstance(e, types):
                raise TypeError(f"{what} {i} must be {_kinds(types)} or None; "
                                f"got {type(e).__name__}")
            es = e.base_shape if e is not None else None
            if es is None:
                continue
            xs = getattr(e, "expert_shape", None)
            if self._shape is None:
                self._shape, self._expert_shape, shape_from = es, xs, i
            elif es != self._shape or xs != self._expert_shape:
                raise LoraShapeError(
                    f"{what} {i} is {_shown(es, xs)} but {what} {shape_from} is "
                    f"{_shown(self._shape, self._expert_shape)}; every entry must fit one base",
                    rows=es[0], cols=es[1])
        for e in self._entries:
            watch = getattr(e, "_watch", None)
            if watch is not None:
                watch(self)
        self.stale = True
        self._rebuild()

    def _rebuild(self):
        members, first, starts = [], [0], []
        for i, e in enumerate(self._entries):
            starts.append(len(first) - 1)
            if e is None:
                first.append(len(members))
                continue
            es = e.base_shape
            if es is not None:
                if self._shape is None:
                    self._shape, self._expert_shape = es, getattr(e, "expert_shape", None)
                if es != self._shape:
                    raise LoraShapeError(
                        f"entry {i} now holds a [{es[0]} x {es[1]}] delta but the base is "
                        f"[{self._shape[0]} x {self._shape[1]}]", rows=es[0], cols=es[1])
            groups = e._kernel_entries()
            if len(groups) != 1 and not self._routed:
                raise TypeError(f"{self._what} {i} ({type(e).__name__}) routes within the entry; "
                                f"it needs a routed table")
            for group in groups:
                members += group
                first.append(len(members))
        starts.append(len(first) - 1)
        scale_ids = {}
        self._scale_objs, self._scale_idx = [], []
        for m in members:
            k = scale_ids.get(id(m.scale))
            if k is None:
                k = scale_ids[id(m.scale)] = len(self._scale_objs)
                self._scale_objs.append(m.scale)
            self._scale_idx.append(k)
        self._factors = [m.factor for m in members]
        self.members = members
        # members with a row factor (DoRA): the C calls then carry the factor table
        self._dora = [q for q, m in enumerate(members) if m.extra is not None]
        self._fac_cache = None
        if self._dora:
            self._c_batch, self._c_rows = self._dora_batch, self._dora_rows
        else:
            self._c_batch, self._c_rows = _lora_apply_batch, _lora_apply_rows
        self.ptrs = ffi.new("lora_delta *[]", [m.ptr for m in members])
        self.first = ffi.new("int64_t[]", first)
        self.n_kernel = len(first) - 1
        self.starts = np.array(starts, np.int64)
        self.starts_c = ffi.new("int64_t[]", starts)
        self._values = None
        self._epoch = None
        self._scales_pair = None
        # lora._edge's view of a plain table (DoRA members need their factor tables: Python's
        # path): the numbers and addresses, and the arrays they point into, kept alive by it
        self._edge = None
        if not self._dora and self._shape is not None and self.n_kernel:
            self._edge = (self.n_kernel, address(self.first), address(self.ptrs),
                          self._shape[0], self._shape[1], self.first, self.ptrs)
        self.stale = False

    @property
    def base_shape(self):
        if self.stale:
            self._rebuild()
        return self._shape

    @property
    def expert_shape(self):
        """(n_experts, rows, cols) when the entries are experts, else None."""
        if self.stale:
            self._rebuild()
        return self._expert_shape

    def plain(self, method):
        """TypeError for a plain apply `method` on a table of experts (their calls route)."""
        if self._expert_shape is not None:
            raise TypeError(f"the entries are routed experts "
                            f"({_shown(self._shape, self._expert_shape)}): call add_experts_to "
                            f"(with expert ids) rather than {method}")

    @property
    def n_entries(self):
        return len(self._entries)

    @property
    def entries(self):
        """The entries as given (a new list each time)."""
        return list(self._entries)

    def entry(self, i):
        return self._entries[i]

    def scales(self):
        """double[] of each member's effective scale; each distinct LoraScale read once, and only
        when some LoraScale was set since the last call (the array is never changed in place:
        a call that runs meanwhile keeps the values it read)."""
        epoch = _EPOCH[0]
        if epoch == self._epoch:
            return self._scales_c
        values = [s._value for s in self._scale_objs]
        if values != self._values or self._scales_pair is None:
            idx, factors = self._scale_idx, self._factors
            c = ffi.new("double[]", [values[k] * f for k, f in zip(idx, factors)])
            self._scales_c, self._scales_pair = c, (address(c), c)  # the pair: lora._edge's
            self._values = values
        self._epoch = epoch
        return self._scales_c

    # ------------------------------------------------------- row factors (DoRA)
    def _factor_table(self, scales, idp, posp, every, n, gather):
        """(float *[] of row factors, stride, the factors' buffers to keep alive during the
        call) for lora_apply_*_dora: per member, or with
        per-position scales per adapter id and member; each DoRA member's factor for the
        float32 scale the kernels use at that place (the member's ``extra`` makes and caches
        it).  Ids and scales C will refuse are left to C (their slots stay NULL)."""
        if posp == NULL:
            cached = self._fac_cache
            if cached is not None and cached[0] is scales and cached[1] == gather:
                return cached[2], 0, cached[3]
            table = ffi.new("float *[]", len(self.members))
            keep = []  # the factors' buffers, alive while the table points at them
            for q in self._dora:
                keep.append(self.members[q].extra._factor_ptr(scales[q], gather))
                table[q] = keep[-1]
            self._fac_cache = (scales, gather, table, keep)
            return table, 0, keep
        nq = len(self.members)
        n_ids = (n + every - 1) // every
        table = ffi.new("float *[]", max(n_ids * nq, 1))
        keep = []
        dora, first, members = set(self._dora), self.first, self.members
        for i in range(n_ids):
            e = idp[i] if idp != NULL else 0
            if e < 0 or e >= self.n_kernel:
                continue
            mul = posp[i]
            for q in range(first[e], first[e + 1]):
                if q in dora:
                    s = scales[q] * mul
                    if abs(s) < _F32_OVERFLOW:
                        keep.append(members[q].extra._factor_ptr(s, gather))
                        table[i * nq + q] = keep[-1]
        return table, nq, keep

    def _dora_batch(self, n_kernel, first, ptrs, scales, idp, posp, every, rows, cols, n, xp, xc,
                    ldx, op, oc, ldo, bad):
        table, stride, keep = self._factor_table(scales, idp, posp, every, n, False)
        return _lora_apply_batch_dora(n_kernel, first, ptrs, scales, idp, posp, every, rows, cols,
                                      n, xp, xc, ldx, op, oc, ldo, table, stride, bad)

    def _dora_rows(self, n_kernel, first, ptrs, scales, idp, posp, every, rows, cols, n, ids, op,
                   oc, ldo, bad):
        table, stride, keep = self._factor_table(scales, idp, posp, every, n, True)
        return _lora_apply_rows_dora(n_kernel, first, ptrs, scales, idp, posp, every, rows, cols,
                                     n, ids, op, oc, ldo, table, stride, bad)

    def resident_bytes(self):
        if self.stale:
            self._rebuild()
        return sum(o.resident_bytes for o in {id(m.owner): m.owner for m in self.members}.values())

    # ------------------------------------------------------------------ apply
    def apply_vec(self, x, out):
        """Decode through entry 0: x ``[cols]`` -> out ``[rows]``; returns out.  The table must
        hold a delta (its shape is known)."""
        if self.stale:
            self._rebuild()
        rows, cols = shape = self._shape
        status = None
        edge = self._edge
        if edge is not None:  # the common case in C (lora._edge): NumPy arrays or plain tensors
            if _EPOCH[0] != self._epoch:
                self.scales()
            status = _edge_apply(edge, self._scales_pair, x, out, None, None, False)
            if status == 0:
                return out
            if status == DECLINE:
                status = None
        elif (type(x) is ndarray and type(out) is ndarray  # a table without an edge view (DoRA)
                and (xc := fast_code(id(x.dtype))) is not None
                and (oc := fast_code(id(out.dtype))) is not None
                and x.shape == (cols,) and out.shape == (rows,)):
            try:  # contiguous arrays of the exact shapes: no conversion, no copy
                xp, op = from_buffer(x), from_buffer(CHARS, out, True)
            except ValueError:  # not contiguous: the checked path
                pass
            else:
                status = _apply_vec(self, xp, xc, op, oc)
                if status == 0:
                    return out
        return dispatch.run_vec(_apply_vec, None, self, x, out, shape[1:], shape[:1], status)

    def apply_row(self, r, out_row):
        """One token's embedding delta through entry 0: out_row ``[cols]``; returns out_row."""
        if self.stale:
            self._rebuild()
        rows, cols = self._shape
        r = arrays.token_id(r, rows)
        op, oc, _, _ = arrays.check_out(out_row, (cols,), "out_row")
        ids = ffi.new("int64_t[1]", [r])
        status = self._c_rows(self.n_kernel, self.first, self.ptrs, self.scales(), NULL, NULL, 1,
                              rows, cols, 1, ids, op, oc, cols, NULL)
        if status:
            arrays.raise_status(status)
        return out_row

    def apply_batch(self, x, out, adapter_ids=None, scales=None):
        """The batched linear add for these entries: position b uses entry adapter_ids[b]
        (None: entry 0 everywhere), its scales times scales[b] (None: 1).  Returns out."""
        if self.stale:
            self._rebuild()
        if self._expert_shape is not None:
            self.plain("add_batch_to")
        shape = self._shape
        edge = self._edge
        if edge is not None:  # the common case in C (lora._edge); on anything else, or a C
            # error, the paths below take the call from the start (and raise what C refused)
            if _EPOCH[0] != self._epoch:
                self.scales()
            if _edge_apply(edge, self._scales_pair, x, out, adapter_ids, scales, True) == 0:
                return out
        status = None
        if (type(x) is ndarray and type(out) is ndarray
                and (xc := fast_code(id(x.dtype))) is not None
                and (oc := fast_code(id(out.dtype))) is not None
                and shape is not None and out.ndim == 2):
            # the common case (2-D rows, int64 ids, float64 scales or none), without the
            # general checks: C checks overlap, alignment, ids and scales before any write
            status = self._fast_batch(x, xc, out, oc, adapter_ids, scales, shape)
            if status == 0:
                return out
        elif adapter_ids is not None and (scales is not None or type(adapter_ids) is not ndarray):
            status = DECLINE  # not for the tensor fast path either (see _apply_batch)
        if shape is None:  # no entry holds a delta: no rows/cols to check against
            return self._shapeless_batch(x, out, adapter_ids, scales)
        return dispatch.run_batch(_apply_batch, None, (self, out, adapter_ids, scales), x, out,
                                  shape[1], shape[0], status)

    def _fast_batch(self, x, xc, out, oc, adapter_ids, scales, shape):
        """The ndarray call for arrays of the exact shapes and simple ids: its status, or None
        when the arrays, ids or scales are not of that form (the general path follows)."""
        rows, cols = shape
        n = out.shape[0]
        if out.shape[1] != rows or x.shape != (n, cols):
            return None
        idp, posp = NULL, NULL
        try:
            if adapter_ids is not None:
                if (type(adapter_ids) is not ndarray or adapter_ids.dtype is not _I64
                        or adapter_ids.shape != (n,)):
                    return None
                idp = from_buffer(INT64S, adapter_ids)
                if scales is not None:
                    if (type(scales) is not ndarray or scales.dtype is not _F64
                            or scales.shape != (n,)):
                        return None
                    posp = from_buffer(DOUBLES, scales)
            elif scales is not None:
                return None
            xp = from_buffer(x)
            op = from_buffer(CHARS, out, True)
        except ValueError:  # not contiguous: the general path
            return None
        if not n:
            return 0
        bad = ffi.new("int64_t *")
        status = self._c_batch(self.n_kernel, self.first, self.ptrs, self.scales(), idp, posp, 1,
                               rows, cols, n, xp, xc, cols, op, oc, rows, bad)
        if status and status != ERR_ALIGN:
            self._raise(status, adapter_ids, scales, bad=bad)
        return status

    def apply_rows(self, tok_ids, out, adapter_ids=None, scales=None):
        """The embedding-row gather for these entries; as apply_batch."""
        if self.stale:
            self._rebuild()
        if self._expert_shape is not None:
            self.plain("add_rows_to")
        shape = self._shape
        if shape is None:
            return self._shapeless_rows(tok_ids, out, adapter_ids, scales)
        rows, cols = shape
        tok, op, oc, ldo, n = dispatch.rows_args(tok_ids, out, cols, rows)
        ids, idp, pos, posp, every = self._ids(adapter_ids, scales, tok.shape)
        if n:
            bad = ffi.new("int64_t *")
            status = self._c_rows(self.n_kernel, self.first, self.ptrs, self.scales(), idp, posp,
                                  every, rows, cols, n, from_buffer(INT64S, tok), op, oc, ldo,
                                  bad)
            if status:
                self._raise(status, ids, pos, tok=tok, bad=bad)
        return out

    def _ids(self, adapter_ids, scales, lead):
        """(ids, ids ptr, scales, scales ptr, positions per id) for a call with leading axes
        `lead`; ids and scales of the leading shape or a prefix of it."""
        if adapter_ids is None:
            return None, NULL, None, NULL, 1
        ids = arrays.as_ids(adapter_ids, "adapter_ids", any_shape=True,
                            bound=len(self._entries))
        if len(lead) == 1 and ids.ndim == 1 and ids.shape[0] != lead[0]:
            raise ValueError(f"adapter_ids has {ids.shape[0]} ids; out has {lead[0]} positions")
        return with_scales(ids, scales, arrays.per_id_shape(ids, lead, "adapter_ids"))

    def _raise(self, status, ids, pos, tok=None, bad=None):
        rows = self._shape[0] if self._shape else 0
        arrays.raise_status(status, ids=tok, adapter_ids=ids, n_entries=len(self._entries),
                            rows=rows, bad=bad, scales=pos)

    # ---------------------------------------------- entries without any delta
    def _check_ids_only(self, adapter_ids, scales, lead):
        ids, _, pos, _, _ = self._ids(adapter_ids, scales, lead)
        if ids is None:
            return
        flat = ids.reshape(-1)
        wrong = np.flatnonzero((flat < -1) | (flat >= len(self._entries)))
        if wrong.size:
            self._raise(_ERR_ADAPTER, ids, pos, bad=ffi.new("int64_t *", int(wrong[0])))

    def _shapeless_batch(self, x, out, adapter_ids, scales):
        """The checks entries without any delta can still make (rows/cols unknown): out a
        writeable float array of at least 2 dims, x of the same leading axes, not overlapping,
        the ids and scales."""
        if not (isinstance(out, ndarray) or arrays.is_tensor(out)) or len(out.shape) < 2:
            arrays.batched_shape(out, "rows", "out")  # raises
        shape = tuple(out.shape)
        arrays.check_out(out, shape, batched=True)
        xa = x if arrays.is_tensor(x) else arrays.float_array(x, "x")
        if tuple(xa.shape[:-1]) != shape[:-1] or len(xa.shape) != len(shape):
            raise ValueError(f"x must have shape {shape[:-1] + ('cols',)} to match out "
                             f"{shape}; got {tuple(xa.shape)}")
        if arrays.is_tensor(xa):
            arrays.check_tensor_place(xa, "x")
            if not xa.dtype.is_floating_point:
                raise TypeError(f"x must be a real floating array; got dtype "
                                f"{arrays.dtype_name(xa)}")
        arrays.no_overlap(xa, out)
        self._check_ids_only(adapter_ids, scales, shape[:-1])
        return out

    def _shapeless_rows(self, tok_ids, out, adapter_ids, scales):
        if not (isinstance(out, ndarray) or arrays.is_tensor(out)) or len(out.shape) < 2:
            arrays.batched_shape(out, "cols", "out")  # raises
        shape = tuple(out.shape)
        arrays.check_out(out, shape, batched=True)
        tok = arrays.as_ids(tok_ids, "ids", any_shape=True)
        if tok.shape != shape[:-1]:
            if tok.ndim == 1 and len(shape) == 2:
                raise ValueError(f"ids has {tok.shape[0]} ids; out has {shape[0]} positions")
            raise ValueError(f"out must have shape {tok.shape + ('cols',)}; got {shape}")
        if tok.size and tok.min() < 0:
            pos = int(np.argmax(tok.reshape(-1) < 0))
            raise IndexError(f"token id {int(tok.reshape(-1)[pos])} at position "
                             f"{arrays.position_of(tok, pos)} is out of range")
        self._check_ids_only(adapter_ids, scales, tok.shape)
        return out


def with_scales(ids, scales, every):
    """(ids, ids ptr, scales, scales ptr, positions per id) of a bank call: int64 adapter ids
    checked for their shape, and `scales` (None, or real numbers of the ids' shape)."""
    if scales is None:
        return ids, from_buffer(INT64S, ids), None, NULL, every
    pos = arrays.as_scales(scales)
    if pos.shape != ids.shape:
        raise ValueError(f"scales must have the shape of adapter_ids, {ids.shape}; got "
                         f"{pos.shape}")
    return ids, from_buffer(INT64S, ids), pos, from_buffer(DOUBLES, pos), every


def _apply_vec(table, xp, xc, op, oc):
    """`EntryTable.apply_vec`'s C call in the dispatch's form (see lora._dispatch)."""
    rows, cols = table._shape
    return table._c_batch(table.n_kernel, table.first, table.ptrs, table.scales(), NULL, NULL, 1,
                          rows, cols, 1, xp, xc, cols, op, oc, rows, NULL)


def _apply_batch(extra, lead, n, xp, xc, ldx, op, oc, ldo):
    """`EntryTable.apply_batch`'s C call in the dispatch's form (see lora._dispatch); on the
    tensor fast path (``lead`` None) only for no ids, or int64 ids one per leading row of out
    (PEFT's adapter_names) with no scales: anything else declines to the checked path."""
    table, out, adapter_ids, scales = extra
    rows, cols = table._shape
    if lead is not None:
        ids, idp, pos, posp, every = table._ids(adapter_ids, scales, lead)
    else:
        ids, idp, pos, posp, every = adapter_ids, NULL, None, NULL, 1
        if scales is not None:
            return DECLINE
        if adapter_ids is not None:
            rows0 = out.shape[0]
            if (type(adapter_ids) is not ndarray or adapter_ids.dtype is not _I64
                    or adapter_ids.ndim != 1 or adapter_ids.shape[0] != rows0 or n % max(rows0, 1)):
                return DECLINE
            try:
                idp = from_buffer(INT64S, adapter_ids)
            except ValueError:  # strided ids
                return DECLINE
            every = max(n // max(rows0, 1), 1)
    if not n:
        return 0
    bad = ffi.new("int64_t *") if idp is not NULL or lead is not None else NULL
    status = table._c_batch(table.n_kernel, table.first, table.ptrs, table.scales(), idp, posp,
                            every, rows, cols, n, xp, xc, ldx, op, oc, ldo, bad)
    if status and (lead is not None or status == _ERR_ADAPTER):
        table._raise(status, ids, pos, bad=bad)
    return status

