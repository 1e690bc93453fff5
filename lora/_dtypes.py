"""The dtypes the kernels read and write, each declared once; every other map derives from here.

One list, `ALL`: the storage dtypes of a delta's factors, which are also the activation dtypes of
``x`` / ``out`` and the merge targets ``w``.  Each entry gives the name users write, the C code
(``LORA_DTYPE_*`` of csrc/lora.h), the item size, the NumPy dtype, the torch dtype's attribute
name and the largest finite value.  A new dtype is one more entry here (and its C table row).

Conversion into a storage dtype rounds to nearest even, from float64 directly (bfloat16 through
a round-to-odd float32, so that no value is rounded twice); a value that would overflow is a
``ValueError``, never a silent inf.  ``import lora`` imports neither ml_dtypes nor torch: a
NumPy dtype from ml_dtypes is recognised by name and imported on first use, and the torch map
is built at the first tensor.
"""

import importlib
import sys

import numpy as np

from . import _edge
from ._lora_cffi import lib

__all__ = ["ALL", "NAMES", "CODES", "BY_NAME", "BY_CODE", "FAST", "np_code", "np_dtype",
           "torch_codes", "storage_name", "round_to", "to_storage"]


class DType:
    """One dtype: ``name`` ("bfloat16"), ``code`` (the C code), ``itemsize`` (bytes),
    ``largest`` (finite magnitude), ``torch`` (the torch dtype's attribute name), ``numpy`` (the
    NumPy dtype, loaded on first use; ``foreign`` when another package defines it), ``bits``
    (the unsigned NumPy dtype of its bit patterns) and ``via_odd`` (float64 is rounded through a
    round-to-odd float32: NumPy's cast would round twice)."""

    __slots__ = ("name", "code", "itemsize", "largest", "torch", "via_odd", "bits", "_where",
                 "_numpy")

    def __init__(self, name, code, itemsize, numpy, largest, *, torch=None, via_odd=False):
        self.name, self.code, self.itemsize, self.largest = name, code, itemsize, largest
        self.torch = torch or name
        self.via_odd = via_odd
        self.bits = np.dtype(f"u{itemsize}")
        module, _, attr = numpy.rpartition(".")
        self._where = (module, attr) if module else None  # a dtype from another package
        self._numpy = None if module else np.dtype(attr)

    @property
    def foreign(self):
        """True when NumPy's dtype for it comes from another package (ml_dtypes)."""
        return self._where is not None

    @property
    def numpy(self):
        if self._numpy is None:
            self._numpy = np.dtype(getattr(importlib.import_module(self._where[0]),
                                           self._where[1]))
        return self._numpy

    def is_numpy(self, dt):
        """True when the NumPy dtype `dt` holds this dtype's values, judged without importing
        the package that defines it (by name and size)."""
        if self._where is None:
            return dt == self._numpy
        return dt.name == self._where[1] and dt.itemsize == self.itemsize

    def __repr__(self):
        return f"<dtype {self.name} (code {self.code})>"


ALL = (
    DType("float32", lib.LORA_DTYPE_F32, 4, "float32", float(np.finfo(np.float32).max)),
    DType("float16", lib.LORA_DTYPE_F16, 2, "float16", float(np.finfo(np.float16).max)),
    DType("bfloat16", lib.LORA_DTYPE_BF16, 2, "ml_dtypes.bfloat16", 3.3895313892515355e38,
          via_odd=True),
)

# the C side lists the same dtypes (LORA_DTYPES in csrc/kernels.h, codes 0 .. LORA_DTYPE_COUNT - 1)
if sorted(d.code for d in ALL) != list(range(lib.LORA_DTYPE_COUNT)):
    raise ImportError(f"lora-kernels: the Python dtype list has the codes "
                      f"{sorted(d.code for d in ALL)}, the extension knows {lib.LORA_DTYPE_COUNT} "
                      f"dtypes: rebuild the extension")

BY_NAME = {d.name: d for d in ALL}
BY_CODE = {d.code: d for d in ALL}
NAMES = tuple(BY_NAME)                            # ("float32", "float16", "bfloat16")
CODES = {d.name: d.code for d in ALL}             # name -> C code
NAME_OF = {d.code: d.name for d in ALL}           # C code -> name
ITEMSIZE = {d.name: d.itemsize for d in ALL}
LARGEST = {d.name: d.largest for d in ALL}
F32 = BY_NAME["float32"]


