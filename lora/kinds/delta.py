"""`LoraDelta`: one LoRA pair, the low-rank term s * B (A x) added in place into a caller's output.

Layouts: lora_a = A [rank, cols], lora_b = B [rows, rank], a base W [rows, cols] (= [n_out,
n_in]).  Every add_* method validates all of its inputs before the first write, makes one C call
with the GIL released, and returns `out`.  A delta is a table of one entry of one member to the
kernels: each method hands its arguments to `lora._edge` (the common case, taken in C from the
arrays themselves), and what it declines to `lora._apply`'s checked path.
"""

import math
import operator

import numpy as np

from .. import _arrays as arrays
from .. import _formats as formats
from .. import _edge
from .._apply import OP_BATCH, OP_ROW, OP_ROWS, OP_VEC, address, checked
from .._byvalue import ByValue, same_slots
from .._entries import Member, entry_type
from .._lora_cffi import ffi, lib
from .._merge import finite_scale, merge_
from ..errors import LoraShapeError
from ..scale import LoraScale

__all__ = ["LoraDelta"]

_edge_apply = _edge.apply


def alpha_factor(alpha, rank, rslora):
    """llama.cpp `get_scale` / PEFT: alpha/rank, alpha/sqrt(rank) for rsLoRA, 1 when alpha == 0."""
    if alpha == 0:
        return 1.0
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def check_alpha(alpha, rslora):
    """``alpha`` as a finite float (TypeError for a non-real one, ValueError for inf / NaN), and
    ``rslora`` a bool (TypeError otherwise)."""
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
    return alpha


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


def _pair_error(a, b, rank, rows, cols, base_shape):
    """The LoraShapeError for a pair that does not fit: factors that are not 2-D say so first
    (3-D ones are routed experts: `LoraExperts`; flat ones: `from_flat`); a 2-D pair gets the
    fixed wording first, then both shapes as given, the base's, and a hint when the two look
    swapped or transposed."""
    if a.ndim != 2 or b.ndim != 2:
        got = ", ".join(f"lora_{n} has shape {tuple(f.shape)} ({f.ndim}-D)"
                        for n, f in (("a", a), ("b", b)) if f.ndim != 2)
        if 3 in (a.ndim, b.ndim):
            got += ("; a 3-D pair, lora_a [n_experts, rank, cols] and lora_b [n_experts, rows, "
                    "rank], holds routed experts: use lora.LoraExperts")
        elif min(a.ndim, b.ndim) < 2:
            got += "; for flat buffers: LoraDelta.from_flat(a, b, rank, rows, cols)"
        return LoraShapeError(f"lora_a and lora_b must be 2-D, lora_a [rank, cols] and lora_b "
                              f"[rows, rank]; {got}", a_len=a.size, b_len=b.size)
    err = LoraShapeError.for_pair(rows, cols, rank, a.size, b.size)
    pair = f"got lora_a {a.shape} as [rank, cols] and lora_b {b.shape} as [rows, rank]"
    hints = []
    if base_shape is not None and a.shape[0] == b.shape[1]:
        hints.append(f"the pair is [{b.shape[0]} x {a.shape[1]}] at rank {a.shape[0]}, the base "
                     f"given is {tuple(base_shape)}")
    elif base_shape is not None:
        hints.append(f"the base given is {tuple(base_shape)}")
    if a.shape[0] != b.shape[1]:
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



def _restore(a_bits, b_bits, dtype, alpha, rslora, factor, scale, dims=None):
    """Unpickling (and deep copies): a delta from its stored bits (see `LoraDelta._parts`)."""
    return LoraDelta._from_bits(a_bits, b_bits, dtype, alpha, rslora, factor, scale, dims)


def bits_shapes(fa, fb, rank, rows, cols, lead=()):
    """The shapes of the stored bits of A (format ``fa``) and B (``fb``) of a ``[rows x cols]``
    pair at ``rank``: A ``[..., rank, cols]``, B ``[..., rows, rank]`` for an element format,
    a block format's blocks along A's rows and B^T's rows (`Format.store_b`)."""
    a = fa.stored_shape((*lead, rank, cols))
    b = (*lead, rows, rank) if fb.block == 1 else fb.stored_shape((*lead, rank, rows))
    return a, b


