"""The baselines the linear families (decode, prefill, stack, model sweep, bf16 activations) are
compared with, written once.

A *call* is ``(a, b, s, x, out)``: ``A [rank, cols]`` and ``B [rows, rank]`` as float32 NumPy
arrays, the effective scale ``s``, and ``x [cols]`` (decode) or ``x [n, cols]`` with ``out
[rows]`` or ``[n, rows]``.  One implementation runs its calls in order (a stack: several deltas
on the same x and out; the model sweep: one call per projection of every layer).  Every builder
returns a `timing.Impl` whose outputs are its own (the caller passes fresh ``out`` buffers).
"""

from __future__ import annotations

import numpy as np

from ..timing import Impl


def calls(terms, x, out):
    """The calls of `terms` ``[(a, b, s)]`` on one x and out (one delta, or a stack in order)."""
    return [(a, b, s, x, out) for a, b, s in terms]


def numpy_naive(calls):
    """What a NumPy user writes first: ``out += s * (B @ (A @ x))``; batches ``out += s * ((x @
    A.T) @ B.T)``; temporaries allocated by every call."""
    if calls[0][3].ndim == 1:
        def naive(calls=calls):
            for a, b, s, x, o in calls:
                o += s * (b @ (a @ x))
    else:
        def naive(calls=calls):
            for a, b, s, x, o in calls:
                o += s * ((x @ a.T) @ b.T)
    return Impl(naive)


def numpy_tuned(calls):
    """NumPy with nothing allocated in the loop: ``y = x @ A.T`` into a preallocated rank-sized
    buffer with ``np.matmul(..., out=)`` on factors transposed once (views), the scale applied to
    ``y`` in place, ``z = y @ B.T`` into a preallocated out-sized buffer, ``np.add(out, z,
    out=out)``.  For one activation this is the same BLAS call as ``A @ x`` (the same bits and
    time, checked); calls of one shape share their buffers."""
    ys, zs = {}, {}
    bound = []
    for a, b, s, x, o in calls:
        yshape = x.shape[:-1] + (a.shape[0],)
        y = ys.setdefault(yshape, np.empty(yshape, np.float32))
        z = zs.setdefault(o.shape, np.empty(o.shape, np.float32))
        bound.append((a.T, b.T, s, x, o, y, z))

    def tuned(calls=bound, mm=np.matmul, add=np.add, mul=np.multiply):
        for at, bt, s, x, o, y, z in calls:
            mm(x, at, out=y)
            mul(y, s, out=y)
            mm(y, bt, out=z)
            add(o, z, out=o)
    return Impl(tuned)


def torch_baseline(torch, calls, dtype):
    """PyTorch CPU doing the job by hand, preallocated, with the factors as torch tensors of
    `dtype` (``torch.from_numpy`` views when that is float32: no copies); ``x`` and ``out`` of
    each call are torch tensors of their own dtype.

    * factors, x and out of one dtype: ``y = torch.matmul(x, A.T, out=)`` (decode ``A @ x``),
      then ``out.addmm_(y, B.T, alpha=s)`` (decode ``addmv_``): the second product and the add
      in one BLAS call;
    * factors of another dtype (float16 / bfloat16 adapters under float32 activations; PEFT's
      float32 upcast of bfloat16 activations): each distinct x is copied into a buffer of the
      factors' dtype once per run, ``y = x @ A.T`` and ``z = y @ B.T`` into preallocated buffers
      of that dtype, then ``out.add_(z, alpha=s)`` (rounded once into out's dtype).

    Calls of one shape share their buffers."""
    tm = torch.matmul
    ys, zs, xs = {}, {}, {}
    decode = calls[0][3].dim() == 1

    def buf(store, shape):
        return store.setdefault(tuple(shape), torch.empty(tuple(shape), dtype=dtype))

    fused = all(x.dtype == dtype and o.dtype == dtype for _, _, _, x, o in calls)
    bound = []
    for a, b, s, x, o in calls:
        at, bt = torch.from_numpy(a).to(dtype), torch.from_numpy(b).to(dtype)
        if not decode:
            at, bt = at.T, bt.T
        y = buf(ys, tuple(x.shape[:-1]) + (a.shape[0],))
        if fused:
            bound.append((at, bt, s, x, o, y))
        else:
            if id(x) not in xs:
                xs[id(x)] = (torch.empty(tuple(x.shape), dtype=dtype), x)
            bound.append((at, bt, s, xs[id(x)][0], o, y, buf(zs, o.shape)))
    convert = list(xs.values())

    if fused and decode:
        def torch_fn(calls=bound, tm=tm):
            for a, b, s, x, o, y in calls:
                tm(a, x, out=y)
                o.addmv_(b, y, alpha=s)
    elif fused:
        def torch_fn(calls=bound, tm=tm):
            for at, bt, s, x, o, y in calls:
                tm(x, at, out=y)
                o.addmm_(y, bt, alpha=s)
    elif decode:
        def torch_fn(calls=bound, convert=convert, tm=tm):
            for h, f in convert:  # each activation converted once per run
                h.copy_(f)
            for a, b, s, x, o, y, z in calls:
                tm(a, x, out=y)
                tm(b, y, out=z)
                o.add_(z, alpha=s)
    else:
        def torch_fn(calls=bound, convert=convert, tm=tm):
            for h, f in convert:
                h.copy_(f)
            for at, bt, s, x, o, y, z in calls:
                tm(x, at, out=y)
                tm(y, bt, out=z)
                o.add_(z, alpha=s)
    return Impl(torch_fn)


