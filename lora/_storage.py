"""Storage dtypes of a delta's factors: names, C codes, and the rounding that stores them.

Conversion rounds to nearest even, from float64 directly (bfloat16 through a round-to-odd
float32, so that no value is rounded twice); a value that would overflow the storage dtype is a
``ValueError``, never a silent inf.  ml_dtypes (bfloat16 for NumPy) is imported on first use.
"""

import numpy as np

from ._lora_cffi import lib

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)

# storage dtype name -> C code
CODES = {"float32": lib.LORA_DTYPE_F32, "float16": lib.LORA_DTYPE_F16,
         "bfloat16": lib.LORA_DTYPE_BF16}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def bf16():
    """NumPy's bfloat16 dtype (from ml_dtypes, imported here on first use)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def np_dtype(name):
    """The NumPy dtype that holds values of storage dtype `name`."""
    return {"float32": F32, "float16": F16}.get(name) or bf16()


def storage_name(dtype):
    """'float32' | 'float16' | 'bfloat16' from a name or a NumPy dtype; ValueError otherwise."""
    if isinstance(dtype, str) and dtype in CODES:
        return dtype
    if type(dtype).__module__ == "torch" and str(dtype).startswith("torch."):
        name = str(dtype)[len("torch."):]  # torch.bfloat16 -> "bfloat16" (torch not imported)
        if name in CODES:
            return name
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name in CODES:
        return name
    raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16', got {dtype!r}")


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


LARGEST = {"float32": float(np.finfo(np.float32).max), "float16": 65504.0,
           "bfloat16": 3.3895313892515355e38}


def round_to(wide, name):
    """float32/float64 `wide` rounded once to nearest even into `name` (a NumPy array of that
    dtype); values beyond its range become inf, as a cast does (callers check)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if name == "float32":
            return wide.astype(np.float32)
        if name == "float16":
            return wide.astype(np.float16)  # NumPy rounds float64/float32 -> float16 directly
        src = _round_to_odd_f32(wide) if wide.dtype == np.float64 else wide
        return src.astype(bf16())


def to_storage(arr, name, what):
    """Round `arr` (a real float array) to the storage dtype `name`, round-to-nearest-even.

    Returns a C-contiguous array of the stored bits (float32, or uint16 for 16-bit dtypes).
    Raises ValueError for non-finite values and for values that overflow the storage dtype.
    """
    wide = arr.astype(np.float64 if arr.dtype.itemsize > 4 else np.float32)
    if not np.isfinite(wide).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(wide))[0])
        raise ValueError(f"{what} has a non-finite value ({wide[bad]}) at index {bad}")
    out = round_to(wide, name)
    if not np.isfinite(out.astype(np.float32)).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(out.astype(np.float32)))[0])
        raise ValueError(f"{what} value {wide[bad]} at index {bad} overflows {name} "
                         f"(largest finite: {LARGEST[name]:g})")
    out = np.ascontiguousarray(out)
    return out if name == "float32" else out.view(np.uint16)
