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


def candidates(name, impls):
    """Formulations of one baseline, each an Impl named ``"name:how"``: the runner times them in
    the same rounds and keeps the fastest under `name`, saying which (`runner.fold_candidates`)."""
    return {f"{name}:{how}": impl for how, impl in impls.items()}


def _scaled_t(m, s):
    """``s * m.T`` as a new C-contiguous float32 array: a factor transposed (and scaled) once."""
    return np.ascontiguousarray((m * np.float32(s)).T)


def numpy_tuned(calls, name="numpy_tuned"):
    """NumPy with nothing allocated in the loop, in the formulations a careful user tries; each
    writes the rank-sized ``y`` and the out-sized ``z`` into preallocated buffers with
    ``np.matmul(..., out=)`` and adds with ``np.add(out, z, out=out)``:

    * ``views``: the factors as given, transposed by views (``y = x @ A.T``, the scale applied
      to ``y`` in place, ``z = y @ B.T``; for one activation the same BLAS calls as ``A @ x`` and
      ``B @ y``);
    * ``B^T copied``: ``y = A @ x`` (decode) or ``x @ A.T``, then ``z = y @ Bs^T`` with
      ``Bs^T = (s B)^T`` transposed and scaled once into a contiguous array;
    * ``A^T, B^T copied``: both factors transposed once (B's scaled), ``y = x @ A^T``,
      ``z = y @ Bs^T``.

    Calls of one shape share their buffers.  Returns `candidates`."""
    ys, zs = {}, {}
    views, bcopy, both = [], [], []
    for a, b, s, x, o in calls:
        yshape = x.shape[:-1] + (a.shape[0],)
        y = ys.setdefault(yshape, np.empty(yshape, np.float32))
        z = zs.setdefault(o.shape, np.empty(o.shape, np.float32))
        bst = _scaled_t(b, s)
        views.append((a.T, b.T, s, x, o, y, z))
        bcopy.append((a, a.T, bst, x, o, y, z))
        both.append((np.ascontiguousarray(a.T), bst, x, o, y, z))
    decode = calls[0][3].ndim == 1

    def tuned(calls=views, mm=np.matmul, add=np.add, mul=np.multiply):
        for at, bt, s, x, o, y, z in calls:
            mm(x, at, out=y)
            mul(y, s, out=y)
            mm(y, bt, out=z)
            add(o, z, out=o)

    if decode:
        def b_copied(calls=bcopy, mm=np.matmul, add=np.add):
            for a, _, bst, x, o, y, z in calls:
                mm(a, x, out=y)
                mm(y, bst, out=z)
                add(o, z, out=o)
    else:
        def b_copied(calls=bcopy, mm=np.matmul, add=np.add):
            for _, at, bst, x, o, y, z in calls:
                mm(x, at, out=y)
                mm(y, bst, out=z)
                add(o, z, out=o)

    def both_copied(calls=both, mm=np.matmul, add=np.add):
        for at, bst, x, o, y, z in calls:
            mm(x, at, out=y)
            mm(y, bst, out=z)
            add(o, z, out=o)
    return candidates(name, {"views": Impl(tuned), "B^T copied": Impl(b_copied),
                             "A^T, B^T copied": Impl(both_copied)})


def torch_baseline(torch, calls, dtype, name="torch"):
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

    Two formulations (`candidates`): ``views`` (the factors as given: ``A @ x`` and ``B`` for a
    decode, ``A.T`` and ``B.T`` views for a batch) and ``transposed copies`` (``A^T`` and
    ``B^T`` made contiguous once: ``x @ A^T`` and ``addmv_(B^T.T, y)`` / ``addmm_(y, B^T)``).
    Calls of one shape share their buffers."""
    return candidates(name, {"views": _torch_impl(torch, calls, dtype, False),
                             "transposed copies": _torch_impl(torch, calls, dtype, True)})


def _torch_impl(torch, calls, dtype, copies):
    """One formulation of `torch_baseline`."""
    tm = torch.matmul
    ys, zs, xs = {}, {}, {}
    decode = calls[0][3].dim() == 1

    def buf(store, shape):
        return store.setdefault(tuple(shape), torch.empty(tuple(shape), dtype=dtype))

    fused = all(x.dtype == dtype and o.dtype == dtype for _, _, _, x, o in calls)
    bound = []
    for a, b, s, x, o in calls:
        at, bt = torch.from_numpy(a).to(dtype), torch.from_numpy(b).to(dtype)
        if copies:  # A^T [cols, rank] and B^T [rank, rows] contiguous, used through .T for B
            at, bt = at.T.contiguous(), bt.T.contiguous()
            bt = bt.T if decode else bt
        elif not decode:
            at, bt = at.T, bt.T
        y = buf(ys, tuple(x.shape[:-1]) + (a.shape[0],))
        if not fused:  # each distinct x converted into a buffer of the factors' dtype
            if id(x) not in xs:
                xs[id(x)] = (torch.empty(tuple(x.shape), dtype=dtype), x)
            x = xs[id(x)][0]
        # a decode's x @ A^T: a [1, cols] x [cols, rank] product into y's [1, rank] view
        x1, y1 = (x.unsqueeze(0), y.unsqueeze(0)) if decode and copies else (x, y)
        bound.append((at, bt, s, x1, o, y, y1) + (() if fused else (buf(zs, o.shape),)))
    convert = list(xs.values())

    if fused and decode and copies:
        def torch_fn(calls=bound, tm=tm):
            for at, b, s, x1, o, y, y1 in calls:
                tm(x1, at, out=y1)
                o.addmv_(b, y, alpha=s)
    elif fused and decode:
        def torch_fn(calls=bound, tm=tm):
            for a, b, s, x, o, y, _ in calls:
                tm(a, x, out=y)
                o.addmv_(b, y, alpha=s)
    elif fused:
        def torch_fn(calls=bound, tm=tm):
            for at, bt, s, x, o, y, _ in calls:
                tm(x, at, out=y)
                o.addmm_(y, bt, alpha=s)
    elif decode and copies:
        def torch_fn(calls=bound, convert=convert, tm=tm):
            for h, f in convert:  # each activation converted once per run
                h.copy_(f)
            for at, b, s, x1, o, y, y1, z in calls:
                tm(x1, at, out=y1)
                tm(b, y, out=z)
                o.add_(z, alpha=s)
    elif decode:
        def torch_fn(calls=bound, convert=convert, tm=tm):
            for h, f in convert:  # each activation converted once per run
                h.copy_(f)
            for a, b, s, x, o, y, _, z in calls:
                tm(a, x, out=y)
                tm(b, y, out=z)
                o.add_(z, alpha=s)
    else:
        def torch_fn(calls=bound, convert=convert, tm=tm):
            for h, f in convert:
                h.copy_(f)
            for at, bt, s, x, o, y, _, z in calls:
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
    """`numpy_tuned`'s formulations on the `concatenated` pair (its scale 1: each member's is in
    B_cat), named ``numpy_cat:how``."""
    return numpy_tuned([(*concatenated(terms), 1.0, x, out)], "numpy_cat")


def torch_concat(torch, terms, x, out, dtype):
    """`torch_baseline`'s formulations on the `concatenated` pair (factors of `dtype`; x and out
    float32 torch tensors), named ``torch_cat:how``."""
    a_cat, b_cat = concatenated(terms)
    return torch_baseline(torch, [(a_cat, b_cat, 1.0, x, out)], dtype, "torch_cat")
