"""Token-embedding deltas: ``add_row_to`` (one token) and ``add_rows_to`` (n ids): row t of
``s B A`` added to out, with ``A [rank, dim]``, ``B [vocab, rank]``.

Bytes / flops (n ids, u of them distinct): bytes = rank*dim*w (A) + u*rank*w (rows of B) +
n*dim*4*2 (out) + n*8 (ids, n > 1); flops = 2*n*rank*dim.  Baselines: the NumPy and PyTorch
gathers of B's rows followed by one product with A (their own: no other family gathers).
"""

from __future__ import annotations

import numpy as np

from ..timing import Impl
from .baselines import candidates
from .core import TOL, Built, make_delta, pair, scale_of

GATHER = (32000, 4096, 16)
GATHER_IDS = (1, 512)


def gather_name(n):
    return f"gather n{n} {GATHER[0]}x{GATHER[1]} r{GATHER[2]}"


def build_gather(ctx, vocab, dim, rank, n):
    """add_row_to (n == 1) or add_rows_to (n ids), against

    * numpy_naive: ``out += s * (B[ids] @ A)``;
    * numpy_tuned, the faster of two formulations: ``np.take(B, ids, out=)`` (or the one row),
      the scale in place, ``np.matmul(g, A, out=)``, ``np.add(out=)`` ("scale in place"); or
      the same on ``s B`` scaled once, without the multiply ("B scaled once");
    * torch: ``index_select(out=)`` then ``out.addmm_(g, A, alpha=s)``; one row: ``out.addmv_(A^T,
      B[r], alpha=s)`` with ``A^T`` a view or a contiguous copy made once, the faster kept."""
    lora, torch, rng = ctx.lora, ctx.torch, ctx.rng
    a, b = pair(rng, vocab, dim, rank)  # A [rank, dim], B [vocab, rank]: row t of s B A
    d = make_delta(lora, a, b, "float32", rank)
    s = scale_of(d)
    mm, add, mul = np.matmul, np.add, np.multiply
    if n == 1:
        r = int(rng.integers(vocab))
        oshape = (dim,)
        method, first = d.add_row_to, r
        ids_count = 1
    else:
        ids = rng.integers(0, vocab, size=n, dtype=np.int64)
        oshape = (n, dim)
        method, first = d.add_rows_to, ids
        ids_count = len(np.unique(ids))

    def zeros():
        return np.zeros(oshape, np.float32)

    impls = {"ours": Impl(method, first, zeros())}
    bs = b * np.float32(s)  # B scaled once
    if n == 1:
        def naive(o=zeros(), a=a, b=b, r=r, s=s):
            o += s * (b[r] @ a)

        g, z = np.empty(rank, np.float32), np.empty(dim, np.float32)

        def tuned(o=zeros(), a=a, b=b, r=r, s=s, g=g, z=z):
            mul(b[r], s, out=g)
            mm(g, a, out=z)
            add(o, z, out=o)

        def prescaled(o=zeros(), a=a, bs=bs, r=r, z=z):
            mm(bs[r], a, out=z)
            add(o, z, out=o)
    else:
        def naive(o=zeros(), a=a, b=b, ids=ids, s=s):
            o += s * (b[ids] @ a)

        g, z = np.empty((n, rank), np.float32), np.empty(oshape, np.float32)

        def tuned(o=zeros(), a=a, b=b, ids=ids, s=s, g=g, z=z, take=np.take):
            take(b, ids, axis=0, out=g)
            mul(g, s, out=g)
            mm(g, a, out=z)
            add(o, z, out=o)

        def prescaled(o=zeros(), a=a, bs=bs, ids=ids, g=g, z=z, take=np.take):
            take(bs, ids, axis=0, out=g)
            mm(g, a, out=z)
            add(o, z, out=o)
    impls["numpy_naive"] = Impl(naive)
    impls.update(candidates("numpy_tuned", {"scale in place": Impl(tuned), "B scaled once": Impl(prescaled)}))
    if torch is not None:
        a_t, b_t = torch.from_numpy(a), torch.from_numpy(b)
        if n == 1:
            def torch_fn(at, o=torch.from_numpy(zeros()), b=b_t, r=r, s=s):
                o.addmv_(at, b[r], alpha=s)
            impls.update(candidates("torch", {"A^T view": Impl(torch_fn, a_t.T),
                                              "A^T copied": Impl(torch_fn, a_t.T.contiguous())}))
        else:
            def torch_fn(o=torch.from_numpy(zeros()), a=a_t, b=b_t, ids=torch.from_numpy(ids), s=s,
                         g=torch.empty(n, rank), sel=torch.index_select):
                sel(b, 0, ids, out=g)
                o.addmm_(g, a, alpha=s)
            impls["torch"] = Impl(torch_fn)

    def ours_once():
        o = zeros()
        method(first, o)
        return o

    def ref_once():
        rows_ = b[first] if n == 1 else b[ids]
        return s * (rows_.astype(np.float64) @ a.astype(np.float64))

    nbytes = rank * dim * 4 + ids_count * rank * 4 + n * dim * 8 + (n * 8 if n > 1 else 0)
    return Built(impls, nbytes, 2 * n * rank * dim, (ours_once, ref_once, TOL["float32"]))
