"""The entry table: the one C view of a list of entries that deltas, stacks, banks, adapter sets,
DoRA deltas, experts and `accelerate_peft` share, and the protocol through which an entry type
joins it.

An *entry* is what one adapter slot holds: a `LoraDelta`, a `LoraStack` (its members applied
in order, in one fused pass), a `DoraDelta`, `LoraExperts`, or None (nothing); later kinds join
the same way.  The kernels see *kernel entries*: ranges of C deltas applied in order, each delta
with its effective scale and its epilogue.

The protocol an entry type implements (and registers with `entry_type`):

- ``base_shape``: ``(rows, cols)`` of the base every member fits, or None while it holds none;
- ``expert_shape`` (optional, for a kind that routes): ``(n_experts, rows, cols)``; entries of
  one table agree on it as on ``base_shape`` (a plain entry has none, so the two kinds never
  share a table);
- ``_kernel_entries()``: a tuple of kernel entries, each a tuple of `Member` (pointer, scale
  object, alpha factor, owner, per-member extra).  A delta or a stack gives one kernel entry;
  a kind that routes within an entry (experts: one kernel entry per expert) gives several, and
  its table is built with ``routed=True``, where ``starts[i]`` is entry i's first kernel entry
  (``starts_c``: the same as a C array, the routing of ``LORA_OP_EXPERTS``);
- ``_watch(table)`` (optional): an entry that can change after a table holds it (a stack being
  appended to) keeps the tables and sets ``table.stale = True`` on each change.

A member's ``extra`` is its epilogue (None: plain), the extension point of a LoRA variant: an
object with ``_epilogue`` (its kind, lora.h's ``LORA_EPI_*``), ``_gathers`` (whether its data
serves the gathers or the projections), ``_epi_check(gather)`` (TypeError for the other kind of
call) and ``_epi_data(s)`` (its data for effective scale s, as a C float array: DoRA's row
factor).  The table turns members into the C arrays once (rebuilt when stale) and reads the
scales, making the epilogues' data with them, only when some `LoraScale` changed (`scales`).
"""

from typing import NamedTuple

import numpy as np

from . import _apply
from . import _arrays as arrays
from . import _status
from . import _torch as torchs
from . import _edge
from . import scale as _scale_mod
from ._apply import address
from ._lora_cffi import ffi, lib
from .errors import LoraShapeError

__all__ = ["Member", "entry_type", "entry_types", "stackable_types", "owners", "EntryTable"]

