"""The storage formats of a delta's factors, each declared once; apart from the element dtypes.

Element dtypes (`lora._dtypes`) are what ``x``, ``out`` and merge targets are.  A storage format
is how one factor (A or B) of a delta sits in memory: values per block, bytes per block (a block
format's scale included), the C code (``LORA_FMT_*``, the C side's ``LORA_FORMATS`` in
csrc/formats.h) and how values are stored (`Format.store`) and read back (`Format.load`).
An element format stores its dtype's values under its dtype's code; a block format adds its
entry here and in the C registry.  A block format's blocks lie along A's rows and along B's
columns (B^T's rows): `Format.store_b` / `Format.load_b` give B in the layout the C side takes.
A delta's ``dtype`` is its factors' format name (``"q8_0/float16"`` when they differ).

Every Python map of formats derives from `ALL`.
"""

import contextlib
import contextvars
import warnings

import numpy as np

from . import _dtypes as dtypes
from ._lora_cffi import lib
from ._runtime import _user_stacklevel

__all__ = ["Format", "Stored", "Q8_0", "ALL", "BY_NAME", "NAMES", "QUOTED", "format_name", "pair_names",
           "pair_name"]


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
        """``arr`` (a real float array, ``[..., n]``) in this format's stored bits, C-contiguous
        (an element format: rounded to nearest even; ValueError for non-finite values and
        overflow).  A block format blocks each row (the last axis)."""
        return dtypes.to_storage(arr, self.name, what)

    def store_b(self, b, what):
        """lora_b ``[..., rows, rank]`` in the layout the C side takes: an element format as
        it is, a block format as B^T's rows (blocks along B's columns)."""
        return self.store(b if self.block == 1 else np.swapaxes(b, -1, -2), what)

    def bits(self):
        """The NumPy dtype of the stored bits (unsigned integers of the value size; bytes for
        a block format)."""
        return self.dtype.bits

    def stored_shape(self, shape):
        """The shape of the stored bits of values of ``shape`` (blocked along the last axis)."""
        return tuple(shape)

    def load(self, stored, n=None):
        """Stored bits back as the format's values (a NumPy array of its dtype; a block format:
        float32, rows of ``n`` values)."""
        return stored.view(self.dtype.numpy)

    def load_b(self, stored, rows):
        """lora_b's stored bits (`store_b`'s layout) back as ``[..., rows, rank]`` values."""
        if self.block == 1:
            return self.load(stored)
        return np.swapaxes(self.load(stored, rows), -1, -2)

    def __repr__(self):
        return f"<format {self.name} (code {self.code}, block {self.block})>"


class Stored:
    """A factor already in a format's stored bits, kept as they are (a GGUF file's Q8_0
    ``lora_a``, whose blocks lie along A's rows): ``format`` (a `Format`), ``bits`` (the
    C-contiguous bits in the layout the C side takes) and ``shape`` (the values' shape)."""

    __slots__ = ("format", "bits", "shape")

    def __init__(self, fmt, bits, shape):
        self.format, self.bits, self.shape = fmt, np.ascontiguousarray(bits), tuple(shape)

    ndim = property(lambda self: len(self.shape))