def check_bits(a_bits, b_bits, dtype, a_ndim=2, dims=None):
    """The stored bit arrays of a pickle, checked as a constructor checks its factors (a corrupt
    pickle is a ValueError, never a read past a buffer): NumPy arrays of each factor's format's
    bit type, ``a [..., rank, cols]`` and ``b [..., rows, rank]`` (a block format: its blocks,
    `bits_shapes`, which needs ``dims = (rank, rows, cols)``) with every dimension at least 1,
    every value finite; returns them C-contiguous, and ``(rank, rows, cols)``."""
    a_name, b_name = formats.pair_names(dtype)
    fa, fb = formats.BY_NAME[a_name], formats.BY_NAME[b_name]
    name = formats.pair_name(a_name, b_name)

    def refuse(why=""):
        return ValueError(f"not the stored factors of a {name} LoRA pair: "
                          f"{getattr(a_bits, 'shape', a_bits)!r} / "
                          f"{getattr(b_bits, 'shape', b_bits)!r}{why}")

    if (type(a_bits) is not np.ndarray or type(b_bits) is not np.ndarray
            or a_bits.dtype != fa.bits() or b_bits.dtype != fb.bits() or a_bits.ndim != a_ndim
            or b_bits.ndim != a_ndim or a_bits.shape[:-2] != b_bits.shape[:-2]
            or 0 in a_bits.shape or 0 in b_bits.shape):
        raise refuse()
    if dims is None:
        if fa.block != 1 or fb.block != 1 or a_bits.shape[-2] != b_bits.shape[-1]:
            raise refuse()
        dims = (a_bits.shape[-2], b_bits.shape[-2], a_bits.shape[-1])
    try:
        rank, rows, cols = (operator.index(v) for v in dims)
    except (TypeError, ValueError):
        raise refuse(f" (dimensions {dims!r})") from None
    if min(rank, rows, cols) < 1 or (a_bits.shape[-2:], b_bits.shape[-2:]) != \
            bits_shapes(fa, fb, rank, rows, cols):
        raise refuse(f" (want a rank-{rank} [{rows} x {cols}] pair)")
    with np.errstate(invalid="ignore", over="ignore"):
        for which, fmt, arr in (("A", fa, a_bits), ("B", fb, b_bits)):
            if not np.isfinite(fmt.load(arr)).all():
                raise refuse(f": {which} holds a non-finite value (a constructor refuses them)")
    return np.ascontiguousarray(a_bits), np.ascontiguousarray(b_bits), (rank, rows, cols)


