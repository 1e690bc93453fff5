"""Merges: ``w += s * B @ A`` (and back) into a base weight in place, for deltas and stacks.

``w`` is float32, float16 or bfloat16, a NumPy array or a CPU torch tensor, C-contiguous or the
transposed view of a C-contiguous array (PEFT ``fan_in_fan_out``).  The sum is formed in float64
in C (over the rank in order, no fma) and rounded once to ``w``'s dtype; nothing is written when
an element would overflow that dtype.
"""

import numpy as np

from . import _arrays as arrays
from . import _status
from . import _torch as torchs
from . import _dtypes as dtypes
from ._lora_cffi import ffi, lib
from .scale import F32_OVERFLOW

__all__ = ["finite_scale", "merge_", "shapeless_w"]

_ndarray = np.ndarray
_VOIDP = ffi.typeof("void *")
_DOUBLES = ffi.typeof("double[]")


def finite_scale(s):
    """The effective scale of an offline op; ValueError unless finite in float32 (the kernels'
    rule: a double that rounds to a finite float32 is finite)."""
    if not abs(s) < F32_OVERFLOW:
        raise ValueError(f"the effective scale {s} (scale x alpha factor) is not finite in "
                         f"float32")
    return s


def _w_array(w, rows, cols):
    """A NumPy view of `w` (never a copy) with its dtype code, after the merge-target checks."""
    if torchs.is_tensor(w):
        torchs.check_tensor_place(w, "w")
        base = getattr(w, "_base", None)  # a view's base: w.T of a weight is fine
        if w.requires_grad and not w.is_leaf and not (base is not None and base.is_leaf):
            raise ValueError("w is a non-leaf tensor that requires grad: a merge writes it in "
                             "place, outside autograd; merge into the weight itself (a leaf such "
                             "as an nn.Parameter, or its transposed view), or under "
                             "torch.no_grad() into w.detach()")
        code = torchs.torch_code(w)
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


def _product_at(left, right, i, j):
    """(left @ right)[i, j] summed as the C merge sums it: over the rank in order, from the first
    product (for the overflow message)."""
    t = left[i, 0] * right[0, j]
    for k in range(1, left.shape[1]):
        t = t + left[i, k] * right[k, j]
    return float(t)


def merge_(w, terms, rows, cols, *, check=True, write=True):
    """w += sum of sign * s * B @ A over (delta, sign) terms, in one C pass over w: each product
    formed in float64 over the rank in order, the terms added in order, rounded once into w's
    dtype.  Nothing is written unless no element can overflow: a bound from max |w| and the
    factors proves it, or a checking sweep finds none.  ``write=False`` only checks (raising as
    a merge would); ``check=False`` writes after such a check of the same w and terms (several
    merges that must all pass before any writes: the experts of one weight)."""
    arr, code = _w_array(w, rows, cols)
    live = []
    for d, sign in terms:
        s = finite_scale(d.effective_scale)
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
    w_max = ffi.new("double *")
    status = lib.lora_abs_max(ptr, code, n_cols, n_rows, n_cols, w_max)
    if status != lib.LORA_OK:
        _status.raise_status(status)
    bound += w_max[0]
    # |result| <= bound, up to float64 rounding: below the largest finite value, no overflow
    safe = bound * (1.0 + 1e-9) < dtypes.LARGEST[name]
    keep = [ffi.from_buffer(_DOUBLES, m) for m in lefts + rights]
    bp = ffi.new("double *[]", keep[:len(lefts)])
    ap = ffi.new("double *[]", keep[len(lefts):])
    ranks = ffi.new("int64_t[]", [m.shape[1] for m in lefts])
    sc = ffi.new("double[]", scales)
    first_bad = ffi.new("int64_t *")
    passes = ((0,) if check and not safe else ()) + ((1,) if write else ())
    for sweep in passes:
        status = lib.lora_merge(ptr, code, n_cols, n_rows, n_cols, len(scales), ap, bp, ranks,
                                sc, sweep, first_bad)
        if status != lib.LORA_OK:
            _status.raise_status(status)
        bad = first_bad[0]
        if bad >= 0:
            bi, bj = bad // n_cols, bad % n_cols
            acc = float(target[bi, bj].astype(np.float64))
            for left, right, s in zip(lefts, rights, scales):
                acc = acc + s * _product_at(left, right, bi, bj)
            i, j = (bj, bi) if flip else (bi, bj)
            verb = "unmerging from" if all(sg < 0 for _, sg in terms) else "merging into"
            raise ValueError(f"{verb} w overflows its dtype {name} at [{i}, {j}]: {acc:.9g} "
                             f"(largest finite: {dtypes.LARGEST[name]:.9g}); w is left untouched")
    if not write:
        return w
    if target is not base:
        base[...] = target
    if torchs.is_tensor(w):  # an in-place update, as torch's own ops record it
        torchs.torch_module().autograd.graph.increment_version(w)
    return w


def shapeless_w(w):
    """The checks a merge without any delta (an empty stack) can still make on ``w``."""
    if (isinstance(w, _ndarray) or torchs.is_tensor(w)) and len(w.shape) != 2:
        raise ValueError(f"w must be 2-D; got shape {tuple(w.shape)}")
    shape = tuple(getattr(w, "shape", ()))
    _w_array(w, *shape) if len(shape) == 2 else _w_array(w, 0, 0)
    return w