def concatenated(terms):
    """A stack as one pair, what a careful user builds once: ``A_cat [k·r, cols]`` (the members'
    A stacked) and ``B_cat [rows, k·r]`` (their B side by side, each scaled by its member's
    scale), so that ``B_cat (A_cat x) = Σ s_i B_i (A_i x)``: two products instead of 2k."""
    a_cat = np.ascontiguousarray(np.concatenate([a for a, _, _ in terms], axis=0))
    b_cat = np.ascontiguousarray(np.concatenate([b * np.float32(s) for _, b, s in terms], axis=1))
    return a_cat, b_cat


def numpy_concat(terms, x, out):
    """`numpy_tuned` on the `concatenated` pair: ``y = x @ A_cat.T``, ``z = y @ B_cat.T`` into
    preallocated buffers, ``np.add(out, z, out=out)``."""
    a_cat, b_cat = concatenated(terms)
    y = np.empty(x.shape[:-1] + (a_cat.shape[0],), np.float32)
    z = np.empty(out.shape, np.float32)

    def cat(at=a_cat.T, bt=b_cat.T, x=x, o=out, y=y, z=z, mm=np.matmul, add=np.add):
        mm(x, at, out=y)
        mm(y, bt, out=z)
        add(o, z, out=o)
    return Impl(cat)


def torch_concat(torch, terms, x, out, dtype):
    """`torch_baseline` on the `concatenated` pair (factors of `dtype`; x and out float32
    torch tensors): ``y = matmul(x, A_cat.T, out=)`` then ``out.addmm_(y, B_cat.T)`` (decode:
    ``mv`` and ``addmv_``); factors of a half dtype take a float32 copy of x's product
    through buffers of that dtype, as `torch_baseline` does."""
    a_cat, b_cat = (torch.from_numpy(m).to(dtype) for m in concatenated(terms))
    decode = x.dim() == 1
    y = torch.empty(tuple(x.shape[:-1]) + (a_cat.shape[0],), dtype=dtype)
    if dtype == torch.float32:
        if decode:
            def cat(a=a_cat, b=b_cat, x=x, o=out, y=y, tm=torch.matmul):
                tm(a, x, out=y)
                o.addmv_(b, y)
        else:
            def cat(at=a_cat.T, bt=b_cat.T, x=x, o=out, y=y, tm=torch.matmul):
                tm(x, at, out=y)
                o.addmm_(y, bt)
        return Impl(cat)
    xh, z = torch.empty(tuple(x.shape), dtype=dtype), torch.empty(tuple(out.shape), dtype=dtype)
    at, bt = (a_cat, b_cat) if decode else (a_cat.T, b_cat.T)

    def cat_half(at=at, bt=bt, x=x, xh=xh, o=out, y=y, z=z, tm=torch.matmul, decode=decode):
        xh.copy_(x)
        if decode:
            tm(at, xh, out=y)
            tm(bt, y, out=z)
        else:
            tm(xh, at, out=y)
            tm(y, bt, out=z)
        o.add_(z)
    return Impl(cat_half)
