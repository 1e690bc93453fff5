"""`DoraDelta`: PEFT's DoRA (weight-decomposed LoRA), the LoRA term rescaled to a learned magnitude.

For a Linear layer (``embedding=False``), per output row i::

    y = g * (W x + s * B (A x)) + bias        g_i = m_i / |W_i + s * (B A)_i|

The norm needs the base weight W.  It is read once, into float64 statistics (``|W_i|^2``,
``W A^T``, ``A A^T``, made in C), from which the norm for any scale follows in O(rows * r^2):
a scale change never re-reads W.  The row factor g is that float64 ratio rounded once to
float32; the kernels apply it inside their accumulate (``out <- g * (out + s * B (A x))``, in
float32, a half-precision ``out`` rounded once).  With ``embedding=True`` the rule is PEFT's
DoRA embedding: m and g per column of the ``[vocab, dim]`` table, each column's norm over the
vocab.
"""

import numpy as np

from .. import _arrays as arrays
from .. import _status
from .. import _torch as torchs
from .. import _dtypes as dtypes
from .._byvalue import ByValue
from .._entries import EntryTable, Member, entry_type
from .._lora_cffi import ffi, lib
from .._merge import _w_array, finite_scale
from .delta import LoraDelta
from ..errors import LoraShapeError

__all__ = ["DoraDelta"]

_F64 = np.float64
_F32 = np.float32
_FLOATS = ffi.typeof("float[]")
_DOUBLES = ffi.typeof("double[]")
_CACHE = 16  # row factors kept per delta (distinct float32 scales, e.g. a bank's positions)


def _base_array(base, rows, cols, what="base"):
    """A NumPy view of the base weight (no copy for float32/float16/bfloat16; any other real
    float dtype becomes float32), checked to be ``[rows, cols]``."""
    arr = arrays.float_array(base, what)
    if arr.ndim != 2 or arr.shape != (rows, cols):
        raise LoraShapeError(f"{what} must be the [{rows} x {cols}] base weight the DoRA pair "
                             f"adapts ([rows, cols], or the transposed view of a [cols, rows] "
                             f"array); got shape {tuple(arr.shape)}", rows=rows, cols=cols)
    if arrays.np_code(arr.dtype) is None:
        arr = arr.astype(_F32)
    if any(st % arr.itemsize or st < 0 for st in arr.strides) \
            or arr.__array_interface__["data"][0] % arr.itemsize:
        arr = np.ascontiguousarray(arr)
    if not np.isfinite(arr).all():
        i, j = (int(v) for v in np.argwhere(~np.isfinite(arr))[0])
        raise ValueError(f"{what} has a non-finite value ({arr[i, j]}) at [{i}, {j}]")
    return arr


def _restore(delta, magnitude, sq, vp, gram, embedding, merged):
    """Unpickling and deep copies (see `DoraDelta._parts`): over the pair (a `LoraDelta`, by
    value in turn), the magnitude and the base statistics as they were; the base itself is never
    pickled (the delta never keeps it).  Checked as the constructor checks them."""
    if not isinstance(delta, LoraDelta):
        raise TypeError(f"a DoraDelta is rebuilt over a LoraDelta; got {type(delta).__name__}")
    self = DoraDelta.__new__(DoraDelta)
    self._init(delta, magnitude, None, embedding, stats=(sq, vp, gram))
    self._merged = [np.array(g, dtype=_F32) for g in merged]
    return self


