"""`LoraDelta` and `LoraStack`: the low-rank term s * B (A x), added in place, and the one C
view of entries (a delta, a stack's members, a bank's slots) that stacks, banks and adapter sets
share.

Layouts: lora_a = A [rank, cols], lora_b = B [rows, rank], a base W [rows, cols] (= [n_out,
n_in]).  Every add_* method validates all of its inputs before the first write, makes one C call
with the GIL released, and returns `out`.
"""

import math
import operator
import weakref

import numpy as np

from . import _arrays as arrays
from . import _dtypes as dtypes
from ._lora_cffi import ffi, lib
from .errors import LoraShapeError
from . import scale as _scale_mod
from .scale import LoraScale

__all__ = ["LoraDelta", "LoraStack"]

_ndarray = np.ndarray
_F64 = np.dtype(np.float64)
_I64 = arrays.I64
_from_buffer = ffi.from_buffer
# from_buffer(_CHARS, out, True) asks for a writable buffer at half the cost of the keyword form
# (cffi's keyword parsing measured ~0.2 us per call)
_CHARS = ffi.typeof("char[]")
_INT64S = ffi.typeof("int64_t[]")
_cast = ffi.cast
_VOIDP = ffi.typeof("void *")
_NULL = ffi.NULL
_lora_add = lib.lora_add
_lora_add_batch = lib.lora_add_batch
_lora_add_rows = lib.lora_add_rows
_lora_add_at = lib.lora_add_at
_lora_add_batch_at = lib.lora_add_batch_at
_lora_apply_batch = lib.lora_apply_batch
_lora_apply_rows = lib.lora_apply_rows
_ERR_ALIGN = lib.LORA_ERR_ALIGN
_EPOCH = _scale_mod.epoch
_FAST = dtypes.FAST  # the fast paths' activation dtype codes (see lora._dtypes)


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
    """The effective scale of an offline op; ValueError unless finite in float32 (the kernels'
    rule: a double that rounds to a finite float32 is finite)."""
    if not abs(s) < _scale_mod.F32_OVERFLOW:
        raise ValueError(f"the effective scale {s} (scale x alpha factor) is not finite in "
                         f"float32")
    return s


