"""The one way an apply method reaches its C call, and the argument checks on that way.

Every method that adds into ``out`` from an ``x`` (``LoraDelta.add_to`` / ``add_batch_to``, the
entry table's adds behind stacks, banks and adapter sets) takes the same steps:

1. the ndarray fast path, written inline in the method because it is the common case and a
   Python call costs about as much as one of its checks: NumPy arrays of the exact shapes, of
   dtypes the kernels read (`fast_code`), contiguous -> the C call (`LoraDelta`'s two methods
   take this case, and plain CPU tensors too, in C: `lora._edge`, csrc/python/edge.c);
2. `run_vec` (decode: x ``[cols]``, out ``[rows]``) or `run_batch` (x ``[..., cols]``, out
   ``[..., rows]``) for everything else: the tensor fast path (contiguous CPU tensors of those
   dtypes, passed by address), then the checked path (every rule of the input contract; an x
   the kernels cannot read in place is converted), which is also where a fast call that C
   refused goes (``LORA_ERR_ALIGN``: a view at an odd byte offset, which only the checked path
   copies).

A method hands them its C call.  A decode call is ``call(extra, xp, xc, op, oc)``, a batched
one ``call(extra, lead, n, xp, xc, ldx, op, oc, ldo)``: ``extra`` is what the method passes
through (the delta; the table with out, its ids and scales), ``xp`` / ``op`` the pointers of x
and out (cdata; integer addresses for ``call_at``, the tensor form, or cast when there is
none), ``xc`` / ``oc`` their dtype codes, ``n`` the positions, ``ldx`` / ``ldo`` the leading
dimensions and ``lead`` the leading shape on the checked path (None on the fast paths, where a
batched call may return `DECLINE` to take the checked path instead).  The call returns the C
status, and may raise for errors it can name better (an adapter id and its position).  A new
adapter type adds its calls, not another copy of these steps.
"""

import numpy as np

from . import _arrays as arrays
from . import _dtypes as dtypes
from . import _edge
from ._lora_cffi import ffi, lib

__all__ = ["run_vec", "run_batch", "DECLINE", "vec_args", "batch_args", "rows_args"]

DECLINE = _edge.DECLINE  # a fast-path call's answer for "not this path": the checked path follows

# The fast paths' vocabulary, bound once here and imported by the modules of the apply methods (a
# module global is reached faster than an attribute).  from_buffer(CHARS, out, True) asks for a
# writable buffer at half the cost of the keyword form (cffi's keyword parsing: ~0.2 us a call).
ndarray = np.ndarray
from_buffer = ffi.from_buffer
CHARS = ffi.typeof("char[]")
INT64S = ffi.typeof("int64_t[]")
DOUBLES = ffi.typeof("double[]")
NULL = ffi.NULL
# fast_code(id(dtype)): the C code of a NumPy activation dtype the ndarray fast paths take, or
# None.  Bound here as a plain function: Python 3.11 compiles FAST.get(...) on a name imported
# with `from ... import` as an attribute load (it may be a module), a bound method made per call
fast_code = dtypes.FAST.get
ERR_ALIGN = lib.LORA_ERR_ALIGN


def address(cdata):
    """A cffi pointer's address as an int: the form lora._edge takes pointers in."""
    return int(ffi.cast("uintptr_t", cdata))


# lora._edge (LoraDelta's entries and the entry table's apply calls, in C) reads the same dtype
# objects as `fast_code` (and the ids' and scales' of the table's fast path) and calls the
# library's own lora_add / lora_add_batch / lora_apply_batch
_edge.setup(ndarray, dtypes.fast_pairs(), np.dtype(np.int64), np.dtype(np.float64),
            tuple(address(ffi.addressof(lib, f))
                  for f in ("lora_add", "lora_add_batch", "lora_apply_batch")))

_cast = ffi.cast
_VOIDP = ffi.typeof("void *")
_TORCH_CODES = arrays.TORCH_CODES  # filled in place at the first tensor
_torch_init = arrays.torch_init
_note_write = arrays.note_write
_raise_status = arrays.raise_status
_TENSOR_MISS = (AttributeError, RuntimeError, TypeError, IndexError)


def run_vec(call, call_at, extra, x, out, xshape, oshape, status):
    """Decode: ``call`` on x of shape ``xshape`` = ``(cols,)`` and out of ``oshape`` =
    ``(rows,)``; returns out.  ``status``: the nonzero status of the method's own ndarray call,
    or None when it made none (``LORA_ERR_ALIGN`` retries through the checked path, anything
    else is raised); `DECLINE` when the method knows its arguments take the checked path."""
    if status is None:
        if type(out) is not ndarray:
            # the tensor fast path: plain contiguous CPU tensors of the exact shapes, without
            # the neg bit (a lazily negated view: its memory holds the negated values; the
            # checked path resolves it for x and refuses it for out)
            try:
                codes = _TORCH_CODES or _torch_init()
                xc, oc = codes.get(x.dtype), codes.get(out.dtype)
                fast = (xc is not None and oc is not None and xshape[0] > 1 and oshape[0] > 1
                        and x.is_cpu and out.is_cpu and not out.requires_grad
                        and x.shape == xshape and out.shape == oshape
                        and x.is_contiguous() and out.is_contiguous()
                        and not x.is_neg() and not out.is_neg())
                if fast:  # a tensor without memory (torch's zero tensors) has address 0
                    xa, oa = x.data_ptr(), out.data_ptr()
                    fast = xa != 0 and oa != 0
                if fast:
                    _note_write(out)
            except _TENSOR_MISS:
                fast = False
            if fast:
                if call_at is not None:
                    status = call_at(extra, xa, xc, oa, oc)
                else:
                    status = call(extra, _cast(_VOIDP, xa), xc, _cast(_VOIDP, oa), oc)
                if status == 0:
                    return out
    elif status != ERR_ALIGN and status != DECLINE:
        _raise_status(status)
    # the checked path, also after any refusal of a fast call (it raises the precise error)
    keep, xp, xc, op, oc = vec_args(x, out, xshape, oshape)  # keep: x's copy lives through C
    status = call(extra, xp, xc, op, oc)
    if status:
        _raise_status(status)
    return out