_ERR_ADAPTER = lib.LORA_ERR_ADAPTER
_EPOCH = _scale_mod.epoch
_edge_apply = _edge.apply
_F32_OVERFLOW = _scale_mod.F32_OVERFLOW
_GATHER_OPS = (_apply.OP_ROW, _apply.OP_ROWS)


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
    where each kernel entry starts, the epilogue of each member, and the effective scales read
    once per call.  A `LoraStack` is a table of one entry, a `LoraBank` one of many; adapter
    sets build theirs per target.  ``routed``: entries may give several kernel entries each
    (experts: the apply methods then route with expert ids).

    Every apply goes through `apply`: the edge (lora._edge) first, with this table's view,
    then lora._apply's checked path, for which the table is the target.
    """

    __slots__ = ("_entries", "_shape", "_expert_shape", "_what", "_routed", "stale", "members",
                 "ptrs", "first", "starts", "starts_c", "n_kernel", "_scale_objs", "_scale_idx",
                 "_factors", "_values", "_scales_c", "_epoch", "_epi", "_epi_kinds", "_epi_op",
                 "_epi_data", "_view", "_scales_pair", "__weakref__")

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
        # members with an epilogue (a DoRA row factor: the member's extra makes its data)
        self._epi = [q for q, m in enumerate(members) if m.extra is not None]
        self._epi_kinds = self._epi_op = None
        if self._epi:
            self._epi_kinds = ffi.new("uint8_t[]", [m.extra._epilogue if m.extra is not None else 0
                                                    for m in members])
            gathers = {m.extra._gathers for m in members if m.extra is not None}
            # the op the members' epilogue data serves (-1: members for both, none served)
            self._epi_op = ((_apply.OP_ROWS if gathers == {True} else _apply.OP_BATCH)
                            if len(gathers) == 1 else -1)
        self.ptrs = ffi.new("lora_delta *[]", [m.ptr for m in members])
        self.first = ffi.new("int64_t[]", first)
        self.n_kernel = len(first) - 1
        self.starts = np.array(starts, np.int64)
        self.starts_c = ffi.new("int64_t[]", starts)
        self._values = None
        self._epoch = None
        self._scales_pair = None
        self._epi_data = None
        # lora._edge's view of the table (the numbers and addresses, and the arrays they point
        # into, kept alive by it); None while no entry holds a delta
        self._view = None
        if self._shape is not None and self.n_kernel:
            eshape = self._expert_shape
            self._view = _edge.view(self.n_kernel, address(self.first), address(self.ptrs),
                                    self._shape[0], self._shape[1],
                                    address(self._epi_kinds) if self._epi else 0,
                                    self._epi_op if self._epi else -1,
                                    len(self._entries) if eshape is not None else 0,
                                    address(self.starts_c) if eshape is not None else 0,
                                    eshape[0] if eshape is not None else 0,
                                    (self.first, self.ptrs, self._epi_kinds, self.starts_c))
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
        a call that runs meanwhile keeps the values it read).  The members' epilogue data for
        these scales is made with them."""
        epoch = _EPOCH[0]
        if epoch == self._epoch:
            return self._scales_c
        values = [s._value for s in self._scale_objs]
        if values != self._values or self._scales_pair is None:
            idx, factors = self._scale_idx, self._factors
            c = ffi.new("double[]", [values[k] * f for k, f in zip(idx, factors)])
            epi = self._epi_table(c) if self._epi and self._epi_op != -1 else None
            self._scales_c, self._epi_data = c, epi
            self._scales_pair = (address(c), address(epi[0]) if epi is not None else 0, c, epi)
            self._values = values
        self._epoch = epoch
        return self._scales_c

    # ------------------------------------------------------------ the apply target
    def edge_view(self):
        """lora._edge's view of the table, or None while no entry holds a delta."""
        if self.stale:
            self._rebuild()
        return self._view

    def edge_scales(self):
        """The scales (and epilogue data) as lora._edge takes them."""
        if _EPOCH[0] != self._epoch or self._scales_pair is None:
            self.scales()
        return self._scales_pair

    def apply(self, op, x, out, ids=None, scales=None, extra=None):
        """One apply call (lora._apply's ops): the edge, then the checked path; returns out."""
        if self.stale:
            self._rebuild()
        view = self._view
        if view is not None:
            if _EPOCH[0] != self._epoch:
                self.scales()
            if _edge_apply(view, self._scales_pair, op, x, out, ids, scales, extra, None) == 0:
                return out
        return _apply.checked(self, op, x, out, ids, scales, extra)

    def epi_arg(self, op, ids, pos, n):
        """For lora._apply: a TypeError for an op the members' epilogues do not serve, and the
        epilogue data of a call with per-position scales (None otherwise)."""
        if not self._epi:
            return None
        gather = op in _GATHER_OPS
        for q in self._epi:
            self.members[q].extra._epi_check(gather)
        if pos is None:
            self.scales()  # raises, naming the row, where a factor cannot be made
            return None
        table, stride, keep = self._epi_per_id(self.scales(), ids, pos, n)
        return (address(table), stride, table, keep)

    # ------------------------------------------------------------ epilogue data (DoRA)
    def _epi_table(self, scales):
        """(float *[] of each member's epilogue data for these scales, the buffers it points
        into): the member's ``extra`` makes and caches it (a DoRA row factor for the float32
        scale the kernels use)."""
        table = ffi.new("float *[]", len(self.members))
        keep = []
        for q in self._epi:
            keep.append(self.members[q].extra._epi_data(scales[q]))
            table[q] = keep[-1]
        return table, keep

    def _epi_per_id(self, scales, ids, pos, n):
        """(float *[] per adapter id and member, stride, the buffers it points into) for a call
        with per-position scales: each epilogue member's data for the scale of that position.
        Ids and scales C will refuse are left to C (their slots stay NULL)."""
        nq = len(self.members)
        flat_ids = ids.reshape(-1) if ids is not None else None
        flat_pos = pos.reshape(-1)
        n_ids = flat_pos.shape[0]
        table = ffi.new("float *[]", max(n_ids * nq, 1))
        keep = []
        epi, first, members = set(self._epi), self.first, self.members
        for i in range(n_ids):
            e = int(flat_ids[i]) if flat_ids is not None else 0
            if e < 0 or e >= self.n_kernel:
                continue
            mul = float(flat_pos[i])
            for q in range(first[e], first[e + 1]):
                if q in epi:
                    s = scales[q] * mul
                    if abs(s) < _F32_OVERFLOW:
                        keep.append(members[q].extra._epi_data(s))
                        table[i * nq + q] = keep[-1]
        return table, nq, keep

    def resident_bytes(self):
        if self.stale:
            self._rebuild()
        return sum(o.resident_bytes for o in {id(m.owner): m.owner for m in self.members}.values())

    # ------------------------------------------------------------ the methods' calls
    def apply_vec(self, x, out):
        """Decode through entry 0: x ``[cols]`` -> out ``[rows]``; returns out."""
        return self.apply(_apply.OP_VEC, x, out)

    def apply_row(self, r, out_row):
        """One token's embedding delta through entry 0: out_row ``[cols]``; returns out_row."""
        return self.apply(_apply.OP_ROW, r, out_row)

    def apply_batch(self, x, out, adapter_ids=None, scales=None):
        """The batched linear add for these entries: position b uses entry adapter_ids[b]
        (None: entry 0 everywhere), its scales times scales[b] (None: 1).  Returns out."""
        return self.apply(_apply.OP_BATCH, x, out, adapter_ids, scales)

    def apply_rows(self, tok_ids, out, adapter_ids=None, scales=None):
        """The embedding-row gather for these entries; as apply_batch."""
        return self.apply(_apply.OP_ROWS, tok_ids, out, adapter_ids, scales)

    def apply_experts(self, x, out, expert_ids, adapter_ids=None, scales=None):
        """The routed add of a table of experts entries; as apply_batch, with expert ids."""
        return self.apply(_apply.OP_EXPERTS, x, out, adapter_ids, scales, expert_ids)

    def _raise(self, status, ids, pos, tok=None, bad=None):
        rows = self._shape[0] if self._shape else 0
        _status.raise_status(status, ids=tok, adapter_ids=ids, n_entries=len(self._entries),
                            rows=rows, bad=bad, scales=pos)

    # ---------------------------------------------- entries without any delta
    def shapeless(self, op, x, out, ids, scales, eids=None):
        """The checks a table none of whose entries holds a delta can still make (rows and cols
        unknown); adds nothing."""
        if op == _apply.OP_EXPERTS:
            return self._shapeless_experts(x, out, eids, ids, scales)
        if op in _GATHER_OPS:
            return self._shapeless_rows(x, out, ids, scales)
        return self._shapeless_batch(x, out, ids, scales)

    def _check_ids_only(self, adapter_ids, scales, lead):
        if adapter_ids is None:
            return
        ids, pos = _apply.bank_ids(adapter_ids, scales, lead, len(self._entries))
        flat = ids.reshape(-1)
        wrong = np.flatnonzero((flat < -1) | (flat >= len(self._entries)))
        if wrong.size:
            self._raise(_ERR_ADAPTER, ids, pos, bad=[int(wrong[0])])

    def _shapeless_batch(self, x, out, adapter_ids, scales):
        """out a writeable float array of at least 2 dims, x of the same leading axes, not
        overlapping, the ids and scales."""
        if not (isinstance(out, np.ndarray) or torchs.is_tensor(out)) or len(out.shape) < 2:
            arrays.batched_shape(out, "rows", "out")  # raises
        shape = tuple(out.shape)
        arrays.check_out(out, shape, batched=True)
        xa = x if torchs.is_tensor(x) else arrays.float_array(x, "x")
        if tuple(xa.shape[:-1]) != shape[:-1] or len(xa.shape) != len(shape):
            raise ValueError(f"x must have shape {shape[:-1] + ('cols',)} to match out "
                             f"{shape}; got {tuple(xa.shape)}")
        if torchs.is_tensor(xa):
            torchs.check_tensor_place(xa, "x")
            if not xa.dtype.is_floating_point:
                raise TypeError(f"x must be a real floating array; got dtype "
                                f"{arrays.dtype_name(xa)}")
        arrays.no_overlap(xa, out)
        self._check_ids_only(adapter_ids, scales, shape[:-1])
        return out

    def _shapeless_rows(self, tok_ids, out, adapter_ids, scales):
        if not (isinstance(out, np.ndarray) or torchs.is_tensor(out)) or len(out.shape) < 2:
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
                             f"{_status.position_of(tok, pos)} is out of range")
        self._check_ids_only(adapter_ids, scales, tok.shape)
        return out

    def _shapeless_experts(self, x, out, eids, ids, pos):
        """A table none of whose entries holds experts: out and x checked as arrays, the ids
        checked as far as they can be (no expert count: only -1 and up), nothing added."""
        if not (isinstance(out, np.ndarray) or torchs.is_tensor(out)) or len(out.shape) < 2:
            arrays.batched_shape(out, "rows", "out")  # raises
        arrays.check_out(out, tuple(out.shape), batched=True)
        if torchs.is_tensor(x):
            torchs.check_tensor_place(x, "x")
            if not x.dtype.is_floating_point:
                raise TypeError(f"x must be a real floating array; got dtype "
                                f"{arrays.dtype_name(x)}")
        arrays.no_overlap(x, out)
        flat = _apply._np_ids(eids).reshape(-1)
        wrong = np.flatnonzero(flat < -1)
        if wrong.size:
            _apply.raise_experts(lib.LORA_ERR_INDEX, self, eids, None, None, int(wrong[0]))
        if ids is not None:
            af = ids.reshape(-1)
            wrong = np.flatnonzero((af < -1) | (af >= len(self._entries)))
            if wrong.size:
                _apply.raise_experts(_ERR_ADAPTER, self, eids, ids, pos, int(wrong[0]))
        return out
