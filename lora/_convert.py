"""Input checks and conversions shared by LoraDelta, LoraStack and LoraBank.

Everything here runs before the first write: a call that raises leaves `out`
exactly as it was (SPEC.md, "Input contract").
"""

import operator

import numpy as np

from ._lora_cffi import ffi, lib

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    ml_dtypes = None
    BF16 = None

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
I64 = np.dtype(np.int64)
I64_MAX = np.iinfo(np.int64).max

# storage dtype name -> (C code, numpy dtype of the stored bits' values)
STORAGE = {
    "float32": (lib.LORA_DTYPE_F32, F32),
    "float16": (lib.LORA_DTYPE_F16, F16),
    "bfloat16": (lib.LORA_DTYPE_BF16, BF16),
}


def storage_name(dtype):
    """'float32' | 'float16' | 'bfloat16' from a name or a NumPy dtype; ValueError otherwise."""
    if isinstance(dtype, str) and dtype in STORAGE:
        return dtype
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name in STORAGE and STORAGE[name][1] is not None:
        return name
    raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16', got {dtype!r}")


def is_float_dtype(dt):
    return dt.kind == "f" or (BF16 is not None and dt == BF16)


def float_array(value, what):
    """np.asarray(value), which must have a real floating dtype (else TypeError)."""
    arr = np.asarray(value)
    if not is_float_dtype(arr.dtype):
        raise TypeError(f"{what} must be a real floating array (float16, bfloat16, float32 or "
                        f"float64); got dtype {arr.dtype}")
    return arr


def _round_to_odd_f32(src):
    """float64 -> float32 rounding to odd, so a second rounding to bfloat16 is exact RNE."""
    t = src.astype(np.float32)
    back = t.astype(np.float64)
    inexact = back != src
    over = inexact & (np.abs(back) > np.abs(src))
    t[over] = np.nextafter(t[over], np.float32(0))
    bits = t.view(np.uint32)
    bits[inexact] |= np.uint32(1)
    return t


def to_storage(arr, name, what):
    """Round `arr` (a real float array) to the storage dtype `name`, round-to-nearest-even.

    Returns a C-contiguous array of the stored bits (float32, or uint16 for 16-bit dtypes).
    Raises ValueError for non-finite values and for values that overflow the storage dtype.
    """
    wide = arr.astype(np.float64 if arr.dtype.itemsize > 4 else np.float32)
    if not np.isfinite(wide).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(wide))[0])
        raise ValueError(f"{what} has a non-finite value ({wide[bad]}) at index {bad}")
    with np.errstate(over="ignore"):  # an overflow is reported below, as a ValueError
        if name == "float32":
            out = wide.astype(np.float32)
        elif name == "float16":
            out = wide.astype(np.float16)  # NumPy rounds float64/float32 -> float16 directly, RNE
        else:
            src = _round_to_odd_f32(wide) if wide.dtype == np.float64 else wide
            out = src.astype(BF16)
    if not np.isfinite(out.astype(np.float32)).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(out.astype(np.float32)))[0])
        limit = float(np.finfo(np.float32).max) if name == "float32" else (
            65504.0 if name == "float16" else float(ml_dtypes.finfo(BF16).max))
        raise ValueError(f"{what} value {wide[bad]} at index {bad} overflows {name} "
                         f"(largest finite: {limit:g})")
    out = np.ascontiguousarray(out)
    return out if name == "float32" else out.view(np.uint16)


# ------------------------------------------------------------------ outputs


def check_out(out, shape, what="out", shown=None):
    """`out` must be a writeable float32 ndarray of exactly `shape` (2-D: row-strided allowed).

    `shown` is how the messages write the wanted shape (default: `shape`), e.g. "(batch, 6)".
    Returns (pointer, leading dimension in floats).
    """
    want = shown or shape
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{what} must be a numpy.ndarray of float32 with shape {want}; "
                        f"got {type(out).__name__}")
    if out.dtype != F32 or not out.dtype.isnative:
        raise TypeError(f"{what} must have dtype float32 (it is updated in place, never through a "
                        f"copy); got {out.dtype}")
    if out.shape != shape:
        raise ValueError(f"{what} must have shape {want}; got {out.shape}")
    if not out.flags.writeable:
        raise ValueError(f"{what} is read-only; it must be a writeable float32 array")
    if not out.flags.aligned:
        raise ValueError(f"{what} is not aligned to 4 bytes (a view at an odd byte offset); "
                         f"it must be an aligned float32 array")
    if out.ndim == 1 or out.shape[0] <= 1:
        if out.flags.c_contiguous:
            return ffi.from_buffer(out, require_writable=True), shape[-1]
        if out.ndim == 1:
            raise ValueError(f"{what} must be C-contiguous; got strides {out.strides}")
    itemsize = out.itemsize
    row_stride = out.strides[0] if out.shape[0] > 1 else itemsize * shape[1]
    if (out.strides[1] != itemsize and shape[1] > 1) or row_stride % itemsize \
            or row_stride < itemsize * shape[1]:
        raise ValueError(f"{what} must be C-contiguous or a row-strided view whose last axis is "
                         f"contiguous (strides[-1] == {itemsize}, strides[0] >= "
                         f"{itemsize * shape[1]}); got strides {out.strides}")
    if out.flags.c_contiguous:
        return ffi.from_buffer(out, require_writable=True), shape[1]
    return ffi.cast("void *", out.__array_interface__["data"][0]), row_stride // itemsize