def run_batch(call, call_at, extra, x, out, cols, rows, status, xdrop=0):
    """Batched: ``call`` on x ``[..., cols]`` and out ``[..., rows]`` with the same leading axes;
    returns out.  ``status`` as for `run_vec`.  ``xdrop``: x lacks that many of out's last
    leading axes (1: a mixture of experts' token rows, each shared by the token's slots: x
    ``[T, cols]`` for out ``[T, k, rows]``); ``n`` is then still out's positions."""
    if status is None:
        if type(out) is not ndarray:
            # the tensor fast path: plain contiguous CPU tensors, any leading axes (the neg bit:
            # as in run_vec)
            try:
                codes = _TORCH_CODES or _torch_init()
                xc, oc = codes.get(x.dtype), codes.get(out.dtype)
                n = -1
                if (xc is not None and oc is not None and cols > 1 and rows > 1 and x.is_cpu
                        and out.is_cpu and not out.requires_grad):
                    xs, os_ = x.shape, out.shape
                    nd = len(os_)
                    if nd == 2 and not xdrop:  # the common case, without slicing torch.Size
                        if os_[1] == rows and len(xs) == 2 and xs[1] == cols and xs[0] == os_[0]:
                            n = os_[0]
                    elif (nd >= 2 and os_[-1] == rows and xs[-1] == cols
                          and tuple(xs)[:-1] == tuple(os_)[:nd - 1 - xdrop]):
                        n = out.numel() // rows
                    if n >= 0 and not (x.is_contiguous() and out.is_contiguous()
                                       and not x.is_neg() and not out.is_neg()):
                        n = -1
                if n >= 0:  # as in run_vec: address 0 (with positions) is a tensor without memory
                    xa, oa = x.data_ptr(), out.data_ptr()
                    if n > 0 and (xa == 0 or oa == 0):
                        n = -1
                if n >= 0:
                    _note_write(out)
            except _TENSOR_MISS:
                n = -1
            if n >= 0:
                if call_at is not None:
                    status = call_at(extra, None, n, xa, xc, cols, oa, oc, rows)
                else:
                    status = call(extra, None, n, _cast(_VOIDP, xa), xc, cols, _cast(_VOIDP, oa),
                                  oc, rows)
                if status == 0:
                    return out
    elif status != ERR_ALIGN and status != DECLINE:
        _raise_status(status)
    keep, xp, xc, ldx, op, oc, ldo, n, lead = batch_args(x, out, cols, rows, xdrop)  # as run_vec
    status = call(extra, lead, n, xp, xc, ldx, op, oc, ldo)
    if status:
        _raise_status(status)
    return out


def vec_args(x, out, xshape, oshape):
    """Checks for the decode methods: out of ``oshape`` = ``(rows,)``, x of ``xshape`` =
    ``(cols,)``.  Returns (x keep-alive, x ptr, x code, out ptr, out code)."""
    op, oc, _, _ = arrays.check_out(out, oshape)
    keep, xp, xc, _ = arrays.check_x(x, out, xshape)
    return keep, xp, xc, op, oc


def batch_args(x, out, cols, rows, xdrop=0):
    """Checks for the batched linear methods: out [..., rows], x [..., cols] with the same leading
    axes (less out's last ``xdrop``: see `run_batch`).  Returns (x keep-alive, x ptr, x code, ldx,
    out ptr, out code, ldo, out positions, out's leading shape)."""
    shape = arrays.batched_shape(out, rows, "out")
    op, oc, n, ldo = arrays.check_out(out, shape, shown=f"(..., {rows})", batched=True)
    lead = shape[:-1]
    keep, xp, xc, ldx = arrays.check_x(x, out, lead[:len(lead) - xdrop] + (cols,), batched=True,
                                       lead_of=shape)
    return keep, xp, xc, ldx, op, oc, ldo, n, lead


def rows_args(ids, out, cols, rows=None):
    """Checks for the gathers: ids of any shape (at least 1-D), out [*ids.shape, cols]; `rows`
    (the vocabulary) names the valid range of an id past int64.  Returns (int64 ids, out ptr,
    out code, ldo, positions)."""
    if not (isinstance(out, ndarray) or arrays.is_tensor(out)):
        arrays.check_out(out, None, shown=f"(n, {cols})")  # always raises: not an array
    if arrays.is_tensor(out):
        arrays.check_tensor_place(out, "out")  # device, layout, nested: before any shape is read
    tok = arrays.as_ids(ids, "ids", any_shape=True, bound=rows)
    if tok.ndim == 0:
        raise ValueError("ids must have at least one axis (a 0-d id is add_row_to's); got a "
                         "0-d array")
    if len(out.shape) >= 1 and tuple(out.shape[:-1]) != tok.shape and tok.ndim == 1 \
            and len(out.shape) == 2 and out.shape[-1] == cols:
        raise ValueError(f"ids has {tok.shape[0]} ids; out has {out.shape[0]} positions")
    op, oc, n, ldo = arrays.check_out(out, tok.shape + (cols,), shown=f"{tok.shape + (cols,)}",
                                      batched=True)
    return tok, op, oc, ldo, n
