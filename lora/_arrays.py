"""What the apply methods accept, checked before the first write: activations `x`, outputs `out`
and merge targets `w` (NumPy arrays or CPU torch tensors, float32 / float16 / bfloat16), token
ids, adapter ids and per-position scales.

Each array becomes a C pointer, a dtype code (`lora._dtypes`, the one list of dtypes) and, for
the batched methods, the number of positions and the leading dimension: the leading axes of
``[..., n]`` must collapse to one axis with one stride (as NumPy's flags judge it: size-1 axes
ignored) and the last axis must be contiguous.  An `x` that does not fit is converted to a
float32 copy; an `out` that does not fit is refused, never written through a hidden copy.
What a tensor is (its place, dtype code, version counter) is lora._torch's.
"""

import operator

import numpy as np

from . import _dtypes as dtypes
from ._lora_cffi import ffi
from ._status import id_error, position_of
from ._torch import check_tensor_place, is_tensor, note_write, torch_code, torch_module

F32 = np.dtype(np.float32)  # what an x the kernels cannot read in place is converted to
I64 = np.dtype(np.int64)
_F64 = np.dtype(np.float64)
I64_MAX = np.iinfo(np.int64).max
_F32_CODE = dtypes.CODES["float32"]
_VOIDP = ffi.typeof("void *")
np_code = dtypes.np_code


def is_float_dtype(dt):
    """A real floating NumPy dtype: NumPy's own (float64 included), one of the dtypes of
    another package that the kernels read (ml_dtypes' bfloat16), or another of ml_dtypes' real
    floats (float8, float6, float4: converted to float32)."""
    return dt.kind == "f" or dtypes.is_extra_float(dt) or dtypes.is_other_float(dt)


def dtype_name(obj):
    return str(obj.dtype).replace("torch.", "") if is_tensor(obj) else str(obj.dtype)


# ------------------------------------------------------------------ layout


def collapse(shape, strides):
    """(n, ld) for the leading axes shape[:-1] with element strides: n positions ld elements
    apart, or None when they do not collapse to one stride.  ld is shape[-1] when no leading
    axis has more than one element."""
    n, ld, expect = 1, None, None
    for size, stride in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if size == 1:
            continue
        if expect is not None and stride != expect:
            return None
        if ld is None:
            ld = stride
        expect = stride * size
        n *= size
    if n == 0:
        return 0, shape[-1]
    return n, (ld if ld is not None else shape[-1])


def out_layout(shape, strides):
    """(n, ld) when the last axis is contiguous and the leading axes collapse into rows that do
    not overlap; else None."""
    last = shape[-1]
    if 0 in shape:  # nothing is read or written: any strides will do
        n = 1
        for size in shape[:-1]:
            n *= size
        return n, last
    if last > 1 and strides[-1] != 1:
        return None
    got = collapse(shape, strides)
    if got is None or (got[0] > 1 and got[1] < last):
        return None
    return got


def _np_strides(arr):
    size = arr.itemsize
    if any(s % size for s in arr.strides):
        return None
    return tuple(s // size for s in arr.strides)


def _extent(ptr, shape, strides, itemsize):
    """[lo, hi) bytes an array with these element strides spans (empty: None)."""
    if any(s == 0 for s in shape):
        return None
    lo = hi = ptr
    for size, stride in zip(shape, strides):
        span = (size - 1) * stride * itemsize
        if span < 0:
            lo += span
        else:
            hi += span
    return lo, hi + itemsize


def _info(obj):
    """(pointer int, shape, element strides or None, itemsize) of an ndarray or tensor."""
    if isinstance(obj, np.ndarray):
        return obj.__array_interface__["data"][0], obj.shape, _np_strides(obj), obj.itemsize
    return obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), obj.element_size()