def either(quote=""):
    """The names for messages: ``float32, float16 or bfloat16`` (each in `quote` marks)."""
    words = [f"{quote}{n}{quote}" for n in NAMES]
    return ", ".join(words[:-1]) + " or " + words[-1]


QUOTED = either("'")

# The fast paths' dtype codes, by the identity of NumPy's canonical dtype objects (a non-native
# or otherwise unusual dtype object takes the checked path); a dtype from another package joins
# the first time an array of it is checked (np_code), without importing that package here.
FAST = {id(d.numpy): d.code for d in ALL if not d.foreign}
_KEEP = []  # dtype objects whose id() is in FAST stay alive
_FOREIGN = tuple(d for d in ALL if d.foreign)


def fast_pairs():
    """(dtype object, code) of every dtype in `FAST` so far: what lora._edge compares."""
    return tuple((d.numpy, d.code) for d in ALL if not d.foreign) + tuple(
        (dt, FAST[id(dt)]) for dt in _KEEP)


def np_code(dt):
    """The C code of a native NumPy dtype of one of `ALL`, else None."""
    code = FAST.get(id(dt))
    if code is not None:
        return code
    if not dt.isnative:
        return None
    for d in ALL:
        if d.is_numpy(dt):
            if d.foreign and dt is np.dtype(dt.type):  # the canonical object: remember it
                FAST[id(dt)] = d.code
                _KEEP.append(dt)
                _edge.add_numpy_dtypes(((dt, d.code),))
            return d.code
    return None


def is_extra_float(dt):
    """True for a NumPy float dtype of another package that is one of `ALL` (ml_dtypes'
    bfloat16), recognised without importing that package."""
    return any(d.is_numpy(dt) for d in _FOREIGN)


def is_other_float(dt):
    """True for a real floating NumPy dtype of ml_dtypes that is not one of `ALL` (float8_*,
    float6_*, float4_*: NumPy's kind is "V" for most of them); such input is converted to
    float32 (exactly: every value of these types is a float32), as float64 input is.
    Recognised without importing ml_dtypes."""
    return (getattr(dt.type, "__module__", None) == "ml_dtypes" and dt.name.startswith("float")
            and not is_extra_float(dt))


def np_dtype(name):
    """The NumPy dtype that holds values of dtype `name`."""
    return BY_NAME[name].numpy


_TORCH = None  # {torch dtype: C code}, built at the first tensor


def torch_codes():
    """``{torch dtype: C code}`` for `ALL`; torch must already be imported (a tensor exists)."""
    global _TORCH
    if _TORCH is None:
        torch = sys.modules["torch"]
        _TORCH = {getattr(torch, d.torch): d.code for d in ALL}
    return _TORCH


def storage_name(dtype):
    """A name of `NAMES` from a name, a NumPy dtype or a torch dtype; ValueError otherwise."""
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
    raise ValueError(f"dtype must be {QUOTED}, got {dtype!r}")


def _round_to_odd_f32(src):
    """float64 -> float32 rounding to odd, so a second rounding to a narrower dtype is exact
    RNE."""
    t = src.astype(np.float32)
    back = t.astype(np.float64)
    inexact = back != src
    over = inexact & (np.abs(back) > np.abs(src))
    t[over] = np.nextafter(t[over], np.float32(0))
    bits = t.view(np.uint32)
    bits[inexact] |= np.uint32(1)
    return t


def round_to(wide, name):
    """float32/float64 `wide` rounded once to nearest even into dtype `name` (a NumPy array of
    that dtype); values beyond its range become inf, as a cast does (callers check)."""
    d = BY_NAME[name]
    with np.errstate(over="ignore", invalid="ignore"):
        src = _round_to_odd_f32(wide) if d.via_odd and wide.dtype == np.float64 else wide
        return src.astype(d.numpy)  # NumPy rounds float64/float32 -> float16 directly


def to_storage(arr, name, what):
    """Round `arr` (a real float array) to the storage dtype `name`, round-to-nearest-even.

    Returns a C-contiguous array of the stored bits (unsigned integers of the item size).
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
    return np.ascontiguousarray(out).view(BY_NAME[name].bits)
