"""One serving step: a decode step of a batch through an ``AdapterSet`` of bf16 (or q8_0) adapters over
every adapted projection of Llama-2-7B-shaped layers (one bank call per projection), with the
same step at scale 0 as its Python share.  No baselines: nothing else serves many adapters per
call.

Bytes / flops per bank call (u distinct adapters used, batch n): bytes = u*rank*(rows+cols)*w +
n*(cols*4 + rows*4*2) + n*16 (ids and scales), w the bytes per stored value (2; 34/32 for
q8_0); flops = 2*n*rank*(rows+cols).
"""

from __future__ import annotations

import time

import numpy as np

from ..timing import Impl
from .core import TOL, VALUE_BYTES, Built, lora_ref, pair, rand
from .sweep import LLAMA2_7B

SET_ADAPTERS, SET_RANK, SET_BATCH = 8, 16, 8
QUICK_SET_LAYERS = 2  # --quick: the adapter-set step builds 2 of the 32 layers


def set_step_name(layers):
    return f"adapter-set step {layers}L 8x r16 b8"


def build_set_step(ctx, layers, n_adapters=SET_ADAPTERS, rank=SET_RANK, batch=SET_BATCH,
                   dtype="bfloat16"):
    """One decode step of `batch` sequences through an ``AdapterSet`` of `n_adapters` adapters
    (storage `dtype`) over every adapted projection of `layers` Llama-2-7B-shaped layers: one bank
    call per projection (7 per layer), float32 activations, random slot ids and per-position
    float64 scales.  ours: the step; edge: the same step with every adapter's LoraScale at 0
    (the calls check and return: the Python and C-entry share of the step)."""
    lora = ctx.lora
    rng = np.random.default_rng(9)
    t0 = time.perf_counter()
    aset, scales, checked = lora.AdapterSet(), [], []
    for k in range(n_adapters):
        sc = lora.LoraScale(1.0)
        ds = {}
        for layer in range(layers):
            for proj, rows, cols in LLAMA2_7B:
                a, b = pair(rng, rows, cols, rank)
                ds[f"{layer}.{proj}"] = lora.LoraDelta(a, b, alpha=2.0 * rank, scale=sc, dtype=dtype)
                if layer == 0 and proj == "q":
                    checked.append((a, b))
        aset.add(f"adapter{k}", lora.LoraAdapter(ds, name=f"adapter{k}", alpha=2.0 * rank, scale=sc))
        scales.append(sc)
    build_s = time.perf_counter() - t0
    ids = aset.slots([f"adapter{i}" for i in rng.integers(0, n_adapters, size=batch)])
    pos = rng.uniform(0.25, 1.25, size=batch)
    xs = {c: rand(rng, (batch, c), 1.0) for c in (4096, 11008)}
    outs = {r: np.zeros((batch, r), np.float32) for r in (4096, 11008)}
    calls = [(aset.bank(f"{layer}.{proj}").add_batch_to, xs[cols], outs[rows])
             for layer in range(layers) for proj, rows, cols in LLAMA2_7B]

    def step(calls=calls, ids=ids, pos=pos):
        for f, x, o in calls:
            f(x, o, ids, pos)

    def set_scales(v):
        for sc in scales:
            sc.set(v)

    impls = {"ours": Impl(step, before=lambda: set_scales(1.0)),
             "edge": Impl(step, before=lambda: set_scales(0.0))}
    q0 = aset.bank("0.q")
    s = 2.0  # alpha / rank

    def ours_once():  # layer 0's q at scale 1, then at scale 0 (must add nothing)
        res = []
        for v in (1.0, 0.0):
            set_scales(v)
            o = np.zeros((batch, 4096), np.float32)
            q0.add_batch_to(xs[4096], o, ids, pos)
            res.append(o)
        set_scales(1.0)
        return np.concatenate(res)

    def ref_once():
        o = np.zeros((2 * batch, 4096))
        for i, u in enumerate(ids):
            o[i] = lora_ref(*checked[u], s * pos[i], xs[4096][i])
        return o

    used = len(np.unique(ids))
    nbytes = flops = 0
    for _ in range(layers):
        for _, rows, cols in LLAMA2_7B:
            nbytes += int(used * rank * (rows + cols) * VALUE_BYTES[dtype]) + batch * (cols * 4 + rows * 8) + batch * 16
            flops += 2 * batch * rank * (rows + cols)
    info = {"build_s": build_s, "adapter_bytes": aset.resident_bytes, "layers": layers,
            "bank_calls": len(calls), "adapters": n_adapters}
    return Built(impls, nbytes, flops, (ours_once, ref_once, TOL[dtype]), info)