def _pair_error(a, b, rank, rows, cols, base_shape):
    """The LoraShapeError for a 2-D pair that does not fit: the fixed wording first, then both
    shapes as given, the base's, and a hint when the two look swapped or transposed."""
    err = LoraShapeError.for_pair(rows, cols, rank, a.size, b.size)
    pair = f"got lora_a {a.shape} as [rank, cols] and lora_b {b.shape} as [rows, rank]"
    hints = []
    if base_shape is not None and a.ndim == 2 and b.ndim == 2 and a.shape[0] == b.shape[1]:
        hints.append(f"the pair is [{b.shape[0]} x {a.shape[1]}] at rank {a.shape[0]}, the base "
                     f"given is {tuple(base_shape)}")
    elif base_shape is not None:
        hints.append(f"the base given is {tuple(base_shape)}")
    if a.ndim != 2 or b.ndim != 2:
        hints.append("lora_a and lora_b must be 2-D (LoraDelta.from_flat takes flat buffers)")
    elif a.shape[0] != b.shape[1]:
        if a.shape[1] == b.shape[0]:
            hints.append("lora_a and lora_b swapped? (lora_a is [rank, cols], lora_b "
                         "[rows, rank])")
        elif a.shape[1] == b.shape[1] or a.shape[0] == b.shape[0]:
            hints.append("one factor transposed? (lora_a is [rank, cols], lora_b [rows, rank])")
    return LoraShapeError(f"{err}; {pair}" + "".join(f"; {h}" for h in hints),
                          rows=rows, cols=cols, rank=rank, a_len=a.size, b_len=b.size)


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
                 "_alpha_factor", "_xshape", "_oshape", "_keep", "__weakref__")

    def __init__(self, a, b, *, alpha=0.0, scale=1.0, rslora=False, base_shape=None,
                 dtype="float32"):
        a = arrays.float_array(a, "lora_a")
        b = arrays.float_array(b, "lora_b")
        rank = a.shape[0] if a.ndim == 2 else 0
        cols = a.shape[1] if a.ndim == 2 else 0
        rows = b.shape[0] if b.ndim == 2 else 0
        if base_shape is not None:
            base_shape = _base_shape(base_shape)
            rows, cols = base_shape
        if (a.ndim != 2 or b.ndim != 2 or rank < 1 or rows < 1 or cols < 1
                or a.shape != (rank, cols) or b.shape != (rows, rank)):
            raise _pair_error(a, b, rank, rows, cols, base_shape)
        self._init(a, b, rank, rows, cols, alpha, scale, rslora, dtype)

    @classmethod
    def from_flat(cls, a, b, rank, rows, cols, *, alpha=0.0, scale=1.0, rslora=False,
                  dtype="float32"):
        """A delta from flat buffers: ``a`` holds rank x cols values (lora_a row-major), ``b``
        rows x rank (lora_b row-major).  Raises ``LoraShapeError`` naming every dimension when
        the lengths do not match, or rank/rows/cols < 1."""
        rank, rows, cols = (_int_arg(v, n) for v, n in ((rank, "rank"), (rows, "rows"),
                                                         (cols, "cols")))
        a = arrays.float_array(a, "lora_a").reshape(-1)
        b = arrays.float_array(b, "lora_b").reshape(-1)
        if rank < 1 or rows < 1 or cols < 1 or a.size != rank * cols or b.size != rows * rank:
            raise LoraShapeError.for_pair(rows, cols, rank, a.size, b.size)
        self = cls.__new__(cls)
        self._init(a.reshape(rank, cols), b.reshape(rows, rank), rank, rows, cols, alpha, scale,
                   rslora, dtype)
        return self

    @classmethod
    def view(cls, a, b, *, dtype, rank, rows, cols, a_by_row=False, b_by_row=False, scale,
             alpha_factor=1.0, keep=None):
        """A delta over the caller's memory, not copied (package-internal: PEFT's own tensors
        under ``accelerate_peft``).  ``a``, ``b``: ``(address, row length in elements)``;
        A is rows of ``[rank, lda]`` (``a_by_row``: A^T, rows of ``[cols, lda]``), B is B^T,
        rows of ``[rank, ldb]`` (``b_by_row``: B, rows of ``[rows, ldb]``).  ``keep`` is held
        so the memory outlives the delta; writes to it are seen by the next call."""
        name = dtypes.storage_name(dtype)
        ptr = lib.lora_delta_view(dtypes.CODES[name], rank, rows, cols, ffi.cast("void *", a[0]),
                                  a[1], int(a_by_row), ffi.cast("void *", b[0]), b[1],
                                  int(b_by_row))
        if ptr == ffi.NULL:
            raise ValueError(f"cannot view a rank-{rank} [{rows} x {cols}] {name} delta with row "
                             f"lengths {a[1]} / {b[1]}")
        self = cls.__new__(cls)
        self._ptr = ffi.gc(ptr, lib.lora_delta_free)
        self._rank, self._rows, self._cols = rank, rows, cols
        self._alpha, self._rslora, self._dtype = 0.0, False, name
        self._scale = scale if isinstance(scale, LoraScale) else LoraScale(scale)
        self._alpha_factor = alpha_factor
        self._xshape, self._oshape = (cols,), (rows,)
        self._keep = keep
        return self

    def _init(self, a, b, rank, rows, cols, alpha, scale, rslora, dtype):
        name = dtypes.storage_name(dtype)
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
        a_bits = dtypes.to_storage(a, name, "lora_a")
        b_bits = dtypes.to_storage(b, name, "lora_b")
        ptr = lib.lora_delta_new(dtypes.CODES[name], rank, rows, cols, _from_buffer(a_bits),
                                 _from_buffer(b_bits))
        if ptr == ffi.NULL:
            raise MemoryError(f"cannot allocate a rank-{rank} [{rows} x {cols}] {name} delta")
        self._ptr = ffi.gc(ptr, lib.lora_delta_free)
        self._rank, self._rows, self._cols = rank, rows, cols
        self._alpha, self._rslora, self._dtype = alpha, bool(rslora), name
        self._scale = scale
        self._alpha_factor = alpha_factor(alpha, rank, self._rslora)
        self._xshape, self._oshape = (cols,), (rows,)
        self._keep = None

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
        return self._scale.value * self._alpha_factor

    @property
    def resident_bytes(self):
        """rank * (rows + cols) * itemsize of the storage dtype (logical; padding not counted)."""
        return self._rank * (self._rows + self._cols) * dtypes.ITEMSIZE[self._dtype]

    def __repr__(self):
        return (f"LoraDelta(rank={self._rank}, rows={self._rows}, cols={self._cols}, "
                f"alpha={self._alpha}, dtype={self._dtype!r}, scale={self._scale.value})")

    # ---------------------------------------------------------------- apply
    def add_to(self, x, out):
        """Decode: ``out[rows] += s * B (A x[cols])``; returns ``out``.

        ``out``: a writeable, C-contiguous ``[rows]`` NumPy array or CPU torch tensor of float32,
        float16 or bfloat16, updated in place (a half-precision element is rounded once to
        nearest even).  ``x``: any real float ``[cols]``; float32/float16/bfloat16 is read in
        place, anything else converted to float32 (a copy).  Raises TypeError/ValueError naming
        expected vs actual; ``out`` is untouched on error.
        """
        if (type(x) is _ndarray and type(out) is _ndarray
                and (xc := _FAST.get(id(x.dtype))) is not None
                and (oc := _FAST.get(id(out.dtype))) is not None
                and x.shape == self._xshape and out.shape == self._oshape):
            try:  # the common case: no conversion, no copy, no further check
                xp = _from_buffer(x)
                op = _from_buffer(_CHARS, out, True)
            except ValueError:
                x, xp, xc, op, oc = self._vec_args(x, out)
        elif type(out) is not _ndarray and (
                fast := arrays.tensor_vec(x, out, self._xshape, self._oshape)) is not None:
            status = _lora_add_at(self._ptr, self._scale.value * self._alpha_factor, *fast)
            if status == 0:
                return out
            x, xp, xc, op, oc = self._vec_args(x, out)  # misaligned: the checked path
        else:
            x, xp, xc, op, oc = self._vec_args(x, out)
        # always one C call: it checks x/out overlap, then skips all arithmetic at scale 0
        status = _lora_add(self._ptr, self._scale.value * self._alpha_factor, xp, xc, op, oc)
        if status == _ERR_ALIGN:  # rare: a view at an odd byte offset; checks + copy
            x, xp, xc, op, oc = self._vec_args(x, out)
            status = _lora_add(self._ptr, self._scale.value * self._alpha_factor, xp, xc, op, oc)
        if status:
            arrays.raise_status(status)
        return out

    def _vec_args(self, x, out):
        op, oc, _, _ = arrays.check_out(out, self._oshape)
        keep, xp, xc, _ = arrays.check_x(x, out, self._xshape)
        return keep, xp, xc, op, oc

    def add_batch_to(self, x, out):
        """Prefill: ``out[..., :] += s * B (A x[..., :])`` for every position; returns ``out``.

        ``x``: real float ``[..., cols]``; ``out``: ``[..., rows]`` with the same leading axes
        (``[batch, seq, hidden]`` is batch * seq positions), float32/float16/bfloat16, NumPy or a
        CPU torch tensor, C-contiguous or row-strided (last axis contiguous, leading axes of one
        stride, e.g. ``qkv[:, :d]``), written in place.  Each position is bit-identical to
        ``add_to`` on it alone.
        """
        if (type(x) is _ndarray and type(out) is _ndarray
                and (xc := _FAST.get(id(x.dtype))) is not None
                and (oc := _FAST.get(id(out.dtype))) is not None
                and out.ndim == 2 and out.shape[1] == self._rows
                and x.shape == (out.shape[0], self._cols)):
            try:  # C-contiguous arrays of the right shapes: no conversion, no copy
                xp, ldx = _from_buffer(x), self._cols
                op, ldo = _from_buffer(_CHARS, out, True), self._rows
                batch = out.shape[0]
            except ValueError:
                x, xp, xc, ldx, op, oc, ldo, batch, _ = batch_args(x, out, self._cols, self._rows)
        elif type(out) is not _ndarray and (
                fast := arrays.tensor_batch(x, out, self._cols, self._rows)) is not None:
            xa, xc, oa, oc, batch = fast
            status = _lora_add_batch_at(self._ptr, self._scale.value * self._alpha_factor, batch,
                                        xa, xc, self._cols, oa, oc, self._rows) if batch else 0
            if status == 0:
                return out
            x, xp, xc, ldx, op, oc, ldo, batch, _ = batch_args(x, out, self._cols, self._rows)
        else:
            x, xp, xc, ldx, op, oc, ldo, batch, _ = batch_args(x, out, self._cols, self._rows)
        if batch:
            s = self._scale.value * self._alpha_factor
            status = _lora_add_batch(self._ptr, s, batch, xp, xc, ldx, op, oc, ldo)
            if status == _ERR_ALIGN:  # rare: a view at an odd byte offset
                x, xp, xc, ldx, op, oc, ldo, batch, _ = batch_args(x, out, self._cols, self._rows)
                status = _lora_add_batch(self._ptr, s, batch, xp, xc, ldx, op, oc, ldo)
            if status:
                arrays.raise_status(status)
        return out

    def add_row_to(self, r, out_row):
        """Token embedding: ``out_row[cols] += s * (B[r] @ A)``; ``r`` an int in ``[0, rows)``.

        Raises TypeError for a non-integer id, IndexError for one out of range (no wrap-around).
        """
        r = arrays.token_id(r, self._rows)
        op, oc, _, _ = arrays.check_out(out_row, self._xshape, "out_row")
        ids = ffi.new("int64_t[1]", [r])
        status = _lora_add_rows(self._ptr, self._scale.value * self._alpha_factor, 1, ids, op, oc,
                                self._cols, _NULL)
        if status:
            arrays.raise_status(status)
        return out_row

    def add_rows_to(self, ids, out):
        """A prompt's embedding deltas: ``out[..., :] += s * (B[ids[...]] @ A)``; returns ``out``.

        ``ids``: integers of any shape (bool/float: TypeError; any id outside ``[0, rows)``:
        IndexError naming it and its position, raised before anything is written); ``out``:
        ``[*ids.shape, cols]``, float32/float16/bfloat16, C-contiguous or row-strided.  Each
        row is bit-identical to ``add_row_to``.
        """
        tok, op, oc, ldo, n = rows_args(ids, out, self._cols)
        if n:
            bad = ffi.new("int64_t *")
            # the C call checks every id before its first write, also at scale 0
            status = _lora_add_rows(self._ptr, self._scale.value * self._alpha_factor, n,
                                    _from_buffer("int64_t[]", tok), op, oc, ldo, bad)
            if status:
                arrays.raise_status(status, ids=tok, rows=self._rows, bad=bad)
        return out

    # -------------------------------------------------------------- offline
    def lora_weights(self):
        """(lora_a [rank, cols], lora_b [rows, rank]) as stored, in the storage dtype (copies)."""
        d = dtypes.BY_NAME[self._dtype]
        a = np.empty((self._rank, self._cols), d.bits)
        b = np.empty((self._rows, self._rank), d.bits)
        lib.lora_delta_export(self._ptr, _from_buffer(a, require_writable=True),
                              _from_buffer(b, require_writable=True))
        return a.view(d.numpy), b.view(d.numpy)

    def _delta64(self, s, rows=slice(None)):
        a, b = self.lora_weights()
        return s * (b[rows].astype(np.float64) @ a.astype(np.float64))

    def delta_weight(self):
        """``s * B @ A`` as a new float32 ``[rows, cols]`` array (computed in float64 by NumPy)."""
        return self._delta64(_finite_scale(self.effective_scale)).astype(np.float32)

    def merge_into(self, w):
        """``w += s * B @ A`` in place; returns ``w``.

        ``w``: ``[rows, cols]`` float32, float16 or bfloat16, a NumPy array or a CPU torch tensor
        (a ``Parameter`` that requires grad is fine: a merge is a weight update outside autograd,
        as PEFT's merge is), C-contiguous or the transposed view of a C-contiguous
        ``[cols, rows]`` array (PEFT ``fan_in_fan_out`` bases).  The sum is formed in float64
        in C (over the rank in order, no fma) and rounded once to ``w``'s dtype, with the same
        bits on every ISA path and thread count; a result that would overflow that dtype is a
        ValueError and ``w`` is left untouched.  Scale 0 leaves ``w`` bit-identical."""
        return merge_(w, [(self, 1.0)], self._rows, self._cols)

    def unmerge_from(self, w):
        """``w -= s * B @ A`` in place; undoes ``merge_into`` within the rounding of ``w``'s dtype."""
        return merge_(w, [(self, -1.0)], self._rows, self._cols)