def overlap(a, b):
    """True when the address ranges of arrays/tensors a and b intersect."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.may_share_memory(a, b))
    pa, sa, ta, ia = _info(a)
    pb, sb, tb, ib = _info(b)
    if ta is None or tb is None:  # odd byte strides: fall back on the whole buffers
        return True
    ea, eb = _extent(pa, sa, ta, ia), _extent(pb, sb, tb, ib)
    return ea is not None and eb is not None and ea[0] < eb[1] and eb[0] < ea[1]


def no_overlap(x, out):
    if (isinstance(x, np.ndarray) or is_tensor(x)) and overlap(x, out):
        raise ValueError("x and out overlap in memory; out must not alias x")


# ------------------------------------------------------------------- outputs


_OUT_KINDS = dtypes.either()


def check_out(out, shape, what="out", shown=None, *, batched=False):
    """`out` must be a writeable NumPy array or CPU torch tensor of dtype float32, float16 or
    bfloat16, of exactly `shape` (when `batched`, `shape` is the wanted full shape and may have
    any leading axes that collapse to one stride), its last axis contiguous.

    `shown` is how messages write the wanted shape.  Returns (pointer, code, n, ld): the
    positions (1 when not batched) and their distance in elements.
    """
    want = shown or shape
    tensor = False
    if isinstance(out, np.ndarray):
        code = np_code(out.dtype)
        if code is None:
            raise TypeError(f"{what} must have dtype {_OUT_KINDS} (it is updated in place, never "
                            f"through a copy); got {out.dtype}")
    elif is_tensor(out):
        tensor = True
        check_tensor_place(out, what)
        code = torch_code(out)
        if code is None:
            raise TypeError(f"{what} must have dtype {_OUT_KINDS} (it is updated in place, never "
                            f"through a copy); got {dtype_name(out)}")
    else:
        raise TypeError(f"{what} must be a numpy.ndarray or a CPU torch.Tensor of {_OUT_KINDS} "
                        f"with shape {want}; got {type(out).__name__}")
    oshape = tuple(out.shape)
    if oshape != shape:
        raise ValueError(f"{what} must have shape {want}; got {oshape}")
    if tensor:
        if out.requires_grad:
            raise ValueError(f"{what} requires grad: an in-place write into it would not be seen "
                             f"by autograd; pass a tensor that does not require grad (e.g. under "
                             f"torch.no_grad(), or .detach())")
        if out.is_neg():
            raise ValueError(f"{what} is a lazily negated view (the imaginary part of a "
                             f"conjugated complex tensor): its memory holds the negated values; "
                             f"call .resolve_neg() on the tensor it views, or pass another out")
        ptr, strides, size = out.data_ptr(), tuple(out.stride()), out.element_size()
        note_write(out)
    else:
        if not out.flags.writeable:
            raise ValueError(f"{what} is read-only; it must be a writeable array")
        if out.flags.c_contiguous and out.size:
            # NumPy's own request to write (what lora._edge declines for a view NumPy marks
            # deprecated-writeable, e.g. of np.broadcast_arrays: NumPy warns here, once)
            ffi.from_buffer(out, require_writable=True)
        ptr, strides, size = out.__array_interface__["data"][0], _np_strides(out), out.itemsize
        if not out.flags.aligned:
            strides = None
    if ptr % size or strides is None:
        raise ValueError(f"{what} is not aligned to its item size ({size} bytes; a view at an "
                         f"odd byte offset); it must be an aligned array")
    if not batched:
        if len(shape) == 1 and (shape[0] <= 1 or strides[0] == 1):
            return ffi.cast(_VOIDP, ptr), code, 1, shape[0]
        raise ValueError(f"{what} must be C-contiguous; got strides "
                         f"{out.strides if not tensor else strides}")
    layout = out_layout(shape, strides)
    if layout is None:
        shown_strides = out.strides if not tensor else strides
        unit = "bytes" if not tensor else "elements"
        raise ValueError(
            f"{what} must be C-contiguous or a row-strided view whose last axis is contiguous "
            f"(strides[-1] == {size if not tensor else 1} {unit}) and whose leading axes "
            f"collapse to one stride of at least one row; got strides {shown_strides}")
    return ffi.cast(_VOIDP, ptr), code, layout[0], layout[1]


def batched_shape(out, last, what, lead=None):
    """The shape `out` must have for a batched method: its own leading axes (or `lead`) and
    `last`.  Raises for an `out` that is not an array of at least 2 dimensions."""
    ndim = out.ndim if isinstance(out, np.ndarray) or is_tensor(out) else None
    if ndim is None:
        check_out(out, None, what, shown=f"(..., {last})")  # always raises: not an array
    if is_tensor(out):
        check_tensor_place(out, what)  # device, layout, nested: before any shape is read
    if ndim < 2:
        raise ValueError(f"{what} must have shape (batch, ..., {last}) with at least one leading "
                         f"axis; got {tuple(out.shape)}")
    shape = tuple(out.shape)
    return (lead if lead is not None else shape[:-1]) + (last,)


# ------------------------------------------------------------------- inputs


def float_array(value, what):
    """np.asarray(value), which must have a real floating dtype (else TypeError); a CPU torch
    tensor is viewed, not copied (bfloat16 through its bits)."""
    if is_tensor(value):
        check_tensor_place(value, what)
        t = value.detach().resolve_neg()
        d = dtypes.BY_CODE.get(torch_code(t))
        if d is not None and d.foreign:  # torch's .numpy() lacks it: its bits, viewed
            bits = getattr(torch_module(), f"int{8 * d.itemsize}")
            return t.view(bits).numpy().view(d.numpy)
        if not t.dtype.is_floating_point:
            raise TypeError(f"{what} must be a real floating array (float16, bfloat16, float32 "
                            f"or float64); got dtype {dtype_name(t)}")
        torch = torch_module()
        if t.dtype not in (torch.float16, torch.float32, torch.float64):  # float8: .numpy()
            t = t.to(torch.float32)                                       # lacks it (exact)
        value = t.numpy()
    try:
        arr = np.asarray(value)
    except ValueError as e:  # a ragged list
        raise ValueError(f"{what} must be an array of one shape (rows of equal length): {e}") \
            from None
    if not is_float_dtype(arr.dtype):
        raise TypeError(f"{what} must be a real floating array (float16, bfloat16, float32 or "
                        f"float64); got dtype {arr.dtype}")
    return arr


def _float32_copy(x):
    """x as a new C-contiguous, aligned float32 array (np.ascontiguousarray keeps a misaligned
    float32 array as it is)."""
    return np.array(x, dtype=F32, order="C", copy=True)


def check_x(x, out, shape, what="x", *, batched=False, lead_of=None):
    """`x` of exactly `shape` (`shown` in messages through `lead_of`, the out it must match).

    Read in place when it is a float32/float16/bfloat16 NumPy array or CPU tensor whose layout
    the kernels take; anything else real and floating is converted to a float32 copy (checked
    for overlap with `out` first).  Returns (keep-alive object, pointer, code, ld).
    """
    if is_tensor(x):
        check_tensor_place(x, what)
        xshape = tuple(x.shape)
        if not (x.dtype.is_floating_point):
            raise TypeError(f"{what} must be a real floating array (float16, bfloat16, float32 or "
                            f"float64); got dtype {dtype_name(x)}")
        _check_shape(xshape, shape, what, lead_of)
        code = torch_code(x) if not x.is_neg() else None  # a lazily negated view: resolved
        if code is not None:
            strides = tuple(x.stride())
            layout = out_layout(shape, strides) if batched else (
                (1, shape[0]) if shape[0] <= 1 or strides[0] == 1 else None)
            if layout is not None and x.data_ptr() % x.element_size() == 0:
                return canonical(x), ffi.cast(_VOIDP, x.data_ptr()), code, layout[1]
        no_overlap(x, out)
        copy = x.detach().resolve_neg().to(device="cpu", dtype=torch_module().float32).contiguous()
        if copy.data_ptr() == x.data_ptr():
            copy = copy.clone()
        return copy, ffi.cast(_VOIDP, copy.data_ptr()), _F32_CODE, shape[-1]
    xa = x if isinstance(x, np.ndarray) else float_array(x, what)
    if not is_float_dtype(xa.dtype):
        raise TypeError(f"{what} must be a real floating array (float16, bfloat16, float32 or "
                        f"float64); got dtype {xa.dtype}")
    _check_shape(xa.shape, shape, what, lead_of)
    code = np_code(xa.dtype)
    if code is not None and xa.flags.aligned:
        strides = _np_strides(xa)
        if strides is not None:
            layout = out_layout(shape, strides) if batched else (
                (1, shape[0]) if shape[0] <= 1 or strides[0] == 1 else None)
            if layout is not None:
                return (canonical(xa), ffi.cast(_VOIDP, xa.__array_interface__["data"][0]), code,
                        layout[1])
    no_overlap(xa, out)
    xa = _float32_copy(xa)
    return xa, ffi.from_buffer(xa), _F32_CODE, shape[-1]


def canonical(arr):
    """An array or tensor that passed the checks, as lora._edge reads it: the same memory as a
    plain ``numpy.ndarray`` of NumPy's own object of its dtype (not a subclass such as
    ``np.memmap``, nor an equal dtype object with metadata), or a plain ``torch.Tensor`` (not a
    subclass such as an ``nn.Parameter``: a detached alias, which shares the version counter).
    Anything else as it is."""
    if isinstance(arr, np.ndarray):
        code = np_code(arr.dtype)
        want = dtypes.BY_CODE[code].numpy if code is not None else None
        if type(arr) is not np.ndarray:
            arr = arr.view(np.ndarray)
        return arr if want is None or arr.dtype is want else arr.view(want)
    if is_tensor(arr) and type(arr) is not torch_module().Tensor:
        return arr.detach()
    return arr


def _check_shape(got, want, what, lead_of):
    if tuple(got) != want:
        if lead_of is not None:
            raise ValueError(f"{what} must have shape {want} = [..., cols] to match out "
                             f"{lead_of}; got {tuple(got)}")
        raise ValueError(f"{what} must have shape {want} = [cols]; got {tuple(got)}")


def as_ids(ids, what, shape=None, *, any_shape=False, bound=None):
    """An int64 C-contiguous copy (or view) of integer ids; TypeError for bool/float ids.

    `shape`: the shape the ids must have (ValueError otherwise); `any_shape`: keep the ids'
    own shape (else they must be 1-D).  An id past int64 (a uint64 or a Python int) is an
    IndexError naming the valid range when `bound` is given (see `id_error`)."""
    if isinstance(ids, (list, tuple)) and ids and all(
            isinstance(v, int) and not isinstance(v, bool) for v in ids):
        big = [i for i, v in enumerate(ids) if not -2**63 <= v <= I64_MAX]
        if big:  # NumPy would make these an object or float array
            raise id_error(what, ids[big[0]], big[0], bound)
    if is_tensor(ids):
        check_tensor_place(ids, what)
        ids = ids.detach().resolve_neg()
    arr = np.asarray(ids)
    if arr.size == 0 and arr.dtype.kind in "fb" or arr.size == 0 and arr.dtype == object:
        arr = arr.astype(I64)  # no id, nothing to misread, whatever the empty array's dtype
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers; got dtype {arr.dtype}")
    if shape is not None and arr.shape != shape:
        if len(shape) == 1 and arr.ndim == 1:
            raise ValueError(f"{what} has {arr.shape[0]} ids; out has {shape[0]} positions")
        raise ValueError(f"{what} must have shape {shape}; got {arr.shape}")
    if shape is None and not any_shape and arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D; got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size:
        big = np.flatnonzero(arr.reshape(-1) > np.uint64(I64_MAX))
        if big.size:
            raise id_error(what, int(arr.reshape(-1)[big[0]]), position_of(arr, int(big[0])),
                           bound)
    if arr.dtype != I64 or not arr.flags.c_contiguous or not arr.flags.aligned:
        arr = np.array(arr, dtype=I64, order="C", copy=True)
    return arr if arr.dtype is I64 else arr.view(I64)  # NumPy's own int64 object


def per_id_shape(ids, lead, what):
    """Bank ids (or scales) of the leading shape `lead` or a prefix of it: returns how many
    consecutive positions share one id (the product of the axes the ids do not cover)."""
    k = ids.ndim
    if k < 1 or ids.shape != tuple(lead[:k]):
        prefixes = " or ".join(str(tuple(lead[:j])) for j in range(len(lead), 0, -1))
        raise ValueError(f"{what} must have the leading shape of out, {prefixes}; got shape "
                         f"{ids.shape}")
    every = 1
    for size in lead[k:]:
        every *= size
    return every


def as_scales(scales, what="scales"):
    """Per-position scales: a real (not bool) array-like or CPU tensor, as float64 C-contiguous
    (a float16/bfloat16 tensor is widened exactly)."""
    if is_tensor(scales):
        check_tensor_place(scales, what)
        torch = torch_module()
        if scales.dtype == torch.bool or scales.dtype.is_complex:
            raise TypeError(f"{what} must be real numbers (not bool); got dtype "
                            f"{dtype_name(scales)}")
        scales = scales.detach().resolve_neg().to(torch.float64).numpy()
    arr = np.asarray(scales)
    if arr.dtype.kind == "b" or not (arr.dtype.kind in "iu" or is_float_dtype(arr.dtype)):
        raise TypeError(f"{what} must be real numbers (not bool); got dtype {arr.dtype}")
    if not np.isfinite(arr.astype(np.float64)).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(arr.astype(np.float64)))[0])
        raise ValueError(f"{what} has a non-finite value ({arr[bad]}) at index {bad}")
    out = np.ascontiguousarray(arr, dtype=np.float64)
    return out if out.dtype is _F64 else out.view(_F64)  # NumPy's own float64 object


def token_id(r, rows):
    """One token id for add_row_to: an int (not bool, not float) in [0, rows) (rows None: >= 0)."""
    if isinstance(r, (bool, np.bool_)) or isinstance(r, (float, np.floating)):
        raise TypeError(f"token id must be an integer; got {type(r).__name__}")
    if is_tensor(r):
        if r.dtype.is_floating_point or r.dtype == torch_module().bool or r.numel() != 1:
            raise TypeError(f"token id must be an integer; got a {dtype_name(r)} tensor of "
                            f"shape {tuple(r.shape)}")
        r = int(r.item())
    try:
        r = operator.index(r)
    except TypeError:
        raise TypeError(f"token id must be an integer; got {type(r).__name__}") from None
    if r < 0 or (rows is not None and r >= rows):
        where = f"[0, {rows})" if rows is not None else "(ids are >= 0)"
        raise IndexError(f"token id {r} is out of range {where} for this embedding")
    return r