def check_rows_out(out, cols, what="out"):
    """`out` [n, cols] for the row gathers; returns (pointer, ldo, n)."""
    if isinstance(out, np.ndarray) and out.ndim == 2:
        op, ldo = check_out(out, (out.shape[0], cols), what)
        return op, ldo, out.shape[0]
    check_out(out, None, what, shown=f"(n, {cols})")  # not 2-D: always raises


# ------------------------------------------------------------------- inputs


def _aligned_copy(x):
    """x as a new C-contiguous, aligned float32 array (np.ascontiguousarray keeps a misaligned
    float32 array as it is)."""
    return np.array(x, dtype=F32, order="C", copy=True)


def _no_overlap(x, out):
    if isinstance(x, np.ndarray) and np.may_share_memory(x, out):
        raise ValueError("x and out overlap in memory; out must not alias x")


def prepare_vec(x, out, cols, rows):
    """Checks for add_to: out [rows], x [cols]; returns (x, x pointer, out pointer)."""
    op, _ = check_out(out, (rows,))
    xa = float_array(x, "x")
    if xa.shape != (cols,):
        raise ValueError(f"x must have shape ({cols},) = [cols]; got {xa.shape}")
    if (xa.dtype != F32 or not xa.flags.c_contiguous or not xa.dtype.isnative
            or not xa.flags.aligned):
        _no_overlap(xa, out)
        xa = _aligned_copy(xa)
    return xa, ffi.from_buffer(xa), op


def prepare_mat(x, out, cols, rows, out_what="out"):
    """Checks for add_batch_to: out [batch, rows], x [batch, cols].

    Returns (x, x pointer, ldx, out pointer, ldo, batch).
    """
    if not isinstance(out, np.ndarray) or out.ndim != 2:
        check_out(out, None, out_what, shown=f"(batch, {rows})")  # not 2-D: always raises
    batch = out.shape[0]
    op, ldo = check_out(out, (batch, rows), out_what)
    xa = float_array(x, "x")
    if xa.shape != (batch, cols):
        raise ValueError(f"x must have shape ({batch}, {cols}) = [batch, cols] to match out "
                         f"{out.shape}; got {xa.shape}")
    if (xa.dtype == F32 and xa.dtype.isnative and xa.flags.aligned
            and (xa.strides[1] == 4 or cols == 1)
            and (batch <= 1 or (xa.strides[0] % 4 == 0 and xa.strides[0] >= 4 * cols))):
        if xa.flags.c_contiguous:
            return xa, ffi.from_buffer(xa), cols, op, ldo, batch
        ldx = xa.strides[0] // 4 if batch > 1 else cols
        return xa, ffi.cast("void *", xa.__array_interface__["data"][0]), ldx, op, ldo, batch
    _no_overlap(xa, out)
    xa = _aligned_copy(xa)
    return xa, ffi.from_buffer(xa), cols, op, ldo, batch