# ------------------------------------------------------------------ shared argument handling


def batch_args(x, out, cols, rows):
    """Checks for the batched linear methods: out [..., rows], x [..., cols] with the same leading
    axes.  Returns (x keep-alive, x ptr, x code, ldx, out ptr, out code, ldo, positions, lead)."""
    shape = arrays.batched_shape(out, rows, "out")
    op, oc, n, ldo = arrays.check_out(out, shape, shown=f"(..., {rows})", batched=True)
    lead = shape[:-1]
    keep, xp, xc, ldx = arrays.check_x(x, out, lead + (cols,), batched=True, lead_of=shape)
    return keep, xp, xc, ldx, op, oc, ldo, n, lead


def rows_args(ids, out, cols):
    """Checks for the gathers: ids of any shape (at least 1-D), out [*ids.shape, cols].  Returns
    (int64 ids, out ptr, out code, ldo, positions)."""
    if not (isinstance(out, _ndarray) or arrays.is_tensor(out)):
        arrays.check_out(out, None, shown=f"(n, {cols})")  # always raises: not an array
    if arrays.is_tensor(out):
        arrays.check_tensor_place(out, "out")  # device, layout, nested: before any shape is read
    tok = arrays.as_ids(ids, "ids", any_shape=True)
    if tok.ndim == 0:
        raise ValueError("ids must have at least one axis (a 0-d id is add_row_to's); got a "
                         "0-d array")
    if len(out.shape) >= 1 and tuple(out.shape[:-1]) != tok.shape and tok.ndim == 1 \
            and len(out.shape) == 2 and out.shape[-1] == cols:
        raise ValueError(f"ids has {tok.shape[0]} ids; out has {out.shape[0]} positions")
    op, oc, n, ldo = arrays.check_out(out, tok.shape + (cols,), shown=f"{tok.shape + (cols,)}",
                                 batched=True)
    return tok, op, oc, ldo, n