class _Q8_0(Format):
    """llama.cpp's Q8_0: blocks of 32 int8 values ``q`` with one float16 scale ``d`` (value
    ``d * q``), stored as llama.cpp's ``block_q8_0`` (``d`` little-endian, then the 32 ``q``:
    34 bytes), quantized by its reference rule (``quantize_row_q8_0_ref``) on float32 values:
    ``d = max|x| / 127``, ``q = roundf(x * (1 / d))`` (ties away from zero; ``1 / d`` is 0 for
    an all-zero block), ``d`` rounded to float16 (nearest even).  A row whose length is not a
    multiple of 32 ends in a shorter block (the same rule over its values; its unused ``q``
    are 0)."""

    __slots__ = ()

    def bits(self):
        return np.dtype(np.uint8)

    def stored_shape(self, shape):
        *lead, n = shape
        return (*lead, -(-n // 32) * 34)

    def store(self, arr, what):
        x = np.asarray(arr)
        wide = x.astype(np.float64 if x.dtype.itemsize > 4 else np.float32)
        if not np.isfinite(wide).all():
            bad = tuple(int(i) for i in np.argwhere(~np.isfinite(wide))[0])
            raise ValueError(f"{what} has a non-finite value ({wide[bad]}) at index {bad}")
        *lead, n = x.shape
        nblk = -(-n // 32)
        pad = np.zeros((*lead, nblk * 32), np.float64)
        pad[..., :n] = wide
        blocks = pad.reshape(*lead, nblk, 32)
        amax = np.abs(blocks).max(axis=-1)
        # llama.cpp's arithmetic, in float32: the values, d, 1 / d and x * (1 / d)
        x32 = blocks.astype(np.float32)
        with np.errstate(over="ignore"):
            d = (amax.astype(np.float32) / np.float32(127)).astype(np.float32)
            d16 = d.astype("<f2")
        if d16.size and np.isinf(d16).any():  # d >= 65520 rounds to an infinite float16
            at = np.unravel_index(int(np.argmax(amax)), amax.shape)
            row, blk = tuple(int(i) for i in at[:-1]), int(at[-1])
            raise ValueError(f"{what}: the Q8_0 block {blk} of row {row} (values {32 * blk} .. "
                             f"{min(n, 32 * blk + 32) - 1}) holds {amax[at]:.9g}: its scale "
                             f"max|x| / 127 = {float(d[at]):.9g} rounds to an infinite float16 (the "
                             f"largest float16 is 65504)")
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
            prod = (x32 * inv[..., None]).astype(np.float64)   # exact in float64
        # a block of float32 subnormals: 1 / d is inf (llama.cpp's q is then undefined); its
        # float16 scale is 0 whatever q is, so q = 0
        prod[~np.isfinite(prod)] = 0
        # roundf: to nearest, ties away from zero (NumPy's rint rounds ties to even)
        trunc = np.trunc(prod)
        q = np.where(np.abs(prod - trunc) >= 0.5, trunc + np.sign(prod), trunc).astype(np.int8)
        _warn_if_lost(what, blocks, q * d16.astype(np.float64)[..., None], amax)
        out = np.empty((*lead, nblk, 34), np.uint8)
        out[..., :2] = d16[..., None].view(np.uint8)
        out[..., 2:] = q.view(np.uint8)
        return np.ascontiguousarray(out.reshape(*lead, nblk * 34))

    def load(self, stored, n=None):
        raw = np.ascontiguousarray(stored).view(np.uint8)
        *lead, nb = raw.shape
        blocks = raw.reshape(*lead, nb // 34, 34)
        d = blocks[..., :2].copy().view("<f2")[..., 0].astype(np.float32)
        q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
        values = (q * d[..., None]).reshape(*lead, (nb // 34) * 32)   # d * q: exact in float32
        return values if n is None else np.ascontiguousarray(values[..., :n])


# Past this relative error of a factor's stored values, quantizing warns: Q8_0's own rounding
# keeps a factor of Gaussian values within about 0.6 %; a factor whose block scales are deep
# among float16's subnormals (values near 3e-5 and below) loses more, up to all of a block.
Q8_0_WARN_ERROR = 0.02


_LOSSES = contextvars.ContextVar("lora_q8_0_losses", default=None)


@contextlib.contextmanager
def collect_losses():
    """Within it, a q8_0 quantization past Q8_0_WARN_ERROR appends ``(what, error, blocks
    zeroed)`` to the list it yields instead of warning, so a loader names its modules in one
    warning (per context: threads and tasks collect their own)."""
    token = _LOSSES.set([])
    try:
        yield _LOSSES.get()
    finally:
        _LOSSES.reset(token)


def _warn_if_lost(what, blocks, stored, amax):
    """A RuntimeWarning when a factor's stored values (`stored`, blocks as `blocks`: [..., 32]
    float64, zero-padded) are off its values by more than Q8_0_WARN_ERROR relative to the
    whole factor, naming the factor and what to do."""
    norm = float(np.linalg.norm(blocks))
    if norm == 0:
        return
    err = float(np.linalg.norm(stored - blocks)) / norm
    if err <= Q8_0_WARN_ERROR:
        return
    zeroed = int(np.count_nonzero((amax > 0) & ~stored.any(axis=-1)))
    sink = _LOSSES.get()
    if sink is not None:
        sink.append((what, err, zeroed))
        return
    warnings.warn(f"{what}: stored as q8_0, its values are {err:.1%} off (relative error; "
                  f"largest magnitude {float(amax.max()):.2g}: below 127 x 2^-14 = 7.75e-3 a "
                  f"block's float16 scale is subnormal and coarse, below about 4e-6 it is 0)"
                  + (f"; {zeroed} nonzero block(s) became all zero" if zeroed else "")
                  + "; store this factor as 'float16' or 'bfloat16' instead",
                  RuntimeWarning, stacklevel=_user_stacklevel() or 1)


Q8_0 = _Q8_0("q8_0", lib.LORA_FMT_Q8_0, 32, 34)

ALL = tuple(Format(d.name, d.code, 1, d.itemsize, d) for d in dtypes.ALL) + (Q8_0,)

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


def pair_name(a_name, b_name):
    """A delta's ``dtype``: the one name where A's and B's formats agree, else ``"a/b"``."""
    return a_name if a_name == b_name else f"{a_name}/{b_name}"


def pair_names(dtype):
    """(A's format name, B's) from a storage dtype, or from a pair name ``"q8_0/float16"``
    (package-internal: pickles and loaders); ValueError otherwise."""
    if isinstance(dtype, str) and "/" in dtype:
        a, _, b = dtype.partition("/")
        if a in BY_NAME and b in BY_NAME and a != b:
            return a, b
        raise ValueError(f"dtype must be {QUOTED} (or a pair of them, 'q8_0/float16'), "
                         f"got {dtype!r}")
    name = format_name(dtype)
    return name, name
