"""DoRA: ``DoraDelta.add_batch_to`` (PEFT's ``use_dora``, the LoRA term rescaled per output row
to a learned magnitude) at decode and prefill sizes, against plain LoRA of the same shape (what
the row factor costs over it), NumPy with the row factor precomputed (the least a NumPy user
must do per call: the LoRA term, then a multiply), and PyTorch doing what PEFT's DoRA forward
does by default (``W + s B A`` and its row norms formed at every call, then the formula).

Bytes / flops: `core.linear_model` plus the factor's read (rows * 4 bytes) and its multiply
(rows * n flops).
"""

from __future__ import annotations

import numpy as np

from ..timing import Impl
from .core import TOL, Built, as64, linear_model, make_delta, pair, rand

DORA_BATCHES = (1, 128)
DORA_SHAPE = (4096, 4096, 16)


def dora_name(batch):
    rows, cols, r = DORA_SHAPE
    return f"dora b{batch} {rows}x{cols} r{r}"


def build_dora(ctx, batch, rows=DORA_SHAPE[0], cols=DORA_SHAPE[1], rank=DORA_SHAPE[2]):
    """ours: ``DoraDelta.add_batch_to`` (float32 storage); plain: ``LoraDelta.add_batch_to`` of
    the same pair; numpy_naive: ``out = g * (out + s * ((x @ A.T) @ B.T))`` with g given;
    peft_dora: PyTorch, PEFT's default DoRA forward (the norm of ``W + s * B @ A`` at every call).
    The magnitude is the norm itself (g = 1 up to rounding), so repeated calls on one out stay
    finite; the multiply is done all the same."""
    lora, torch, rng = ctx.lora, ctx.torch, ctx.rng
    a, b = pair(rng, rows, cols, rank)
    w = rand(rng, (rows, cols), 0.02)
    plain = make_delta(lora, a, b, "float32", rank)
    s = plain.effective_scale
    norm = np.linalg.norm(as64(w) + s * (as64(b) @ as64(a)), axis=1)
    d = lora.DoraDelta(a, b, norm, w, alpha=2.0 * rank)
    g = (norm / norm).astype(np.float32)
    x = rand(rng, (batch, cols), 1.0)

    def zeros():
        return np.zeros((batch, rows), np.float32)

    def naive(o=zeros(), a=a, b=b, s=np.float32(s), x=x, g=g[None, :]):
        o += s * ((x @ a.T) @ b.T)
        o *= g

    impls = {"ours": Impl(d.add_batch_to, x, zeros()), "plain": Impl(plain.add_batch_to, x, zeros()),
             "numpy_naive": Impl(naive)}
    if torch is not None:
        ta, tb, tw = (torch.from_numpy(v) for v in (a, b, w))
        tm, tx = torch.from_numpy(norm.astype(np.float32)), torch.from_numpy(x)

        def peft(o=torch.zeros(batch, rows), ta=ta, tb=tb, tw=tw, tm=tm, tx=tx, s=s):
            with torch.no_grad():
                gt = tm / torch.linalg.norm(tw + s * (tb @ ta), dim=1)
                o.mul_(gt).add_(gt * (tx @ ta.T @ tb.T) * s)

        impls["peft_dora"] = Impl(peft)

    def ours_once():
        o = (x @ w.T).astype(np.float32)
        return d.add_batch_to(x, o)

    def ref_once():
        return (as64(x) @ as64(w).T + s * (as64(x) @ as64(a).T) @ as64(b).T) * (norm / norm)

    nbytes, flops = linear_model(rows, cols, [rank], batch, 4)
    return Built(impls, nbytes + rows * 4, flops + rows * batch, (ours_once, ref_once, TOL["float32"]))