def _w_array(w, rows, cols):
    """A NumPy view of `w` (never a copy) with its dtype code, after the merge-target checks."""
    if arrays.is_tensor(w):
        arrays.check_tensor_place(w, "w")
        base = getattr(w, "_base", None)  # a view's base: w.T of a weight is fine
        if w.requires_grad and not w.is_leaf and not (base is not None and base.is_leaf):
            raise ValueError("w is a non-leaf tensor that requires grad: a merge writes it in "
                             "place, outside autograd; merge into the weight itself (a leaf such "
                             "as an nn.Parameter, or its transposed view), or under "
                             "torch.no_grad() into w.detach()")
        code = arrays.torch_code(w)
        if code is None:
            raise TypeError(f"w must have dtype float32, float16 or bfloat16 (it is updated in "
                            f"place); got {arrays.dtype_name(w)}")
        if w.is_neg():
            raise ValueError("w is a lazily negated view (the imaginary part of a conjugated "
                             "complex tensor): its memory holds the negated values; merge into "
                             "a resolved tensor")
        shape, strides = tuple(w.shape), tuple(w.stride())
        if shape != (rows, cols):
            raise ValueError(f"w must have shape ({rows}, {cols}) = [rows, cols]; got {shape}")
        # torch's contiguity ignores the strides of size-1 axes, as NumPy's flags do; an
        # expanded (stride 0) or sliced w of one row or column is neither
        flipped = not w.is_contiguous()
        if flipped and not w.T.is_contiguous():
            raise ValueError("w must be C-contiguous [rows, cols], or the transposed view of a "
                             f"C-contiguous [cols, rows] array (fan_in_fan_out); got strides "
                             f"{strides} (elements)")
        size = w.element_size()
        dt = dtypes.BY_CODE[code].numpy
        buf = ffi.buffer(ffi.cast("char *", w.data_ptr()), rows * cols * size)
        flat = np.frombuffer(buf, dtype=dt)
        if flipped:
            return flat.reshape(cols, rows).T, code
        return flat.reshape(rows, cols), code
    if not isinstance(w, _ndarray):
        raise TypeError(f"w must be a numpy.ndarray or a CPU torch.Tensor of float32, float16 or "
                        f"bfloat16 [{rows} x {cols}]; got {type(w).__name__}")
    code = arrays.np_code(w.dtype)
    if code is None:
        raise TypeError(f"w must have dtype float32, float16 or bfloat16 (it is updated in "
                        f"place); got {w.dtype}")
    if w.shape != (rows, cols):
        raise ValueError(f"w must have shape ({rows}, {cols}) = [rows, cols]; got {w.shape}")
    if not w.flags.writeable:
        raise ValueError("w is read-only; it must be a writeable array")
    if not (w.flags.c_contiguous or w.T.flags.c_contiguous):
        raise ValueError("w must be C-contiguous [rows, cols], or the transposed view of a "
                         f"C-contiguous [cols, rows] array (fan_in_fan_out); got strides {w.strides}")
    return w, code


