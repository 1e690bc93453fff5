"""One serving step: a decode step of a batch through an ``AdapterSet`` of bf16 (or q8_0) adapters over
every adapted projection of Llama-2-7B-shaped layers (one bank call per projection), with the
same step at scale 0 as its Python share.  No baselines: nothing else serves many adapters per
call.

Bytes / flops per bank call (u distinct adapters used, batch n): bytes = u*rank*(rows+cols)*w +
n*(cols*4 + rows*4*2) + n*16 (ids and scales), w the bytes per stored value (2; 34/32 for
q8_0); flops = 2*n*rank*(rows+cols).
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..timing import Impl
from .core import TOL, VALUE_BYTES, Built, lora_ref, pair, rand
from .sweep import LLAMA2_7B, LLAMA2_7B_LAYERS, sweep_layer_bytes

SET_ADAPTERS, SET_RANK, SET_BATCH = 8, 16, 8
QUICK_SET_LAYERS = 2  # --quick: the adapter-set step builds 2 of the 32 layers


def set_step_ids(n_adapters=SET_ADAPTERS, batch=SET_BATCH):
    """The slot of each sequence of the step (seeded: the sizing and the build agree on them)."""
    return np.random.default_rng(10).integers(0, n_adapters, size=batch)


def size_set_step(llc_bytes, mem_available, quick=False, n_adapters=SET_ADAPTERS, rank=SET_RANK):
    """Layers of the adapter-set step, sized from the machine so that the step streams its
    adapters from DRAM: the q8_0 factors one step reads (those of the adapters its sequences
    use) are at least twice the last-level cache, never fewer than the model's 32 layers (on a
    32 MiB L3 that is the 8 x 32-layer step, 610 MiB of bfloat16; a VM that reports a 480 MiB L3
    holds a 32-layer q8_0 step whole, and its step would time the kernels on cached data).
    Memory: the bfloat16 set and one layer's float32 sources, kept under half the available
    memory (a cap that is reported).  `quick`: QUICK_SET_LAYERS (the code path, not the numbers)."""
    if quick:
        return QUICK_SET_LAYERS, {"layers": QUICK_SET_LAYERS, "capped_by": "--quick"}
    used = len(np.unique(set_step_ids(n_adapters)))
    q8_step = used * sweep_layer_bytes(rank, VALUE_BYTES["q8_0"])  # one layer, the adapters used
    wanted = max(LLAMA2_7B_LAYERS, math.ceil(2 * llc_bytes / q8_step))
    bf16_set = n_adapters * sweep_layer_bytes(rank, 2)
    cap = int(mem_available / 2 // (1.5 * bf16_set)) if mem_available else None
    layers, capped_by = (cap, "memory") if cap is not None and cap < wanted else (wanted, None)
    layers = max(1, layers)
    return layers, {"layers": layers, "layers_wanted": wanted, "capped_by": capped_by,
                    "adapters_used": used, "q8_0_step_bytes": layers * q8_step,
                    "q8_0_over_llc": layers * q8_step / llc_bytes}


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
    ids = aset.slots([f"adapter{i}" for i in set_step_ids(n_adapters, batch)])
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

    # a reference: the same number of bank calls on layer 0's adapters only (from cache: the
    # step's arithmetic and call overhead, with no DRAM read)
    cached = calls[:len(LLAMA2_7B)] * layers
    impls = {"ours": Impl(step, before=lambda: set_scales(1.0)),
             "edge": Impl(step, before=lambda: set_scales(0.0)),
             "_cached": Impl(step, cached, before=lambda: set_scales(1.0))}
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
            "bank_calls": len(calls), "adapters": n_adapters,
            "cached_working_set_bytes": int(used * sweep_layer_bytes(rank, VALUE_BYTES[dtype]))}
    return Built(impls, nbytes, flops, (ours_once, ref_once, TOL[dtype]), info)
