"""`LoraStack`: several deltas of one base applied as one, in order, in one fused C pass."""

import weakref

import numpy as np

from .. import _arrays as arrays
from .. import _torch as torchs
from .._byvalue import ByValue
from .._entries import EntryTable, entry_type, owners, stackable_types
from .._merge import finite_scale, merge_, shapeless_w
from ..errors import LoraShapeError

__all__ = ["LoraStack"]

_ndarray = np.ndarray


@entry_type
class LoraStack(ByValue):
    """Several deltas of one ``rows x cols`` base applied as one: their sum, in order.

    ``LoraStack(deltas=())``; ``.append(d)``; ``len``, iteration, ``stack[i]`` (the very objects
    stored); ``.resident_bytes``; the four ``add_*`` methods of ``LoraDelta``, bit-identical to
    applying the deltas one after another in order to a float32 ``out`` (one fused C pass: ``x``
    read once per block, ``out`` written once); a half-precision ``out`` gets the float32 result
    rounded once, not once per delta.  A delta whose effective scale is 0 is skipped; an empty
    stack adds nothing.  A delta of another shape: ``LoraShapeError``.

    Pickling and ``copy.deepcopy`` keep the deltas by value (as `LoraDelta`'s; one delta or
    `LoraScale` in several places stays one); ``copy.copy`` is a new stack of the same deltas.
    """

    __slots__ = ("_deltas", "_owners", "_table", "__weakref__")

    def __init__(self, deltas=()):
        self._deltas = []
        self._owners = weakref.WeakSet()  # tables holding this stack: made stale on append
        self._table = None
        for d in deltas:
            self.append(d)
        self._table = EntryTable([self], "stack")

    def append(self, delta):
        """Add ``delta`` at the end; raises TypeError for a non-LoraDelta, LoraShapeError when its
        ``rows x cols`` differ from the stack's, ValueError for a DoRA delta whose norm axis
        (rows, or columns with ``embedding=True``) differs from the stack's DoRA members'."""
        kinds = stackable_types()
        if not isinstance(delta, kinds):
            raise TypeError(f"a LoraStack holds {' or '.join(t.__name__ for t in kinds)} "
                            f"objects; got {type(delta).__name__}")
        if self._deltas and delta.base_shape != self.base_shape:
            r, c = self.base_shape
            raise LoraShapeError(
                f"delta {len(self._deltas)} is [{delta.rows} x {delta.cols}] but the stack's "
                f"deltas are [{r} x {c}]", rows=delta.rows, cols=delta.cols, rank=delta.rank)
        axis = getattr(delta, "embedding", None)  # a DoRA member's norm axis (None: plain)
        if axis is not None and any(getattr(d, "embedding", axis) != axis for d in self._deltas):
            raise ValueError(f"delta {len(self._deltas)} is a DoRA delta normalised per "
                             f"{'column (embedding=True)' if axis else 'row (a Linear layer)'}, "
                             f"but the stack's DoRA members are normalised per "
                             f"{'row' if axis else 'column'}: one layer has one kind")
        self._deltas = self._deltas + [delta]
        for table in list(self._owners):
            table.stale = True

    def _parts(self):
        """By value (lora._byvalue): the deltas, in order."""
        return LoraStack, (list(self._deltas),)

    # ------------------------------------------------------------ entry protocol
    def _kernel_entries(self):
        """One kernel entry: every member's, in order."""
        return (tuple(m for d in self._deltas for m in d._kernel_entries()[0]),)

    def _watch(self, table):
        self._owners.add(table)

    # ------------------------------------------------------------ container
    def __len__(self):
        return len(self._deltas)

    def __iter__(self):
        return iter(list(self._deltas))

    def __getitem__(self, i):
        return self._deltas[i]

    def __repr__(self):
        return f"LoraStack({len(self._deltas)} deltas, base_shape={self.base_shape})"

    @property
    def base_shape(self):
        """(rows, cols) shared by every delta; None for an empty stack."""
        return self._deltas[0].base_shape if self._deltas else None

    rows = property(lambda self: self._deltas[0].rows if self._deltas else None,
                    doc="n_out shared by every delta; None for an empty stack.")
    cols = property(lambda self: self._deltas[0].cols if self._deltas else None,
                    doc="n_in shared by every delta; None for an empty stack.")

    @property
    def resident_bytes(self):
        """Sum of the distinct deltas' resident_bytes."""
        return sum(o.resident_bytes for o in owners(self))

    # ------------------------------------------------------------ apply
    def add_to(self, x, out):
        """Decode: ``out[rows] += sum_i s_i * B_i (A_i x[cols])``, deltas in order; returns ``out``."""
        if not self._deltas:
            return _shapeless_vec(x, out)
        return self._table.apply_vec(x, out)

    def add_batch_to(self, x, out):
        """Prefill: ``out[..., :] += sum_i s_i * B_i (A_i x[..., :])``; as ``LoraDelta.add_batch_to``."""
        return self._table.apply_batch(x, out)

    def add_row_to(self, r, out_row):
        """Token embedding: ``out_row += sum_i s_i * (B_i[r] @ A_i)``; as ``LoraDelta.add_row_to``."""
        if not self._deltas:
            arrays.token_id(r, None)
            return _shapeless_vec(_NO_X, out_row, "out_row")
        return self._table.apply_row(r, out_row)

    def add_rows_to(self, ids, out):
        """Embedding rows: ``out[..., :] += sum_k s_k * (B_k[ids[...]] @ A_k)``; as
        ``LoraDelta.add_rows_to``."""
        return self._table.apply_rows(ids, out)

    # ------------------------------------------------------------ offline
    def delta_weight(self):
        """``sum_i s_i * B_i @ A_i`` as float32 ``[rows, cols]`` (NumPy, float64 accumulation)."""
        if not self._deltas:
            raise ValueError("an empty LoraStack has no shape, so no delta_weight")
        total = sum(d._delta64(finite_scale(d.effective_scale)) for d in self._deltas)
        return np.asarray(total, dtype=np.float32)

    def merge_into(self, w):
        """``w += sum_i s_i * B_i @ A_i`` in place, the sum formed in float64 and rounded once to
        ``w``'s dtype (as ``LoraDelta.merge_into``); returns ``w``.  A stack holding a
        `DoraDelta` merges its members one after another in order instead (PEFT merges several
        adapters so), each DoRA member by its own rule on ``w`` as the members before it left
        it."""
        if not self._deltas:
            return shapeless_w(w)
        if self._has_dora():
            for d in self._deltas:
                d.merge_into(w)
            return w
        return merge_(w, [(d, 1.0) for d in self._deltas], *self.base_shape)

    def unmerge_from(self, w):
        """``w -= sum_i s_i * B_i @ A_i`` in place; undoes ``merge_into`` within the rounding of
        ``w``'s dtype (with a `DoraDelta` member: each member unmerged, in reverse order)."""
        if not self._deltas:
            return shapeless_w(w)
        if self._has_dora():
            for d in reversed(self._deltas):
                d.unmerge_from(w)
            return w
        return merge_(w, [(d, -1.0) for d in self._deltas], *self.base_shape)

    def _has_dora(self):
        return any(m.extra is not None for m in self._kernel_entries()[0])


_NO_X = object()


def _shapeless_vec(x, out, what="out"):
    """The checks an empty stack can still make for add_to / add_row_to: out a writeable 1-D
    float array (of any length), x (unless None) real float 1-D, not overlapping out."""
    if (isinstance(out, _ndarray) or torchs.is_tensor(out)) and len(out.shape) != 1:
        raise ValueError(f"{what} must be 1-D; got shape {tuple(out.shape)}")
    shape = tuple(getattr(out, "shape", ()))
    arrays.check_out(out, shape, what, shown="(n,)")
    if x is not _NO_X:
        xa = x if torchs.is_tensor(x) else arrays.float_array(x, "x")
        if len(xa.shape) != 1:
            raise ValueError(f"x must have shape [cols] to match {what} {shape}; got "
                             f"{tuple(xa.shape)}")
        arrays.no_overlap(xa, out)
    return out