@entry_type(stackable=True)
class DoraDelta(ByValue):
    """A DoRA adapter of one layer: PEFT's ``use_dora=True``, magnitude-scaled LoRA.

    ``DoraDelta(a, b, magnitude, base, *, alpha=0.0, scale=1.0, rslora=False, dtype="float32",
    embedding=False)``

    - ``a`` [rank, cols], ``b`` [rows, rank], ``alpha``, ``scale``, ``rslora``, ``dtype``: as
      `LoraDelta` (the effective scale s = scale * alpha factor).
    - ``magnitude``: PEFT's ``lora_magnitude_vector``, ``[rows]`` (one per output row), or
      ``[cols]`` with ``embedding=True`` (one per column of the ``[vocab, dim]`` table).
    - ``base``: the base weight ``[rows, cols]`` (float32, float16 or bfloat16, any layout, e.g.
      the transposed view of a ``fan_in_fan_out`` weight), read once into float64 statistics and
      not kept.  A base changed in place afterwards needs ``set_base(w)``.

    Linear (``embedding=False``): ``add_to`` / ``add_batch_to`` take ``out = W x`` *without
    the bias* and leave ``g * (out + s * B (A x))``, ``g_i = m_i / |W_i + s (B A)_i|`` (the
    bias is added by the caller afterwards, as PEFT does).  ``embedding=True``: ``add_rows_to``
    (and ``add_row_to``) take ``out = E[ids]`` and leave ``g * (out + s * B[ids] A)`` with g
    per column.  Scale 0 is not "no adapter": it leaves ``(m / |W|) * out``, as PEFT does.

    Not a `LoraDelta` (``isinstance`` is False).  ``.norm`` is the float32 norm for the current
    scale, ``.magnitude`` the float32 magnitude, ``delta_weight()`` ``s * B @ A``.  Raises
    `LoraShapeError` for a pair or base that does not fit, ValueError for a magnitude of the
    wrong length or non-finite values, and ValueError naming the row (column) whose norm is 0,
    before anything is written.
    """

    __slots__ = ("_delta", "_embedding", "_mag", "_mag_c", "_sq", "_vp", "_gram", "_stats_c",
                 "_g", "_merged", "_table", "__weakref__")

    def __init__(self, a, b, magnitude, base, *, alpha=0.0, scale=1.0, rslora=False,
                 dtype="float32", embedding=False):
        self._init(LoraDelta(a, b, alpha=alpha, scale=scale, rslora=rslora, dtype=dtype),
                   magnitude, base, embedding)

    @classmethod
    def _over(cls, delta, magnitude, base, embedding=False):
        """A DoRA delta over an existing `LoraDelta` (package-internal: the loaders build the
        pair under PEFT's scale rule first)."""
        self = cls.__new__(cls)
        self._init(delta, magnitude, base, embedding)
        return self

    def _init(self, delta, magnitude, base, embedding, stats=None):
        if not isinstance(embedding, (bool, np.bool_)):
            raise TypeError(f"embedding must be True or False; got {embedding!r}")
        self._delta = delta
        self._embedding = bool(embedding)
        n = delta.cols if embedding else delta.rows
        mag = arrays.float_array(magnitude, "magnitude")
        if mag.ndim != 1 or mag.shape[0] != n:
            want = "cols (one per column of the embedding table)" if embedding else \
                "rows (one per output row)"
            raise ValueError(f"magnitude must have {n} values = {want}; got shape "
                             f"{tuple(mag.shape)}")
        bad = ~(np.abs(mag) <= np.finfo(_F32).max)  # NaN, inf, or past float32's range
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"magnitude has a value that is not a finite float32 ({mag[i]}) at "
                             f"index {i}")
        mag = np.array(mag, dtype=_F32)
        self._mag = mag
        self._mag_c = ffi.from_buffer(_FLOATS, mag)
        self._merged = []
        if stats is None:
            self._set_base(base)
        else:
            self._set_stats(*(np.array(v, dtype=_F64) for v in stats))
        self._table = EntryTable([self], "DoRA delta")

    # ------------------------------------------------------------ statistics
    def _set_base(self, base):
        d = self._delta
        arr = _base_array(base, d.rows, d.cols)
        n = d.cols if self._embedding else d.rows
        r = d.rank
        sq, vp, gram = np.empty(n, _F64), np.empty((n, r), _F64), np.empty((r, r), _F64)
        st_r, st_c = (s // arr.itemsize for s in arr.strides)
        ld_i, ld_k = (st_c, st_r) if self._embedding else (st_r, st_c)
        keep = tuple(ffi.from_buffer(_DOUBLES, v) for v in (sq, vp, gram))
        ptr = ffi.cast("void *", arr.__array_interface__["data"][0])
        status = lib.lora_dora_stats(d._ptr, int(self._embedding), ptr, arrays.np_code(arr.dtype),
                                     ld_i, ld_k, *keep)
        if status:
            _status.raise_status(status)
        self._set_stats(sq, vp, gram)

    def _set_stats(self, sq, vp, gram):
        d = self._delta
        n = d.cols if self._embedding else d.rows
        if sq.shape != (n,) or vp.shape != (n, d.rank) or gram.shape != (d.rank, d.rank):
            raise ValueError(f"DoRA statistics of shapes {sq.shape}, {vp.shape}, {gram.shape} do "
                             f"not fit a rank-{d.rank} [{d.rows} x {d.cols}] pair")
        if not (np.isfinite(sq).all() and np.isfinite(vp).all() and np.isfinite(gram).all()
                and (sq >= 0).all()):
            raise ValueError("DoRA statistics with a non-finite value or a negative squared norm "
                             "(not what a base gives: a corrupt pickle?)")
        self._sq, self._vp, self._gram = sq, vp, gram
        self._stats_c = tuple(ffi.from_buffer(_DOUBLES, v) for v in (sq, vp, gram))
        self._g = {}

    def set_base(self, w):
        """Re-read the base weight ``w`` (``[rows, cols]``, as the constructor takes it): after
        the caller changed the base in place, or to move the adapter to another base.  Returns
        self.  The row factors are recomputed at the next call."""
        self._set_base(w)
        return self

    def _factor(self, s):
        """(g, norm, g as a C pointer) for the effective scale s rounded to float32 (the value
        the kernels use), made once per distinct value; ValueError naming a zero-norm row."""
        key = float(_F32(s))
        hit = self._g.get(key)
        if hit is not None:
            return hit
        n = self._mag.shape[0]
        g, norm = np.empty(n, _F32), np.empty(n, _F32)
        gp = ffi.from_buffer(_FLOATS, g)
        bad = ffi.new("int64_t *")
        status = lib.lora_dora_factor(self._delta._ptr, int(self._embedding), *self._stats_c,
                                      self._mag_c, key, gp, ffi.from_buffer(_FLOATS, norm), bad)
        if status == lib.LORA_ERR_NORM:
            what = "column" if self._embedding else "row"
            raise ValueError(f"DoRA {what} {int(bad[0])}: its factor magnitude / norm of the "
                             f"base + s * B @ A is not a finite float32 at effective scale "
                             f"{key!r} (norm 0, or too small for that magnitude); nothing "
                             f"was written")
        if status:
            _status.raise_status(status)
        if len(self._g) >= _CACHE:
            self._g.clear()
        hit = self._g[key] = (g, norm, gp)
        return hit

    # ------------------------------------------------------------ the epilogue (lora._entries)
    _epilogue = lib.LORA_EPI_ROW_FACTOR  # what this member does after its term: a row factor

    @property
    def _gathers(self):
        """The op the row factors serve: the gathers (an embedding) or the projections."""
        return self._embedding

    def _epi_check(self, gather):
        """TypeError for a call of the other kind (a gather on a Linear DoRA delta, or a
        projection on an embedding one)."""
        if gather != self._embedding:
            if self._embedding:
                raise TypeError("this DoraDelta adapts an embedding (embedding=True): use "
                                "add_rows_to / add_row_to, not the Linear add_to / add_batch_to")
            raise TypeError("this DoraDelta adapts a Linear layer: use add_to / add_batch_to; "
                            "add_rows_to needs a DoraDelta made with embedding=True")

    def _epi_data(self, s):
        """The row factor g for effective scale s as a C array (which keeps g alive): the
        data of this member's row-factor epilogue."""
        return self._factor(s)[2]

    # ------------------------------------------------------------ properties
    rank = property(lambda self: self._delta.rank, doc="The LoRA rank r.")
    rows = property(lambda self: self._delta.rows, doc="rows of the base (n_out; vocab).")
    cols = property(lambda self: self._delta.cols, doc="cols of the base (n_in; dim).")
    alpha = property(lambda self: self._delta.alpha, doc="lora_alpha (0 = none: factor 1).")
    rslora = property(lambda self: self._delta.rslora, doc="True when alpha / sqrt(rank).")
    dtype = property(lambda self: self._delta.dtype, doc="Storage dtype of A and B.")
    scale = property(lambda self: self._delta.scale, doc="The LoraScale read at every call.")
    base_shape = property(lambda self: self._delta.base_shape, doc="(rows, cols) of the base.")
    embedding = property(lambda self: self._embedding,
                         doc="True: PEFT's DoRA embedding rule (m and g per column).")

    @property
    def effective_scale(self):
        """``scale.value * alpha_factor``, the s of the formula right now."""
        return self._delta.effective_scale

    @property
    def magnitude(self):
        """m, float32 (a copy): ``[rows]``, or ``[cols]`` with ``embedding=True``."""
        return self._mag.copy()

    @property
    def norm(self):
        """The float32 norm ``|W + s B A|`` per row (per column with ``embedding=True``) for the
        current effective scale (a copy)."""
        return self._factor(finite_scale(self.effective_scale))[1].copy()

    @property
    def resident_bytes(self):
        """The pair's bytes (as `LoraDelta`) plus the magnitude (float32) and the float64 base
        statistics: ``|W_i|^2``, ``W A^T`` and ``A A^T``."""
        return (self._delta.resident_bytes + self._mag.nbytes + self._sq.nbytes
                + self._vp.nbytes + self._gram.nbytes)

    def __repr__(self):
        d = self._delta
        kind = ", embedding=True" if self._embedding else ""
        return (f"DoraDelta(rank={d.rank}, rows={d.rows}, cols={d.cols}, alpha={d.alpha}, "
                f"dtype={d.dtype!r}, scale={d.scale.value}{kind})")

    def _kernel_entries(self):
        """The entry protocol (lora._entries): one member, the pair, with this delta as the
        member's extra (its row factors)."""
        d = self._delta
        return ((Member(d._ptr, d._scale, d._alpha_factor, self, self),),)

    # ------------------------------------------------------------ pickling, copies
    def _parts(self):
        """By value (lora._byvalue): the pair, the magnitude and the float64 base statistics
        (not the base, which the delta never keeps); the copy computes the same bits."""
        return _restore, (self._delta, self._mag.copy(), self._sq.copy(), self._vp.copy(),
                          self._gram.copy(), self._embedding,
                          tuple(g.copy() for g in self._merged))

    # ------------------------------------------------------------ apply
    def add_to(self, x, out):
        """Decode (Linear): ``out[rows] <- g * (out + s * B (A x[cols]))`` with ``out = W x``
        without bias; returns ``out``.  Inputs as `LoraDelta.add_to`."""
        self._linear("add_to")
        return self._table.apply_vec(x, out)

    def add_batch_to(self, x, out):
        """Prefill (Linear): ``out[..., :] <- g * (out + s * B (A x[..., :]))``; inputs as
        `LoraDelta.add_batch_to`; each position bit-identical to ``add_to`` on it alone."""
        self._linear("add_batch_to")
        return self._table.apply_batch(x, out)

    def add_row_to(self, r, out_row):
        """One token (embedding=True): ``out_row[cols] <- g * (out_row + s * B[r] @ A)`` with
        ``out_row = E[r]``; returns ``out_row``."""
        self._gather("add_row_to")
        return self._table.apply_row(r, out_row)

    def add_rows_to(self, ids, out):
        """Embedding rows (embedding=True): ``out[..., :] <- g * (out + s * B[ids] @ A)`` with
        ``out = E[ids]``, g per column; inputs as `LoraDelta.add_rows_to`."""
        self._gather("add_rows_to")
        return self._table.apply_rows(ids, out)

    def _linear(self, method):
        if self._embedding:
            raise TypeError(f"this DoraDelta adapts an embedding (embedding=True): {method} is "
                            f"for Linear layers; use add_rows_to")

    def _gather(self, method):
        if not self._embedding:
            raise TypeError(f"this DoraDelta adapts a Linear layer: {method} needs a DoraDelta "
                            f"made with embedding=True; use add_to / add_batch_to")

    # ------------------------------------------------------------ offline
    def _delta64(self, s, rows=slice(None)):
        return self._delta._delta64(s, rows)

    def lora_weights(self):
        """(lora_a [rank, cols], lora_b [rows, rank]) as stored (copies)."""
        return self._delta.lora_weights()

    def delta_weight(self):
        """``s * B @ A`` as a new float32 ``[rows, cols]`` array, as `LoraDelta.delta_weight`
        (without the magnitude: the merged weight is ``merge_into``'s)."""
        return self._delta.delta_weight()

    def merge_into(self, w):
        """PEFT's DoRA merge, in place: ``w <- g * (w + s * B @ A)`` with g from the norm of
        ``w + s * B @ A`` for ``w`` as it is before the merge (per row; per column with
        ``embedding=True``), formed in float64, g rounded to float32 once and the result once to
        ``w``'s dtype; returns ``w``.  ``w`` as `LoraDelta.merge_into` takes it.  A zero norm
        or an overflow is a ValueError with ``w`` untouched.  Scale 0 still rescales by
        ``m / |w|``."""
        arr, code = _w_array(w, self.rows, self.cols)
        s = finite_scale(self.effective_scale)
        v = arr.astype(_F64) + self._delta64(s)
        axis = 0 if self._embedding else 1
        nrm = np.sqrt(np.sum(v * v, axis=axis))
        zero = np.flatnonzero(~(nrm > 0))
        if zero.size:
            what = "column" if self._embedding else "row"
            raise ValueError(f"merging into w: {what} {int(zero[0])} of w + s * B @ A has norm 0, "
                             f"so its DoRA factor is not finite; w is left untouched")
        g64 = self._mag.astype(_F64) / nrm
        over = np.abs(g64) > np.finfo(_F32).max
        if over.any():
            what = "column" if self._embedding else "row"
            i = int(np.argmax(over))
            raise ValueError(f"merging into w: the DoRA factor m / norm of {what} {i} "
                             f"({g64[i]:.3g}) overflows float32; w is left untouched")
        g = g64.astype(_F32)
        gv = g[None, :] if self._embedding else g[:, None]
        self._write(w, arr, code, v * gv.astype(_F64), "merging into")
        self._merged.append(g)
        return w

    def unmerge_from(self, w):
        """Undo the last ``merge_into`` of this delta (PEFT's rule: ``w <- w / g - s * B @ A``
        with that merge's g), within float32 rounding; returns ``w``.  ValueError when no merge
        came before."""
        if not self._merged:
            raise ValueError("unmerge_from without a merge_into before it: a DoRA unmerge "
                             "divides by the row factor of the merge it undoes")
        arr, code = _w_array(w, self.rows, self.cols)
        s = finite_scale(self.effective_scale)
        g = self._merged[-1].astype(_F64)
        gv = g[None, :] if self._embedding else g[:, None]
        self._write(w, arr, code, arr.astype(_F64) / gv - self._delta64(s), "unmerging from")
        self._merged.pop()
        return w

    @staticmethod
    def _write(w, arr, code, v, verb):
        name = dtypes.NAME_OF[code]
        res = dtypes.round_to(v, name)
        if not np.isfinite(res.astype(_F32)).all():
            i, j = (int(t) for t in np.argwhere(~np.isfinite(res.astype(_F32)))[0])
            raise ValueError(f"{verb} w overflows its dtype {name} at [{i}, {j}]: {v[i, j]:.9g} "
                             f"(largest finite: {dtypes.LARGEST[name]:.9g}); w is left untouched")
        arr[...] = res
        if torchs.is_tensor(w):
            torchs.torch_module().autograd.graph.increment_version(w)
