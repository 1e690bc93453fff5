"""Merges: a rank-16 adapter merged into an n x n torch weight (float32, float16, bfloat16),
what loading a PEFT adapter with ``merge_and_unload()`` does per layer, against PyTorch's
``w.add_(B @ A * s)`` and PEFT's CPU merge (their own: no other family merges).

Bytes / flops: bytes = 2*n*n*itemsize (w read and written) + rank*2*n*4 (A and B); flops =
2*n*n*rank.
"""

from __future__ import annotations

import numpy as np

from ..timing import Impl
from .core import TOL, Built, Skip, as64, make_delta, pair, rand, scale_of, torch_dtype

MERGE_N, QUICK_MERGE_N, MERGE_RANK = 4096, 2048, 16
MERGE_DTYPES = ("float32", "float16", "bfloat16")


def build_merge(ctx, wdt, n=MERGE_N, rank=MERGE_RANK):
    """A rank-16 adapter merged into an n x n weight held as a torch tensor of dtype `wdt`,
    what loading a PEFT adapter with merge_and_unload() does per layer.  ours:
    ``LoraDelta.merge_into(w)`` (float32 factors; float64 sum, rounded once, overflow checked
    before any write); torch: ``w.add_((B @ A).mul_(s))`` with B and A in w's dtype, what a
    torch user writes (no check, bf16/f16 products rounded along the way); peft: PEFT's CPU
    merge, ``w += (B.float() @ A.float() * s).to(w.dtype)`` (its half-precision weights are
    upcast for the product on the CPU).  Each merges into its own copy of w, again and again."""
    lora, torch, rng = ctx.lora, ctx.torch, ctx.rng
    if torch is None:
        raise Skip("needs torch (the weights are torch tensors)")
    a, b = pair(rng, n, n, rank)
    d = make_delta(lora, a, b, "float32", rank)
    s = scale_of(d)
    tdt = torch_dtype(torch, wdt)
    w0 = torch.from_numpy(rand(rng, (n, n), 0.02)).to(tdt)
    a32, b32 = torch.from_numpy(a), torch.from_numpy(b)
    ah, bh = a32.to(tdt), b32.to(tdt)

    def torch_fn(w=w0.clone(), a=ah, b=bh, s=s):
        w.add_((b @ a).mul_(s))

    def peft_fn(w=w0.clone(), a=a32, b=b32, s=s, dt=tdt):
        w += (b @ a * s).to(dt)

    impls = {"ours": Impl(d.merge_into, w0.clone()), "torch": Impl(torch_fn), "peft": Impl(peft_fn)}

    def ours_once():
        return as64(d.merge_into(w0.clone()))

    def ref_once():
        return as64(w0) + s * (b.astype(np.float64) @ a.astype(np.float64))

    item = w0.element_size()
    return Built(impls, 2 * n * n * item + rank * 2 * n * 4, 2 * n * n * rank,
                 (ours_once, ref_once, TOL[wdt]), info={"merge_n": n})


def merge_name(n):
    return f"merge r{MERGE_RANK} into w {n}x{n}"