_DOUBLES = ffi.typeof("double[]")


def _product_at(left, right, i, j):
    """(left @ right)[i, j] summed as the C merge sums it: over the rank in order, from the first
    product (for the overflow message)."""
    t = left[i, 0] * right[0, j]
    for k in range(1, left.shape[1]):
        t = t + left[i, k] * right[k, j]
    return float(t)


def merge_(w, terms, rows, cols):
    """w += sum of sign * s * B @ A over (delta, sign) terms, in one C pass over w: each product
    formed in float64 over the rank in order, the terms added in order, rounded once into w's
    dtype.  Nothing is written unless no element can overflow: a bound from max |w| and the
    factors proves it, or a checking sweep finds none."""
    arr, code = _w_array(w, rows, cols)
    live = []
    for d, sign in terms:
        s = _finite_scale(d.effective_scale)
        if s != 0.0:
            live.append((d, sign * s))
    if not live:
        return w
    name = dtypes.NAME_OF[code]
    # w's memory order: a transposed w (fan_in_fan_out) is the C-contiguous [cols, rows] array
    # arr.T, whose products are A^T @ B^T
    flip = rows > 1 and cols > 1 and not arr.flags.c_contiguous
    base = arr.T if flip else arr
    n_rows, n_cols = base.shape
    if base.size == 0:
        return w
    lefts, rights, scales = [], [], []
    bound = 0.0
    for d, s in live:
        a, b = (f.astype(np.float64) for f in d.lora_weights())
        left, right = (a.T, b.T) if flip else (b, a)  # [n_rows, r], [r, n_cols]
        lefts.append(np.ascontiguousarray(left))
        rights.append(np.ascontiguousarray(right))
        scales.append(s)
        bound += abs(s) * float(np.abs(left).sum(axis=1).max(initial=0.0)) * float(
            np.abs(right).max(initial=0.0))
    size = base.itemsize
    target = base if base.__array_interface__["data"][0] % size == 0 else base.copy()
    ptr = ffi.cast(_VOIDP, target.__array_interface__["data"][0])  # odd offset: aligned copy
    bound += lib.lora_abs_max(ptr, code, n_cols, n_rows, n_cols)
    # |result| <= bound, up to float64 rounding: below the largest finite value, no overflow
    safe = bound * (1.0 + 1e-9) < dtypes.LARGEST[name]
    keep = [ffi.from_buffer(_DOUBLES, m) for m in lefts + rights]
    bp = ffi.new("double *[]", keep[:len(lefts)])
    ap = ffi.new("double *[]", keep[len(lefts):])
    ranks = ffi.new("int64_t[]", [m.shape[1] for m in lefts])
    sc = ffi.new("double[]", scales)
    for write in ((1,) if safe else (0, 1)):
        bad = lib.lora_merge(ptr, code, n_cols, n_rows, n_cols, len(scales), ap, bp, ranks, sc,
                             write)
        if bad >= 0:
            bi, bj = bad // n_cols, bad % n_cols
            acc = float(target[bi, bj].astype(np.float64))
            for left, right, s in zip(lefts, rights, scales):
                acc = acc + s * _product_at(left, right, bi, bj)
            i, j = (bj, bi) if flip else (bi, bj)
            verb = "unmerging from" if all(sg < 0 for _, sg in terms) else "merging into"
            raise ValueError(f"{verb} w overflows its dtype {name} at [{i}, {j}]: {acc:.9g} "
                             f"(largest finite: {dtypes.LARGEST[name]:.9g}); w is left untouched")
    if target is not base:
        base[...] = target
    if arrays.is_tensor(w):  # an in-place update, as torch's own ops record it
        arrays.torch_module().autograd.graph.increment_version(w)
    return w


# ------------------------------------------------------------------ entries: stacks and banks