@entry_type(stackable=True)
class LoraDelta(ByValue):
    """One LoRA pair: adds ``effective_scale * B (A x)`` into a caller's output, in place.

    ``LoraDelta(a, b, *, alpha=0.0, scale=1.0, rslora=False, base_shape=None, dtype="float32")``

    - ``a``: lora_a, ``[rank, cols]``; ``b``: lora_b, ``[rows, rank]``; any real float array-like
      (float16, bfloat16 from ml_dtypes, float32, float64), copied into owned, aligned, packed
      storage of ``dtype``: "float32" | "float16" | "bfloat16" (rounded to nearest even), or
      "q8_0" (llama.cpp's Q8_0: blocks of 32 int8 values with one float16 scale, quantized by
      llama.cpp's reference rule on the float32 values; A blocked along its rows, B along its
      columns, a shorter last block where a dimension is not a multiple of 32).  A q8_0 factor
      computes exactly as the float32 factor holding its dequantized values ``d * q``.
    - ``effective_scale = scale * alpha_factor``, ``alpha_factor = alpha / rank`` (PEFT, llama.cpp
      ``llama_adapter_lora`` ``get_scale``), ``alpha / sqrt(rank)`` when ``rslora`` (PEFT
      ``use_rslora``), and 1 when ``alpha == 0`` (llama.cpp: no alpha in the file).
    - ``scale``: a float (a new ``LoraScale``) or a ``LoraScale`` to share; read once per call.
    - ``base_shape=(rows, cols)``: checked against the pair when given.

    Raises ``LoraShapeError`` when the pair does not fit (rank 0 included), ``TypeError`` for a
    non-float array, ``ValueError`` for non-finite values or alpha, or values that overflow the
    storage dtype (q8_0: a block whose scale, its largest magnitude / 127, rounds to an infinite
    float16, from 65520 x 127; the message names the factor and the block).  Compute is float32 in every case; results are deterministic for one ISA path
    and dtype, identical for every thread count and batch size.

    Pickling keeps the stored factors (bit for bit), dtype, alpha, rsLoRA, the alpha factor and
    the `LoraScale` (one shared with other objects of one pickle stays shared); a delta over a
    caller's memory pickles its current values.  ``copy.copy`` shares the storage and the
    LoraScale; ``copy.deepcopy`` owns new ones.
    """

    __slots__ = ("_ptr", "_view", "_rank", "_rows", "_cols", "_alpha", "_rslora", "_dtype",
                 "_dtypes", "_scale", "_alpha_factor", "_keep", "__weakref__")

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
        bad = [n for n, v in (("rank", rank), ("rows", rows), ("cols", cols)) if v < 1]
        if bad:
            raise LoraShapeError(f"{' and '.join(bad)} must be positive: got rank {rank}, rows "
                                 f"{rows}, cols {cols} (lora_a has {a.size} values, lora_b "
                                 f"{b.size})", rows=rows, cols=cols, rank=rank, a_len=a.size,
                                 b_len=b.size)
        if a.size != rank * cols or b.size != rows * rank:
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
        name = formats.format_name(dtype)
        ptr = lib.lora_delta_view(formats.BY_NAME[name].code, rank, rows, cols, ffi.cast("void *", a[0]),
                                  a[1], int(a_by_row), ffi.cast("void *", b[0]), b[1],
                                  int(b_by_row))
        if ptr == ffi.NULL:
            raise ValueError(f"cannot view a rank-{rank} [{rows} x {cols}] {name} delta with row "
                             f"lengths {a[1]} / {b[1]}")
        self = cls.__new__(cls)
        self._own(ptr, rows, cols)
        self._rank, self._rows, self._cols = rank, rows, cols
        self._alpha, self._rslora, self._dtype, self._dtypes = 0.0, False, name, (name, name)
        self._scale = scale if isinstance(scale, LoraScale) else LoraScale(scale)
        self._alpha_factor = alpha_factor
        self._keep = keep
        return self

    @classmethod
    def _adopt(cls, ptr, rank, rows, cols, *, alpha, rslora, dtype, scale, alpha_factor):
        """A delta around a C delta made elsewhere, which it now owns (package-internal:
        `LoraExperts` packs its experts' storage in one pass and hands each expert over)."""
        self = cls.__new__(cls)
        self._own(ptr, rows, cols)
        self._rank, self._rows, self._cols = rank, rows, cols
        self._alpha, self._rslora = alpha, rslora
        self._dtypes = formats.pair_names(dtype)
        self._dtype = formats.pair_name(*self._dtypes)
        self._scale = scale
        self._alpha_factor = alpha_factor
        self._keep = None
        return self

    @classmethod
    def _from_bits(cls, a_bits, b_bits, dtype, alpha, rslora, factor, scale, dims=None):
        """A delta owning a copy of stored bits (`bits_shapes`; ``dims = (rank, rows, cols)``,
        needed for a block format) in ``dtype`` (a format name, or a pair ``"q8_0/float16"``)
        (package-internal: unpickling), checked first (`check_bits`)."""
        a_bits, b_bits, (rank, rows, cols) = check_bits(a_bits, b_bits, dtype, dims=dims)
        a_name, b_name = formats.pair_names(dtype)
        alpha = check_alpha(alpha, rslora)
        if not isinstance(scale, LoraScale):
            raise TypeError(f"scale must be a LoraScale; got {type(scale).__name__}")
        factor = check_alpha(factor, False)
        name = formats.pair_name(a_name, b_name)
        ptr = lib.lora_delta_new(formats.BY_NAME[a_name].code, formats.BY_NAME[b_name].code,
                                 rank, rows, cols, ffi.from_buffer(a_bits),
                                 ffi.from_buffer(b_bits))
        if ptr == ffi.NULL:
            raise MemoryError(f"cannot allocate a rank-{rank} [{rows} x {cols}] {name} delta")
        return cls._adopt(ptr, rank, rows, cols, alpha=alpha, rslora=bool(rslora), dtype=name,
                          scale=scale, alpha_factor=factor)

    @classmethod
    def _of(cls, a, b, *, alpha=0.0, scale=1.0, rslora=False, dtype="float32"):
        """A delta whose factors may each be values (stored in that factor's format of
        ``dtype``, a name or a pair ``"q8_0/float32"``) or `lora._formats.Stored` bits kept as
        they are (package-internal: a GGUF file's Q8_0 lora_a); shapes as the constructor's."""
        rank, cols = a.shape
        rows = b.shape[0]
        if b.shape != (rows, rank) or min(rank, rows, cols) < 1:
            raise LoraShapeError.for_pair(rows, cols, rank, a.shape[0] * a.shape[1],
                                          b.shape[0] * b.shape[1])
        self = cls.__new__(cls)
        self._init(a, b, rank, rows, cols, alpha, scale, rslora, dtype)
        return self

    def _stored_bits(self):
        """The stored bits of A and B, in the layout `lora_delta_new` takes (`bits_shapes`)."""
        fa, fb = (formats.BY_NAME[n] for n in self._dtypes)
        a_shape, b_shape = bits_shapes(fa, fb, self._rank, self._rows, self._cols)
        a = np.empty(a_shape, fa.bits())
        b = np.empty(b_shape, fb.bits())
        lib.lora_delta_export(self._ptr, ffi.from_buffer(a, require_writable=True),
                              ffi.from_buffer(b, require_writable=True))
        return a, b

    def _parts(self):
        """By value (lora._byvalue): the stored bits, dtype, alpha, rsLoRA, factor, LoraScale
        and the dimensions."""
        a, b = self._stored_bits()
        return _restore, (a, b, self._dtype, self._alpha, self._rslora, self._alpha_factor,
                          self._scale, (self._rank, self._rows, self._cols))

    _shallow = same_slots  # the same storage (never written after construction), same LoraScale

    def _init(self, a, b, rank, rows, cols, alpha, scale, rslora, dtype):
        names = formats.pair_names(dtype)
        alpha = check_alpha(alpha, rslora)
        if not isinstance(scale, LoraScale):
            scale = LoraScale(scale)
        stored = []
        for which, arr, name in (("lora_a", a, names[0]), ("lora_b", b, names[1])):
            if isinstance(arr, formats.Stored):     # kept as a file holds it
                stored.append((arr.format, arr.bits))
                continue
            fmt = formats.BY_NAME[name]
            stored.append((fmt, fmt.store(arr, which) if which == "lora_a"
                           else fmt.store_b(arr, which)))
        (fa, a_bits), (fb, b_bits) = stored
        names = (fa.name, fb.name)
        name = formats.pair_name(*names)
        ptr = lib.lora_delta_new(fa.code, fb.code, rank, rows, cols, ffi.from_buffer(a_bits),
                                 ffi.from_buffer(b_bits))
        if ptr == ffi.NULL:
            raise MemoryError(f"cannot allocate a rank-{rank} [{rows} x {cols}] {name} delta")
        self._own(ptr, rows, cols)
        self._rank, self._rows, self._cols = rank, rows, cols
        self._alpha, self._rslora, self._dtype, self._dtypes = alpha, bool(rslora), name, names
        self._scale = scale
        self._alpha_factor = alpha_factor(alpha, rank, self._rslora)
        self._keep = None

    # ------------------------------------------------------------ properties
    rank = property(lambda self: self._rank, doc="The LoRA rank r.")
    rows = property(lambda self: self._rows, doc="n_out: rows of the base and of lora_b.")
    cols = property(lambda self: self._cols, doc="n_in: columns of the base and of lora_a.")
    alpha = property(lambda self: self._alpha, doc="lora_alpha (0 = none: factor 1).")
    rslora = property(lambda self: self._rslora, doc="True when alpha is divided by sqrt(rank).")
    dtype = property(lambda self: self._dtype, doc='Storage dtype: "float32" | "float16" | '
                     '"bfloat16" | "q8_0"; where A and B differ, both, A\'s first ("q8_0/float16").')
    dtypes = property(lambda self: self._dtypes, doc="The storage dtypes of (A, B).")
    scale = property(lambda self: self._scale, doc="The LoraScale read at every call (shared).")
    base_shape = property(lambda self: (self._rows, self._cols), doc="(rows, cols) of the base.")

    @property
    def effective_scale(self):
        """``scale.value * alpha_factor``: the s of ``out += s * B (A x)`` right now."""
        return self._scale.value * self._alpha_factor

    @property
    def resident_bytes(self):
        """rank * (cols + rows) * itemsize of the storage dtypes (logical; padding not counted);
        a q8_0 factor counts 2 bytes of scale and 1 byte per value for each block (34 per whole
        block; a shorter last block 2 + its values)."""
        fa, fb = (formats.BY_NAME[n] for n in self._dtypes)
        return self._rank * (fa.nbytes(self._cols) + fb.nbytes(self._rows))

    def __repr__(self):
        return (f"LoraDelta(rank={self._rank}, rows={self._rows}, cols={self._cols}, "
                f"alpha={self._alpha}, dtype={self._dtype!r}, scale={self._scale.value})")

    def _own(self, ptr, rows, cols):
        """Take ownership of C delta `ptr` (freed with this object) and make lora._edge's view
        of it: a table of one entry of one member."""
        self._ptr = ffi.gc(ptr, lib.lora_delta_free)
        self._view = _edge.view_of_delta(address(ptr), rows, cols, None)

    def _kernel_entries(self):
        """The entry protocol (lora._entries): one kernel entry of one member, this delta."""
        return ((Member(self._ptr, self._scale, self._alpha_factor, self),),)

    # ------------------------------------------------------------ lora._apply's target
    expert_shape = None
    n_entries = 1

    def edge_view(self):
        return self._view

    def edge_scales(self):
        """The effective scale, read once per call (``_value``: the slot behind
        `LoraScale.value`, without a Python call for the property)."""
        return self._scale._value * self._alpha_factor

    def plain(self, method):
        pass

    def epi_arg(self, op, ids, pos, n):
        return None

    # ---------------------------------------------------------------- apply
    def add_to(self, x, out):
        """Decode: ``out[rows] += s * B (A x[cols])``; returns ``out``.

        ``out``: a writeable, C-contiguous ``[rows]`` NumPy array or CPU torch tensor of float32,
        float16 or bfloat16, updated in place (a half-precision element is rounded once to
        nearest even).  ``x``: any real float ``[cols]``; float32/float16/bfloat16 is read in
        place, anything else converted to float32 (a copy).  Raises TypeError/ValueError naming
        expected vs actual; ``out`` is untouched on error.
        """
        if _edge_apply(self._view, self._scale._value * self._alpha_factor, OP_VEC, x, out, None,
                       None, None, None) == 0:
            return out
        return checked(self, OP_VEC, x, out)

    def add_batch_to(self, x, out):
        """Prefill: ``out[..., :] += s * B (A x[..., :])`` for every position; returns ``out``.

        ``x``: real float ``[..., cols]``; ``out``: ``[..., rows]`` with the same leading axes
        (``[batch, seq, hidden]`` is batch * seq positions), float32/float16/bfloat16, NumPy or a
        CPU torch tensor, C-contiguous or row-strided (last axis contiguous, leading axes of one
        stride, e.g. ``qkv[:, :d]``), written in place.  Each position is bit-identical to
        ``add_to`` on it alone.
        """
        if _edge_apply(self._view, self._scale._value * self._alpha_factor, OP_BATCH, x, out,
                       None, None, None, None) == 0:
            return out
        return checked(self, OP_BATCH, x, out)

    def add_row_to(self, r, out_row):
        """Token embedding: ``out_row[cols] += s * (B[r] @ A)``; ``r`` an int in ``[0, rows)``.

        Raises TypeError for a non-integer id, IndexError for one out of range (no wrap-around).
        """
        if _edge_apply(self._view, self._scale._value * self._alpha_factor, OP_ROW, r, out_row,
                       None, None, None, None) == 0:
            return out_row
        return checked(self, OP_ROW, r, out_row)

    def add_rows_to(self, ids, out):
        """A prompt's embedding deltas: ``out[..., :] += s * (B[ids[...]] @ A)``; returns ``out``.

        ``ids``: integers of any shape (bool/float: TypeError; any id outside ``[0, rows)``:
        IndexError naming it and its position, raised before anything is written); ``out``:
        ``[*ids.shape, cols]``, float32/float16/bfloat16, C-contiguous or row-strided.  Each
        row is bit-identical to ``add_row_to``.
        """
        if _edge_apply(self._view, self._scale._value * self._alpha_factor, OP_ROWS, ids, out,
                       None, None, None, None) == 0:
            return out
        return checked(self, OP_ROWS, ids, out)

    # -------------------------------------------------------------- offline
    def lora_weights(self):
        """(lora_a [rank, cols], lora_b [rows, rank]) as stored, in the storage dtype (copies); a
        q8_0 factor as float32 holding its dequantized values ``d * q`` (exact), the values
        every op computes with."""
        fa, fb = (formats.BY_NAME[n] for n in self._dtypes)
        a, b = self._stored_bits()
        return fa.load(a, self._cols), fb.load_b(b, self._rows)

    def _delta64(self, s, rows=slice(None)):
        a, b = self.lora_weights()
        return s * (b[rows].astype(np.float64) @ a.astype(np.float64))

    def delta_weight(self):
        """``s * B @ A`` as a new float32 ``[rows, cols]`` array (computed in float64 by NumPy)."""
        return self._delta64(finite_scale(self.effective_scale)).astype(np.float32)

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
