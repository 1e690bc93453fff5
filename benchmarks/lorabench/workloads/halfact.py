"""bfloat16 activations: bf16 adapters applied to bf16 x and out, as NumPy arrays (ml_dtypes) or
CPU torch tensors, against PyTorch doing the same in bf16, PEFT's float32 upcast, and our own
call with float32 x and out (the float32 twin is the decode / prefill row of the same shape).

Bytes / flops: bytes = rank*(rows+cols)*2 + n*cols*2 (x) + n*rows*2*2 (out, read and written);
flops as `core.linear_model`.
"""

from __future__ import annotations

import numpy as np

from ..timing import Impl
from .baselines import torch_baseline
from .core import TOL, Built, Skip, act_pair, as64, linear_model, lora_ref, make_delta, pair, rand, scale_of
from .linear import decode_name, prefill_name

HALF_ACT_BATCHES = (None, 128, 512)  # None: decode (add_to)
HALF_ACT_KINDS = ("ndarray", "tensor")


def halfact_name(batch, kind):
    """bf16 activations: kind "ndarray" (NumPy, ml_dtypes) or "tensor" (torch)."""
    return f"{decode_name(4096, 4096, 16) if batch is None else prefill_name(batch)} x/out {kind}"


def build_halfact(ctx, batch, kind, rows=4096, cols=4096, rank=16):
    """bf16 adapters applied to bf16 activations (x and out), NumPy arrays or torch tensors
    (`kind`), against

    * torch: PyTorch doing the same job in bf16 by hand (`baselines.torch_baseline` on bf16
      factors, x and out: ``torch.matmul(out=)`` then ``out.addmv_/addmm_(..., alpha=s)``; the
      rank-sized intermediate is rounded to bf16, as torch does);
    * peft: PEFT's default (adapters upcast to float32; `baselines.torch_baseline` on float32
      factors): ``x.float()`` into a buffer, float32 matmuls, ``out.add_(z, alpha=s)`` rounding
      once into the bf16 out;
    * ours_f32act: our own call on the same delta with float32 x and out (NumPy).
    """
    lora, torch, rng = ctx.lora, ctx.torch, ctx.rng
    if kind == "tensor" and torch is None:
        raise Skip("torch tensors: torch is not importable (or --no-torch)")
    a, b = pair(rng, rows, cols, rank)
    d = make_delta(lora, a, b, "bfloat16", rank)
    s = scale_of(d)
    n = 1 if batch is None else batch
    xshape = (cols,) if batch is None else (batch, cols)
    oshape = (rows,) if batch is None else (batch, rows)
    x32 = rand(rng, xshape, 1.0)
    x, out = act_pair(torch, x32, oshape, "bfloat16", kind)
    method = d.add_to if batch is None else d.add_batch_to
    impls = {"ours": Impl(method, x, out),
             "ours_f32act": Impl(method, x32, np.zeros(oshape, np.float32))}
    if torch is not None:
        bf = torch.bfloat16
        xt = torch.from_numpy(x32).to(bf)
        impls.update(torch_baseline(torch, [(a, b, s, xt, torch.zeros(oshape, dtype=bf))], bf))
        # PEFT's upcast: its own formulation (F.linear on the factors as stored), not tuned
        impls["peft"] = torch_baseline(torch, [(a, b, s, xt, torch.zeros(oshape, dtype=bf))], torch.float32,
                                       "peft")["peft:views"]

    def ours_once():
        o = act_pair(torch, x32, oshape, "bfloat16", kind)[1]
        method(x, o)
        return as64(o)

    def ref_once():
        return lora_ref(a, b, s, x)

    nbytes = rank * (rows + cols) * 2 + n * cols * 2 + n * rows * 2 * 2
    _, flops = linear_model(rows, cols, [rank], n, 2)
    return Built(impls, nbytes, flops, (ours_once, ref_once, TOL["bfloat16"]))