def as_ids(ids, what, n=None):
    """A 1-D int64 C-contiguous copy (or view) of integer ids; TypeError for bool/float ids."""
    if isinstance(ids, (list, tuple)) and ids and all(
            isinstance(v, int) and not isinstance(v, bool) for v in ids):
        big = [i for i, v in enumerate(ids) if not -2**63 <= v <= I64_MAX]
        if big:  # NumPy would make these an object or float array
            raise IndexError(f"{what}: id {ids[big[0]]} at position {big[0]} is out of range")
    arr = np.asarray(ids)
    if arr.size == 0 and arr.dtype.kind == "f" and isinstance(ids, (list, tuple)):
        arr = arr.astype(I64)  # `[]` is float64 to NumPy; no id, nothing to misread
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers; got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D; got shape {arr.shape}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{what} has {arr.shape[0]} ids; out has {n} positions")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size:
        big = np.flatnonzero(arr > np.uint64(I64_MAX))
        if big.size:
            raise IndexError(f"{what}: id {int(arr[big[0]])} at position {int(big[0])} is out "
                             f"of range")
    if arr.dtype != I64 or not arr.flags.c_contiguous or not arr.flags.aligned:
        arr = np.array(arr, dtype=I64, order="C", copy=True)
    return arr


def effective_scales(deltas):
    """The effective scales of `deltas` for one call, each distinct LoraScale read once, so a
    stack or bank sharing one scale never mixes an old and a new value within a call."""
    seen = {}
    values = []
    for d in deltas:
        scale = d._scale
        value = seen.get(id(scale))
        if value is None:
            value = seen[id(scale)] = scale._value
        values.append(value * d._alpha_factor)
    return ffi.new("double[]", values)


_NO_X = object()


def check_shapeless(x, out, *, ndim, what="out"):
    """The checks an empty stack or an all-None bank can still make (no rows/cols known):
    `out` a writeable float32 array of `ndim` dims, `x` (unless _NO_X) a real float array of
    the same batch, not overlapping `out`.  Returns `out`."""
    if isinstance(out, np.ndarray) and out.ndim != ndim:
        raise ValueError(f"{what} must be {ndim}-D; got shape {out.shape}")
    check_out(out, getattr(out, "shape", ()), what)
    if x is not _NO_X:
        xa = float_array(x, "x")
        if xa.ndim != ndim or (ndim == 2 and xa.shape[0] != out.shape[0]):
            want = "[cols]" if ndim == 1 else f"[{out.shape[0]}, cols]"
            raise ValueError(f"x must have shape {want} to match {what} {out.shape}; "
                             f"got {xa.shape}")
        _no_overlap(xa, out)
    return out


def check_shapeless_token_ids(ids, n):
    """Token ids for an embedding of unknown rows (empty stack, all-None bank): integer [n], and
    none negative, which is out of range for every base.  Returns the int64 ids."""
    tok = as_ids(ids, "ids", n)
    if tok.size and tok.min() < 0:
        pos = int(np.argmax(tok < 0))
        raise IndexError(f"token id {int(tok[pos])} at position {pos} is out of range")
    return tok


def token_id(r, rows):
    """One token id for add_row_to: an int (not bool, not float) in [0, rows) (rows None: >= 0)."""
    if isinstance(r, (bool, np.bool_)) or isinstance(r, (float, np.floating)):
        raise TypeError(f"token id must be an integer; got {type(r).__name__}")
    try:
        r = operator.index(r)
    except TypeError:
        raise TypeError(f"token id must be an integer; got {type(r).__name__}") from None
    if r < 0 or (rows is not None and r >= rows):
        where = f"[0, {rows})" if rows is not None else "(ids are >= 0)"
        raise IndexError(f"token id {r} is out of range {where} for this embedding")
    return r


def raise_status(status, *, ids=None, adapter_ids=None, n_entries=None, rows=None, bad=None):
    """Turn a LORA_ERR_* status from the C layer into the matching Python exception."""
    pos = int(bad[0]) if bad is not None else -1
    if status == lib.LORA_ERR_OVERLAP:
        raise ValueError("x and out overlap in memory; out must not alias x")
    if status == lib.LORA_ERR_INDEX:
        raise IndexError(f"token id {int(ids[pos])} at position {pos} is out of range [0, {rows})")
    if status == lib.LORA_ERR_ADAPTER:
        valid = "-1 (no adapter)" + (f" and 0..{n_entries - 1}" if n_entries else
                                     ", the bank has no entries")
        raise IndexError(f"adapter id {int(adapter_ids[pos])} at position {pos} is out of range: "
                         f"valid ids are {valid}")
    if status == lib.LORA_ERR_SCALE:
        raise ValueError("the effective scale (scale x alpha factor) is not finite in float32 "
                         "(|s| must be below 3.4e38)")
    if status == lib.LORA_ERR_ALIGN:
        raise ValueError("x, out or the ids are not aligned to their item size")
    if status == lib.LORA_ERR_NOMEM:
        raise MemoryError("lora-kernels: out of memory for kernel scratch")
    raise ValueError(f"lora-kernels: invalid arguments (status {status})")
