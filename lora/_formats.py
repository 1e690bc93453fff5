"""The storage formats of a delta's factors, each declared once; apart from the element dtypes.

Element dtypes (`lora._dtypes`) are what ``x``, ``out`` and merge targets are.  A storage format
is how one factor (A or B) of a delta sits in memory: values per block, bytes per block (a block
format's scale included), the C code (``LORA_FMT_*``, the C side's ``LORA_FORMATS`` in
csrc/formats.h) and how values are stored (`Format.store`) and read back (`Format.load`).
An element format stores its dtype's values under its dtype's code; a block format adds its
entry here and in the C registry.  A delta's ``dtype`` is its factors' format name.

Every Python map of formats derives from `ALL`.
"""


from . import _dtypes as dtypes
from ._lora_cffi import lib

__all__ = ["Format", "ALL", "BY_NAME", "NAMES", "QUOTED", "format_name"]


class Format:
    """One storage format: ``name`` (what users write), ``code`` (the C code), ``block``
    (values per block; 1 for an element format), ``block_bytes`` (bytes per block, its scale
    included) and, for an element format, ``dtype`` (its `lora._dtypes.DType`)."""

    __slots__ = ("name", "code", "block", "block_bytes", "dtype")

    def __init__(self, name, code, block, block_bytes, dtype=None):
        self.name, self.code, self.block, self.block_bytes = name, code, block, block_bytes
        self.dtype = dtype

    def nbytes(self, n):
        """Logical bytes of a run of n values along the blocked axis: whole blocks, a short
        last block counted as its values and its scale."""
        if self.block == 1:
            return n * self.block_bytes
        full, rest = divmod(n, self.block)
        return full * self.block_bytes + (rest + (self.block_bytes - self.block) if rest else 0)

    def store(self, arr, what):
        """``arr`` (a real float array) in this format's stored bits, C-contiguous (an element
        format: rounded to nearest even; ValueError for non-finite values and overflow)."""
        return dtypes.to_storage(arr, self.name, what)

    def bits(self):
        """The NumPy dtype of the stored bits (unsigned integers of the value size)."""
        return self.dtype.bits

    def load(self, stored):
        """Stored bits back as the format's values (a NumPy array of its dtype)."""
        return stored.view(self.dtype.numpy)

    def __repr__(self):
        return f"<format {self.name} (code {self.code}, block {self.block})>"


ALL = tuple(Format(d.name, d.code, 1, d.itemsize, d) for d in dtypes.ALL)

if sorted(f.code for f in ALL) != list(range(lib.LORA_FMT_COUNT)):
    raise ImportError(f"lora-kernels: the Python format list has the codes "
                      f"{sorted(f.code for f in ALL)}, the extension knows {lib.LORA_FMT_COUNT} "
                      f"formats: rebuild the extension")

BY_NAME = {f.name: f for f in ALL}
NAMES = tuple(BY_NAME)
QUOTED = ", ".join(f"'{n}'" for n in NAMES[:-1]) + f" or '{NAMES[-1]}'"


def format_name(dtype):
    """A name of `NAMES` from a name, or a NumPy or torch dtype of an element format;
    ValueError otherwise."""
    if isinstance(dtype, str) and dtype in BY_NAME:
        return dtype
    try:
        name = dtypes.storage_name(dtype)
    except ValueError:
        name = None
    if name in BY_NAME:
        return name
    raise ValueError(f"dtype must be {QUOTED}, got {dtype!r}")