class EntryTable:
    """The C view of a list of entries, each a `LoraDelta`, a `LoraStack` (its members applied in
    order, in one fused pass) or None (nothing): the flat delta pointers, where each entry
    starts, and the effective scales read once per call.  A `LoraStack` is a table of one
    entry, a `LoraBank` one of many; adapter sets build theirs per target.

    A stack that is appended to marks every table holding it stale; the table rebuilds its flat
    view at its next call.  The scales array is rebuilt only when a `LoraScale` changed.
    """

    __slots__ = ("_entries", "_shape", "_stale", "deltas", "ptrs", "first", "_scale_objs",
                 "_scale_idx", "_factors", "_values", "_scales_c", "_epoch", "__weakref__")

    def __init__(self, entries, what="bank entry"):
        self._entries = list(entries)
        self._shape = None
        shape_from = None
        for i, e in enumerate(self._entries):
            if e is not None and not isinstance(e, (LoraDelta, LoraStack)):
                raise TypeError(f"{what} {i} must be a LoraDelta, a LoraStack or None; "
                                f"got {type(e).__name__}")
            es = e.base_shape if e is not None else None
            if es is None:
                continue
            if self._shape is None:
                self._shape, shape_from = es, i
            elif es != self._shape:
                raise LoraShapeError(
                    f"{what} {i} is [{es[0]} x {es[1]}] but {what} {shape_from} is "
                    f"[{self._shape[0]} x {self._shape[1]}]; every entry must fit one base",
                    rows=es[0], cols=es[1])
        for e in self._entries:
            if isinstance(e, LoraStack):
                e._owners.add(self)
        self._stale = True
        self._rebuild()

    def _rebuild(self):
        deltas, first = [], [0]
        for i, e in enumerate(self._entries):
            members = [] if e is None else ([e] if isinstance(e, LoraDelta) else e._deltas)
            for d in members:
                if self._shape is None:
                    self._shape = d.base_shape
                if d.base_shape != self._shape:
                    raise LoraShapeError(
                        f"entry {i} now holds a [{d._rows} x {d._cols}] delta but the base is "
                        f"[{self._shape[0]} x {self._shape[1]}]", rows=d._rows, cols=d._cols)
            deltas += members
            first.append(len(deltas))
        scale_ids = {}
        self._scale_objs, self._scale_idx = [], []
        for d in deltas:
            k = scale_ids.get(id(d._scale))
            if k is None:
                k = scale_ids[id(d._scale)] = len(self._scale_objs)
                self._scale_objs.append(d._scale)
            self._scale_idx.append(k)
        self._factors = [d._alpha_factor for d in deltas]
        self.deltas = deltas
        self.ptrs = ffi.new("lora_delta *[]", [d._ptr for d in deltas])
        self.first = ffi.new("int64_t[]", first)
        self._values = None
        self._epoch = None
        self._stale = False

    @property
    def base_shape(self):
        if self._stale:
            self._rebuild()
        return self._shape

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
        """double[] of each delta's effective scale; each distinct LoraScale read once, and only
        when some LoraScale was set since the last call (the array is never changed in place:
        a call that runs meanwhile keeps the values it read)."""
        epoch = _EPOCH[0]
        if epoch == self._epoch:
            return self._scales_c
        values = [s.value for s in self._scale_objs]
        if values != self._values:
            idx, factors = self._scale_idx, self._factors
            self._scales_c = ffi.new("double[]", [values[k] * f for k, f in zip(idx, factors)])
            self._values = values
        self._epoch = epoch
        return self._scales_c

    def resident_bytes(self):
        if self._stale:
            self._rebuild()
        return sum(d.resident_bytes for d in {id(d): d for d in self.deltas}.values())

    def apply_batch(self, x, out, adapter_ids=None, scales=None):
        """The batched linear add for these entries: position b uses entry adapter_ids[b]
        (None: entry 0 everywhere), its scales times scales[b] (None: 1).  Returns out."""
        if self._stale:
            self._rebuild()
        shape = self._shape
        if (type(x) is _ndarray and type(out) is _ndarray
                and (xc := _FAST.get(id(x.dtype))) is not None
                and (oc := _FAST.get(id(out.dtype))) is not None
                and shape is not None and out.ndim == 2):
            # the common case (2-D rows, int64 ids, float64 scales or none), without the
            # general checks: C checks overlap, alignment, ids and scales before any write
            fast = self._fast_batch(x, xc, out, oc, adapter_ids, scales, shape)
            if fast is not None:
                return out
        elif (shape is not None and scales is None and type(out) is not _ndarray
              and (adapter_ids is None or (type(adapter_ids) is _ndarray
                                           and adapter_ids.dtype is _I64
                                           and adapter_ids.ndim == 1))
              and (fast := arrays.tensor_batch(x, out, shape[1], shape[0])) is not None):
            # contiguous CPU tensors, every position on entry 0 (a stack, or PEFT's active
            # adapters) or int64 ids, one per leading row (PEFT's adapter_names): straight to
            # C, which checks overlap, alignment and the ids
            xa, xc, oa, oc, n = fast
            idp, every = _NULL, 1
            if adapter_ids is not None:
                rows0 = out.shape[0]
                try:
                    if adapter_ids.shape[0] != rows0 or n % max(rows0, 1):
                        raise ValueError
                    idp, every = _from_buffer(_INT64S, adapter_ids), max(n // max(rows0, 1), 1)
                except ValueError:  # not this path (or strided ids): the checked one
                    n = -1
            if n >= 0:
                bad = ffi.new("int64_t *") if idp is not _NULL else _NULL
                status = _lora_apply_batch(
                    len(self._entries), self.first, self.ptrs, self.scales(), idp, _NULL, every,
                    shape[0], shape[1], n, _cast(_VOIDP, xa), xc, shape[1], _cast(_VOIDP, oa), oc,
                    shape[0], bad) if n else 0
                if status == 0:
                    return out
                if status == lib.LORA_ERR_ADAPTER:
                    self._raise(status, adapter_ids, None, bad=bad)
        if shape is None:  # no entry holds a delta: no rows/cols to check against
            return self._shapeless_batch(x, out, adapter_ids, scales)
        rows, cols = shape
        x, xp, xc, ldx, op, oc, ldo, n, lead = batch_args(x, out, cols, rows)
        ids, idp, pos, posp, every = self._ids(adapter_ids, scales, lead)
        if n:
            bad = ffi.new("int64_t *")
            status = _lora_apply_batch(len(self._entries), self.first, self.ptrs, self.scales(),
                                       idp, posp, every, rows, cols, n, xp, xc, ldx, op, oc, ldo,
                                       bad)
            if status:
                self._raise(status, ids, pos, bad=bad)
        return out

    def _fast_batch(self, x, xc, out, oc, adapter_ids, scales, shape):
        rows, cols = shape
        n = out.shape[0]
        if out.shape[1] != rows or x.shape != (n, cols):
            return None
        idp, posp = _NULL, _NULL
        try:
            if adapter_ids is not None:
                if (type(adapter_ids) is not _ndarray or adapter_ids.dtype is not _I64
                        or adapter_ids.shape != (n,)):
                    return None
                idp = _from_buffer("int64_t[]", adapter_ids)
                if scales is not None:
                    if (type(scales) is not _ndarray or scales.dtype is not _F64
                            or scales.shape != (n,)):
                        return None
                    posp = _from_buffer("double[]", scales)
            elif scales is not None:
                return None
            xp = _from_buffer(x)
            op = _from_buffer(_CHARS, out, True)
        except ValueError:  # not contiguous: the general path
            return None
        if not n:
            return out
        bad = ffi.new("int64_t *")
        status = _lora_apply_batch(len(self._entries), self.first, self.ptrs, self.scales(), idp,
                                   posp, 1, rows, cols, n, xp, xc, cols, op, oc, rows, bad)
        if status == _ERR_ALIGN:
            return None
        if status:
            self._raise(status, adapter_ids, scales, bad=bad)
        return out

    def apply_rows(self, tok_ids, out, adapter_ids=None, scales=None):
        """The embedding-row gather for these entries; as apply_batch."""
        if self._stale:
            self._rebuild()
        shape = self._shape
        if shape is None:
            return self._shapeless_rows(tok_ids, out, adapter_ids, scales)
        rows, cols = shape
        tok, op, oc, ldo, n = rows_args(tok_ids, out, cols)
        ids, idp, pos, posp, every = self._ids(adapter_ids, scales, tok.shape)
        if n:
            bad = ffi.new("int64_t *")
            status = _lora_apply_rows(len(self._entries), self.first, self.ptrs, self.scales(),
                                      idp, posp, every, rows, cols, n,
                                      _from_buffer("int64_t[]", tok), op, oc, ldo, bad)
            if status:
                self._raise(status, ids, pos, tok=tok, bad=bad)
        return out

    def _ids(self, adapter_ids, scales, lead):
        """(ids, ids ptr, scales, scales ptr, positions per id) for a call with leading axes
        `lead`; ids and scales of the leading shape or a prefix of it."""
        if adapter_ids is None:
            return None, _NULL, None, _NULL, 1
        ids = arrays.as_ids(adapter_ids, "adapter_ids", any_shape=True)
        if len(lead) == 1 and ids.ndim == 1 and ids.shape[0] != lead[0]:
            raise ValueError(f"adapter_ids has {ids.shape[0]} ids; out has {lead[0]} positions")
        every = arrays.per_id_shape(ids, lead, "adapter_ids")
        if scales is None:
            return ids, _from_buffer("int64_t[]", ids), None, _NULL, every
        pos = arrays.as_scales(scales)
        if pos.shape != ids.shape:
            raise ValueError(f"scales must have the shape of adapter_ids, {ids.shape}; got "
                             f"{pos.shape}")
        return ids, _from_buffer("int64_t[]", ids), pos, _from_buffer("double[]", pos), every

    def _raise(self, status, ids, pos, tok=None, bad=None):
        rows = self._shape[0] if self._shape else 0
        arrays.raise_status(status, ids=tok, adapter_ids=ids, n_entries=len(self._entries),
                            rows=rows, bad=bad, scales=pos)

    def _check_ids_only(self, adapter_ids, scales, lead):
        ids, _, pos, _, _ = self._ids(adapter_ids, scales, lead)
        if ids is None:
            return
        flat = ids.reshape(-1)
        wrong = np.flatnonzero((flat < -1) | (flat >= len(self._entries)))
        if wrong.size:
            self._raise(lib.LORA_ERR_ADAPTER, ids, pos, bad=ffi.new("int64_t *", int(wrong[0])))

    def _shapeless_batch(self, x, out, adapter_ids, scales):
        """The checks entries without any delta can still make (rows/cols unknown): out a
        writeable float array of at least 2 dims, x of the same leading axes, not overlapping,
        the ids and scales."""
        if not (isinstance(out, _ndarray) or arrays.is_tensor(out)) or len(out.shape) < 2:
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
        if not (isinstance(out, _ndarray) or arrays.is_tensor(out)) or len(out.shape) < 2:
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


class LoraStack:
    """Several deltas of one ``rows x cols`` base applied as one: their sum, in order.

    ``LoraStack(deltas=())``; ``.append(d)``; ``len``, iteration, ``stack[i]`` (the very objects
    stored); ``.resident_bytes``; the four ``add_*`` methods of ``LoraDelta``, bit-identical to
    applying the deltas one after another in order to a float32 ``out`` (one fused C pass: ``x``
    read once per block, ``out`` written once); a half-precision ``out`` gets the float32 result
    rounded once, not once per delta.  A delta whose effective scale is 0 is skipped; an empty
    stack adds nothing.  A delta of another shape: ``LoraShapeError``.
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
        ``rows x cols`` differ from the stack's."""
        if not isinstance(delta, LoraDelta):
            raise TypeError(f"a LoraStack holds LoraDelta objects; got {type(delta).__name__}")
        if self._deltas and delta.base_shape != self.base_shape:
            r, c = self.base_shape
            raise LoraShapeError(
                f"delta {len(self._deltas)} is [{delta.rows} x {delta.cols}] but the stack's "
                f"deltas are [{r} x {c}]", rows=delta.rows, cols=delta.cols, rank=delta.rank)
        self._deltas = self._deltas + [delta]
        for table in list(self._owners):
            table._stale = True

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
        return sum(d.resident_bytes for d in {id(d): d for d in self._deltas}.values())

    def add_to(self, x, out):
        """Decode: ``out[rows] += sum_i s_i * B_i (A_i x[cols])``, deltas in order; returns ``out``."""
        if not self._deltas:
            return _shapeless_vec(x, out)
        rows, cols = self.base_shape
        op, oc, _, _ = arrays.check_out(out, (rows,))
        keep, xp, xc, _ = arrays.check_x(x, out, (cols,))
        t = self._table
        if t._stale:
            t._rebuild()
        status = _lora_apply_batch(1, t.first, t.ptrs, t.scales(), _NULL, _NULL, 1, rows, cols, 1,
                                   xp, xc, cols, op, oc, rows, _NULL)
        if status:
            arrays.raise_status(status)
        return out

    def add_batch_to(self, x, out):
        """Prefill: ``out[..., :] += sum_i s_i * B_i (A_i x[..., :])``; as ``LoraDelta.add_batch_to``."""
        return self._table.apply_batch(x, out)

    def add_row_to(self, r, out_row):
        """Token embedding: ``out_row += sum_i s_i * (B_i[r] @ A_i)``; as ``LoraDelta.add_row_to``."""
        if not self._deltas:
            arrays.token_id(r, None)
            return _shapeless_vec(_NO_X, out_row, "out_row")
        rows, cols = self.base_shape
        r = arrays.token_id(r, rows)
        op, oc, _, _ = arrays.check_out(out_row, (cols,), "out_row")
        t = self._table
        if t._stale:
            t._rebuild()
        ids = ffi.new("int64_t[1]", [r])
        status = _lora_apply_rows(1, t.first, t.ptrs, t.scales(), _NULL, _NULL, 1, rows, cols, 1,
                                  ids, op, oc, cols, _NULL)
        if status:
            arrays.raise_status(status)
        return out_row

    def add_rows_to(self, ids, out):
        """Embedding rows: ``out[..., :] += sum_k s_k * (B_k[ids[...]] @ A_k)``; as
        ``LoraDelta.add_rows_to``."""
        return self._table.apply_rows(ids, out)

    def delta_weight(self):
        """``sum_i s_i * B_i @ A_i`` as float32 ``[rows, cols]`` (NumPy, float64 accumulation)."""
        if not self._deltas:
            raise ValueError("an empty LoraStack has no shape, so no delta_weight")
        total = sum(d._delta64(_finite_scale(d.effective_scale)) for d in self._deltas)
        return np.asarray(total, dtype=np.float32)

    def merge_into(self, w):
        """``w += sum_i s_i * B_i @ A_i`` in place, the sum formed in float64 and rounded once to
        ``w``'s dtype (as ``LoraDelta.merge_into``); returns ``w``."""
        if not self._deltas:
            return _shapeless_w(w)
        return merge_(w, [(d, 1.0) for d in self._deltas], *self.base_shape)

    def unmerge_from(self, w):
        """``w -= sum_i s_i * B_i @ A_i`` in place; undoes ``merge_into`` within the rounding of
        ``w``'s dtype."""
        if not self._deltas:
            return _shapeless_w(w)
        return merge_(w, [(d, -1.0) for d in self._deltas], *self.base_shape)


_NO_X = object()


def _shapeless_vec(x, out, what="out"):
    """The checks an empty stack can still make for add_to / add_row_to: out a writeable 1-D
    float array (of any length), x (unless None) real float 1-D, not overlapping out."""
    if (isinstance(out, _ndarray) or arrays.is_tensor(out)) and len(out.shape) != 1:
        raise ValueError(f"{what} must be 1-D; got shape {tuple(out.shape)}")
    shape = tuple(getattr(out, "shape", ()))
    arrays.check_out(out, shape, what, shown="(n,)")
    if x is not _NO_X:
        xa = x if arrays.is_tensor(x) else arrays.float_array(x, "x")
        if len(xa.shape) != 1:
            raise ValueError(f"x must have shape [cols] to match {what} {shape}; got "
                             f"{tuple(xa.shape)}")
        arrays.no_overlap(xa, out)
    return out


def _shapeless_w(w):
    if (isinstance(w, _ndarray) or arrays.is_tensor(w)) and len(w.shape) != 2:
        raise ValueError(f"w must be 2-D; got shape {tuple(w.shape)}")
    shape = tuple(getattr(w, "shape", ()))
    _w_array(w, *shape) if len(shape) == 2 else _w_array(w, 0, 0)
    return w
