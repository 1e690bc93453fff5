"""`LoraDelta` and `LoraStack`: the low-rank term s * B (A x), added in place.

Layouts (SPEC.md): lora_a = A [rank, cols], lora_b = B [rows, rank], a base W [rows, cols]
(= [n_out, n_in]).  Every add_* method validates all of its inputs before the first write,
makes one C call with the GIL released, and returns `out`.
"""

import math
import operator

import numpy as np

from . import _convert as cv
from ._lora_cffi import ffi, lib
from .errors import LoraShapeError
from .scale import LoraScale

__all__ = ["LoraDelta", "LoraStack"]

_ndarray = np.ndarray
_F32_MAX = float(np.finfo(np.float32).max)
_F32 = cv.F32
_from_buffer = ffi.from_buffer
_lora_add = lib.lora_add
_lora_add_batch = lib.lora_add_batch
_lora_add_rows = lib.lora_add_rows
_lora_apply_batch = lib.lora_apply_batch
_lora_apply_rows = lib.lora_apply_rows


def alpha_factor(alpha, rank, rslora):
    """llama.cpp `get_scale` / PEFT: alpha/rank, alpha/sqrt(rank) for rsLoRA, 1 when alpha == 0."""
    if alpha == 0:
        return 1.0
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def _int_arg(value, what):
    """An integer argument: an int or NumPy integer (not bool, float or str); TypeError else."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an integer; got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer; got {value!r}") from None


def _base_shape(base_shape):
    if isinstance(base_shape, (str, bytes)) or not hasattr(base_shape, "__len__") \
            or len(base_shape) != 2:
        raise ValueError(f"base_shape must be (rows, cols); got {base_shape!r}")
    return tuple(_int_arg(v, "base_shape") for v in base_shape)


def _finite_scale(s):
    """The effective scale of an offline op; ValueError unless finite in float32."""
    if not abs(s) <= _F32_MAX:
        raise ValueError(f"the effective scale {s} (scale x alpha factor) is not finite in "
                         f"float32")
    return s


def _check_merge_target(w, rows, cols):
    if not isinstance(w, np.ndarray):
        raise TypeError(f"w must be a numpy.ndarray of float32 [{rows} x {cols}]; "
                        f"got {type(w).__name__}")
    if w.dtype != _F32:
        raise TypeError(f"w must have dtype float32 (it is updated in place); got {w.dtype}")
    if w.shape != (rows, cols):
        raise ValueError(f"w must have shape ({rows}, {cols}) = [rows, cols]; got {w.shape}")
    if not w.flags.writeable:
        raise ValueError("w is read-only; it must be a writeable float32 array")
    if not (w.flags.c_contiguous or w.T.flags.c_contiguous):
        raise ValueError("w must be C-contiguous [rows, cols], or the transposed view of a "
                         f"C-contiguous [cols, rows] array (fan_in_fan_out); got strides {w.strides}")


def peft_delta(a, b, *, alpha, rslora=False, scale=1.0, dtype="float32"):
    """A `LoraDelta` under PEFT's scale rule, which differs from llama.cpp's only at alpha 0:
    PEFT scales by ``lora_alpha / r`` (``/ sqrt(r)`` for rsLoRA), so ``lora_alpha = 0`` gives a
    zero delta, where ``LoraDelta(alpha=0)`` means llama.cpp's "no alpha in the file", factor 1.
    The loaders build PEFT deltas through this."""
    delta = LoraDelta(a, b, alpha=alpha, scale=scale, rslora=rslora, dtype=dtype)
    if delta._alpha == 0:
        delta._alpha_factor = 0.0
    return delta


class LoraDelta:
    """One LoRA pair: adds ``effective_scale * B (A x)`` into a caller's output, in place.

    ``LoraDelta(a, b, *, alpha=0.0, scale=1.0, rslora=False, base_shape=None, dtype="float32")``

    - ``a``: lora_a, ``[rank, cols]``; ``b``: lora_b, ``[rows, rank]``; any real float array-like
      (float16, bfloat16 from ml_dtypes, float32, float64), copied into owned, aligned, packed
      storage of ``dtype`` ("float32" | "float16" | "bfloat16"), rounded to nearest even.
    - ``effective_scale = scale * alpha_factor``, ``alpha_factor = alpha / rank`` (PEFT, llama.cpp
      ``llama_adapter_lora`` ``get_scale``), ``alpha / sqrt(rank)`` when ``rslora`` (PEFT
      ``use_rslora``), and 1 when ``alpha == 0`` (llama.cpp: no alpha in the file).
    - ``scale``: a float (a new ``LoraScale``) or a ``LoraScale`` to share; read once per call.
    - ``base_shape=(rows, cols)``: checked against the pair when given.

    Raises ``LoraShapeError`` when the pair does not fit (rank 0 included), ``TypeError`` for a
    non-float array, ``ValueError`` for non-finite values or alpha, or values that overflow the
    storage dtype.  Compute is float32 in every case; results are deterministic for one ISA path
    and dtype, identical for every thread count and batch size.
    """

    __slots__ = ("_ptr", "_rank", "_rows", "_cols", "_alpha", "_rslora", "_dtype", "_scale",
                 "_alpha_factor", "_xshape", "_oshape", "__weakref__")

    def __init__(self, a, b, *, alpha=0.0, scale=1.0, rslora=False, base_shape=None,
                 dtype="float32"):
        a = cv.float_array(a, "lora_a")
        b = cv.float_array(b, "lora_b")
        rank = a.shape[0] if a.ndim == 2 else 0
        cols = a.shape[1] if a.ndim == 2 else 0
        rows = b.shape[0] if b.ndim == 2 else 0
        if base_shape is not None:
            rows, cols = _base_shape(base_shape)
        if a.ndim != 2 or b.ndim != 2:
            err = LoraShapeError.for_pair(rows, cols, rank, a.size, b.size)
            raise LoraShapeError(
                f"{err}; lora_a must be 2-D [rank, cols] and lora_b 2-D [rows, rank] (got shapes "
                f"{a.shape} and {b.shape}; LoraDelta.from_flat takes flat buffers)",
                rows=rows, cols=cols, rank=rank, a_len=a.size, b_len=b.size)
        if (rank < 1 or rows < 1 or cols < 1
                or a.shape != (rank, cols) or b.shape != (rows, rank)):
            raise LoraShapeError.for_pair(rows, cols, rank, a.size, b.size)
        self._init(a, b, rank, rows, cols, alpha, scale, rslora, dtype)

    @classmethod
    def from_flat(cls, a, b, rank, rows, cols, *, alpha=0.0, scale=1.0, rslora=False,
                  dtype="float32"):
        """A delta from flat buffers: ``a`` holds rank x cols values (lora_a row-major), ``b``
        rows x rank (lora_b row-major).  Raises ``LoraShapeError`` naming every dimension when
        the lengths do not match, or rank/rows/cols < 1."""
        rank, rows, cols = (_int_arg(v, n) for v, n in ((rank, "rank"), (rows, "rows"),
                                                         (cols, "cols")))
        a = cv.float_array(a, "lora_a").reshape(-1)
        b = cv.float_array(b, "lora_b").reshape(-1)
        if rank < 1 or rows < 1 or cols < 1 or a.size != rank * cols or b.size != rows * rank:
            raise LoraShapeError.for_pair(rows, cols, rank, a.size, b.size)
        self = cls.__new__(cls)
        self._init(a.reshape(rank, cols), b.reshape(rows, rank), rank, rows, cols, alpha, scale,
                   rslora, dtype)
        return self

    def _init(self, a, b, rank, rows, cols, alpha, scale, rslora, dtype):
        name = cv.storage_name(dtype)
        if isinstance(alpha, (str, bytes, bool, np.bool_)):
            raise TypeError(f"alpha must be a real number; got {alpha!r}")
        if not isinstance(rslora, (bool, np.bool_)):
            raise TypeError(f"rslora must be True or False; got {rslora!r}")
        try:
            alpha = float(alpha)
        except OverflowError:
            raise ValueError(f"alpha must be finite; got {alpha!r}") from None
        except (TypeError, ValueError):
            raise TypeError(f"alpha must be a real number; got {alpha!r}") from None
        if not math.isfinite(alpha):
            raise ValueError(f"alpha must be finite; got {alpha}")
        if not isinstance(scale, LoraScale):
            scale = LoraScale(scale)
        a_bits = cv.to_storage(a, name, "lora_a")
        b_bits = cv.to_storage(b, name, "lora_b")
        ptr = lib.lora_delta_new(cv.STORAGE[name][0], rank, rows, cols, _from_buffer(a_bits),
                                 _from_buffer(b_bits))
        if ptr == ffi.NULL:
            raise MemoryError(f"cannot allocate a rank-{rank} [{rows} x {cols}] {name} delta")
        self._ptr = ffi.gc(ptr, lib.lora_delta_free)
        self._rank, self._rows, self._cols = rank, rows, cols
        self._alpha, self._rslora, self._dtype = alpha, bool(rslora), name
        self._scale = scale
        self._alpha_factor = alpha_factor(alpha, rank, self._rslora)
        self._xshape, self._oshape = (cols,), (rows,)

    # ------------------------------------------------------------ properties
    rank = property(lambda self: self._rank, doc="The LoRA rank r.")
    rows = property(lambda self: self._rows, doc="n_out: rows of the base and of lora_b.")
    cols = property(lambda self: self._cols, doc="n_in: columns of the base and of lora_a.")
    alpha = property(lambda self: self._alpha, doc="lora_alpha (0 = none: factor 1).")
    rslora = property(lambda self: self._rslora, doc="True when alpha is divided by sqrt(rank).")
    dtype = property(lambda self: self._dtype, doc='Storage dtype: "float32" | "float16" | "bfloat16".')
    scale = property(lambda self: self._scale, doc="The LoraScale read at every call (shared).")
    base_shape = property(lambda self: (self._rows, self._cols), doc="(rows, cols) of the base.")

    @property
    def effective_scale(self):
        """``scale.value * alpha_factor``: the s of ``out += s * B (A x)`` right now."""
        return self._scale._value * self._alpha_factor

    @property
    def resident_bytes(self):
        """rank * (rows + cols) * itemsize of the storage dtype (logical; padding not counted)."""
        return self._rank * (self._rows + self._cols) * (4 if self._dtype == "float32" else 2)

    def __repr__(self):
        return (f"LoraDelta(rank={self._rank}, rows={self._rows}, cols={self._cols}, "
                f"alpha={self._alpha}, dtype={self._dtype!r}, scale={self._scale._value})")

    # ---------------------------------------------------------------- apply
    def add_to(self, x, out):
        """Decode: ``out[rows] += s * B (A x[cols])``; returns ``out``.

        ``out``: writeable C-contiguous float32 ``[rows]`` (never copied).  ``x``: real float
        ``[cols]``; float32 C-contiguous is used as is, anything else is converted (a copy).
        Raises TypeError/ValueError naming expected vs actual; ``out`` is untouched on error.
        """
        if (type(x) is _ndarray and type(out) is _ndarray and x.dtype is _F32
                and out.dtype is _F32 and x.shape == self._xshape and out.shape == self._oshape):
            try:
                xp = _from_buffer(x)
                op = _from_buffer(out, require_writable=True)
            except ValueError:
                x, xp, op = cv.prepare_vec(x, out, self._cols, self._rows)
        else:
            x, xp, op = cv.prepare_vec(x, out, self._cols, self._rows)
        # always one C call: it checks x/out overlap, then skips all arithmetic at scale 0
        status = _lora_add(self._ptr, self._scale._value * self._alpha_factor, xp, 0, op, 0)
        if status == lib.LORA_ERR_ALIGN:  # rare: a view at an odd byte offset; checks + copy
            x, xp, op = cv.prepare_vec(x, out, self._cols, self._rows)
            status = _lora_add(self._ptr, self._scale._value * self._alpha_factor, xp, 0, op, 0)
        if status:
            cv.raise_status(status)
        return out

    def add_batch_to(self, x, out):
        """Prefill: ``out[b] += s * B (A x[b])`` for every row b; returns ``out``.

        ``x``: real float ``[batch, cols]``; ``out``: writeable float32 ``[batch, rows]``, C-contiguous
        or row-strided (``strides[-1] == 4``, e.g. ``qkv[:, :d]``), written in place.  Row b is
        bit-identical to ``add_to(x[b], out[b])``.
        """
        if (type(x) is _ndarray and type(out) is _ndarray and x.dtype is _F32
                and out.dtype is _F32 and out.ndim == 2 and out.shape[1] == self._rows
                and x.shape == (out.shape[0], self._cols)):
            try:  # C-contiguous float32 of the right shapes: no conversion, no copy
                xp, ldx = _from_buffer(x), self._cols
                op, ldo = _from_buffer(out, require_writable=True), self._rows
                batch = out.shape[0]
            except ValueError:
                x, xp, ldx, op, ldo, batch = cv.prepare_mat(x, out, self._cols, self._rows)
        else:
            x, xp, ldx, op, ldo, batch = cv.prepare_mat(x, out, self._cols, self._rows)
        if batch:
            s = self._scale._value * self._alpha_factor
            status = _lora_add_batch(self._ptr, s, batch, xp, 0, ldx, op, 0, ldo)
            if status == lib.LORA_ERR_ALIGN:  # rare: a view at an odd byte offset
                x, xp, ldx, op, ldo, batch = cv.prepare_mat(x, out, self._cols, self._rows)
                status = _lora_add_batch(self._ptr, s, batch, xp, 0, ldx, op, 0, ldo)
            if status:
                cv.raise_status(status)
        return out

    def add_row_to(self, r, out_row):
        """Token embedding: ``out_row[cols] += s * (B[r] @ A)``; ``r`` an int in ``[0, rows)``.

        Raises TypeError for a non-integer id, IndexError for one out of range (no wrap-around).
        """
        r = cv.token_id(r, self._rows)
        op, _ = cv.check_out(out_row, self._xshape, "out_row")
        ids = ffi.new("int64_t[1]", [r])
        status = _lora_add_rows(self._ptr, self._scale._value * self._alpha_factor, 1, ids, op,
                                0, self._cols, ffi.NULL)
        if status:
            cv.raise_status(status)
        return out_row

    def add_rows_to(self, ids, out):
        """A prompt's embedding deltas: ``out[i] += s * (B[ids[i]] @ A)``; returns ``out``.

        ``ids``: integer ``[n]`` (bool/float: TypeError; any id outside ``[0, rows)``: IndexError
        naming it and its position, raised before anything is written); ``out``: float32
        ``[n, cols]``, C-contiguous or row-strided.  Row i is bit-identical to ``add_row_to``.
        """
        op, ldo, n = cv.check_rows_out(out, self._cols)
        ids = cv.as_ids(ids, "ids", n)
        if n:
            bad = ffi.new("int64_t *")
            # the C call checks every id before its first write, also at scale 0
            status = _lora_add_rows(self._ptr, self._scale._value * self._alpha_factor, n,
                                    _from_buffer("int64_t[]", ids), op, 0, ldo, bad)
            if status:
                cv.raise_status(status, ids=ids, rows=self._rows, bad=bad)
        return out

    # -------------------------------------------------------------- offline
    def _export(self):
        code, np_dtype = cv.STORAGE[self._dtype]
        bits = np.float32 if self._dtype == "float32" else np.uint16
        a = np.empty((self._rank, self._cols), bits)
        b = np.empty((self._rows, self._rank), bits)
        lib.lora_delta_export(self._ptr, _from_buffer(a, require_writable=True),
                              _from_buffer(b, require_writable=True))
        return a.view(np_dtype), b.view(np_dtype)

    def lora_weights(self):
        """(lora_a [rank, cols], lora_b [rows, rank]) as stored, in the storage dtype (copies)."""
        return self._export()

    def _delta64(self, s):
        a, b = self._export()
        return s * (b.astype(np.float64) @ a.astype(np.float64))

    def delta_weight(self):
        """``s * B @ A`` as a new float32 ``[rows, cols]`` array (computed in float64 by NumPy)."""
        return self._delta64(_finite_scale(self.effective_scale)).astype(np.float32)

    def merge_into(self, w):
        """``w += s * B @ A`` in place (w float32 ``[rows, cols]``: C-contiguous, or the transposed
        view of a C-contiguous ``[cols, rows]`` array, as PEFT ``fan_in_fan_out`` bases are);
        returns ``w``.  Scale 0 leaves ``w`` bit-identical.  Uses NumPy (not bit-guaranteed)."""
        _check_merge_target(w, self._rows, self._cols)
        s = _finite_scale(self.effective_scale)
        if s != 0.0:
            np.add(w, self._delta64(s), out=w, casting="same_kind")
        return w

    def unmerge_from(self, w):
        """``w -= s * B @ A`` in place; undoes ``merge_into`` within float32 rounding."""
        _check_merge_target(w, self._rows, self._cols)
        s = _finite_scale(self.effective_scale)
        if s != 0.0:
            np.subtract(w, self._delta64(s), out=w, casting="same_kind")
        return w


class LoraStack:
    """Several deltas of one ``rows x cols`` base applied as one: their sum, in order.

    ``LoraStack(deltas=())``; ``.append(d)``; ``len``, iteration, ``stack[i]`` (the very objects
    stored); ``.resident_bytes``; the four ``add_*`` methods of ``LoraDelta``, bit-identical to
    applying the deltas one after another in order (one C call).  A delta whose effective scale
    is 0 is skipped; an empty stack adds nothing.  A delta of another shape: ``LoraShapeError``.
    """

    def __init__(self, deltas=()):
        self._deltas = []
        self._ptrs = ffi.new("lora_delta *[]", 0)
        self._version = 0
        for d in deltas:
            self.append(d)

    def append(self, delta):
        """Add ``delta`` at the end; raises TypeError for a non-LoraDelta, LoraShapeError when its
        ``rows x cols`` differ from the stack's."""
        if not isinstance(delta, LoraDelta):
            raise TypeError(f"a LoraStack holds LoraDelta objects; got {type(delta).__name__}")
        if self._deltas and delta.base_shape != self.base_shape:
            r, c = self.base_shape
            raise LoraShapeError(
                f"delta {len(self._deltas)} is [{delta.rows} x {delta.cols}] but the stack's "
                f"deltas are [{r} x {c}]", rows=delta.rows, cols=delta.cols, rank=delta.rank)
        deltas = self._deltas + [delta]
        self._ptrs = ffi.new("lora_delta *[]", [d._ptr for d in deltas])
        self._first = ffi.new("int64_t[2]", [0, len(deltas)])
        self._deltas = deltas
        self._version += 1

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

    rows = property(lambda self: self._deltas[0].rows if self._deltas else None)
    cols = property(lambda self: self._deltas[0].cols if self._deltas else None)

    @property
    def resident_bytes(self):
        """Sum of the distinct deltas' resident_bytes."""
        return sum(d.resident_bytes for d in {id(d): d for d in self._deltas}.values())

    def _scales(self):
        return cv.effective_scales(self._deltas)


    def add_to(self, x, out):
        """Decode: ``out[rows] += sum_i s_i * B_i (A_i x[cols])``, deltas in order; returns ``out``."""
        if not self._deltas:
            return cv.check_shapeless(x, out, ndim=1)
        rows, cols = self.base_shape
        x, xp, op = cv.prepare_vec(x, out, cols, rows)
        status = _lora_apply_batch(1, self._first, self._ptrs, self._scales(), ffi.NULL, ffi.NULL, 1,
                                   rows, cols, 1, xp, 0, cols, op, 0, rows, ffi.NULL)
        if status:
            cv.raise_status(status)
        return out

    def add_batch_to(self, x, out):
        """Prefill: ``out[b] += sum_i s_i * B_i (A_i x[b])``; as ``LoraDelta.add_batch_to``."""
        if not self._deltas:
            return cv.check_shapeless(x, out, ndim=2)
        rows, cols = self.base_shape
        x, xp, ldx, op, ldo, batch = cv.prepare_mat(x, out, cols, rows)
        if batch:
            status = _lora_apply_batch(1, self._first, self._ptrs, self._scales(), ffi.NULL, ffi.NULL,
                                       1, rows, cols, batch, xp, 0, ldx, op, 0, ldo, ffi.NULL)
            if status:
                cv.raise_status(status)
        return out

    def add_row_to(self, r, out_row):
        """Token embedding: ``out_row += sum_i s_i * (B_i[r] @ A_i)``; as ``LoraDelta.add_row_to``."""
        if not self._deltas:
            cv.token_id(r, None)
            return cv.check_shapeless(cv._NO_X, out_row, ndim=1, what="out_row")
        rows, cols = self.base_shape
        r = cv.token_id(r, rows)
        op, _ = cv.check_out(out_row, (cols,), "out_row")
        ids = ffi.new("int64_t[1]", [r])
        status = _lora_apply_rows(1, self._first, self._ptrs, self._scales(), ffi.NULL, ffi.NULL, 1,
                                  rows, cols, 1, ids, op, 0, cols, ffi.NULL)
        if status:
            cv.raise_status(status)
        return out_row

    def add_rows_to(self, ids, out):
        """Embedding rows: ``out[i] += sum_k s_k * (B_k[ids[i]] @ A_k)``; as ``LoraDelta.add_rows_to``."""
        if not self._deltas:
            cv.check_shapeless(cv._NO_X, out, ndim=2)
            cv.check_shapeless_token_ids(ids, out.shape[0])
            return out
        rows, cols = self.base_shape
        op, ldo, n = cv.check_rows_out(out, cols)
        ids = cv.as_ids(ids, "ids", n)
        if n:
            bad = ffi.new("int64_t *")
            status = _lora_apply_rows(1, self._first, self._ptrs, self._scales(), ffi.NULL,
                                      ffi.NULL, 1, rows, cols, n, _from_buffer("int64_t[]", ids),
                                      op, 0, ldo, bad)
            if status:
                cv.raise_status(status, ids=ids, rows=rows, bad=bad)
        return out

    def delta_weight(self):
        """``sum_i s_i * B_i @ A_i`` as float32 ``[rows, cols]`` (NumPy, float64 accumulation)."""
        if not self._deltas:
            raise ValueError("an empty LoraStack has no shape, so no delta_weight")
        total = sum(d._delta64(_finite_scale(d.effective_scale)) for d in self._deltas)
        return np.asarray(total, dtype=np.float32)

    def merge_into(self, w):
        """Each delta's ``merge_into(w)``, in order; returns ``w``."""
        if not self._deltas:
            return cv.check_shapeless(cv._NO_X, w, ndim=2, what="w")
        for d in self._deltas:
            d.merge_into(w)
        return w

    def unmerge_from(self, w):
        """Each delta's ``unmerge_from(w)``, in reverse order; returns ``w``."""
        if not self._deltas:
            return cv.check_shapeless(cv._NO_X, w, ndim=2, what="w")
        for d in reversed(self._deltas):
            d.unmerge_from(w)
        return w
