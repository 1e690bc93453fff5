"""The model sweep: one decode token through every adapted projection of a Llama-2-7B-shaped
model (``add_to`` per projection), as many layers as make its adapters stream from DRAM.

Bytes: its deltas' factors, which is what a token reads from memory (x and out, one vector per
width, stay in cache across the sweep's calls, so `core.linear_model`'s x and out bytes are left
out: about 10 % more in float32, 19 % in half precision).  Flops: the sum over its deltas of the
decode model (`core.linear_model`).  Baselines:
`baselines` (NumPy naive and tuned in float32, PyTorch in the row's storage dtype); references,
measured alongside: the DRAM read bandwidth right now, a read of as many bytes as the sweep
moves (its roof), and a read of the deltas' own storage, delta by delta, on the whole team (what
the memory system gives regions of that size one call at a time, with no arithmetic), and
the same calls on the first layer's deltas only (from cache: the sweep's arithmetic alone).
"""

from __future__ import annotations

import math

import numpy as np

from ..machine import make_deltas_reader, make_reader
from ..timing import Impl
from .baselines import numpy_naive, numpy_tuned, torch_baseline
from .core import TOL, VALUE_BYTES, Built, linear_model, lora_ref, make_delta, pair, rand, scale_of, torch_dtype

LLAMA2_7B = (("q", 4096, 4096), ("k", 4096, 4096), ("v", 4096, 4096), ("o", 4096, 4096),
             ("gate", 11008, 4096), ("up", 11008, 4096), ("down", 4096, 11008))
LLAMA2_7B_LAYERS = 32
SWEEP_RANK = 16
QUICK_SWEEP_F32_BYTES = 256 << 20  # --quick: a CI smoke run streams at most this much per token


def sweep_name(layers):
    return f"sweep llama2-7b {layers}L r{SWEEP_RANK}"


def sweep_layer_bytes(rank, w):
    """Adapter bytes of one layer of the sweep, A and B stored with w bytes per value."""
    return int(sum(rank * (rows + cols) * w for _, rows, cols in LLAMA2_7B))


def size_sweep(llc_bytes, mem_available, forced=None, quick=False, rank=SWEEP_RANK):
    """Layers of the model sweep, sized from the machine so that it measures DRAM.

    Its q8_0 adapters (the smallest of its rows: 34 bytes per 32 values) are at least twice the
    last-level cache, so a token finds none of them left in cache from the previous one; never
    fewer than the model's 32 layers.  Memory: the float32 row holds the source arrays, our
    copies, a read buffer of the same size, and the baselines' factors transposed once (NumPy's
    and torch's: three more), and the DRAM bandwidth buffer is alive too: about 7x the float32
    adapters, kept under half the available memory (a cap that is reported).
    `quick` caps the float32 adapters at QUICK_SWEEP_F32_BYTES (on a large-cache machine the
    quick sweep then stays in cache, and its DRAM targets say so instead of judging it);
    `forced` (--sweep-layers) overrides the result.  Both are reported.
    """
    half, f32 = sweep_layer_bytes(rank, 2), sweep_layer_bytes(rank, 4)
    q8 = sweep_layer_bytes(rank, VALUE_BYTES["q8_0"])
    wanted = max(LLAMA2_7B_LAYERS, math.ceil(2 * llc_bytes / q8))
    caps = {"memory": int(mem_available / 2 // (7 * f32)) if mem_available else None,
            "--quick": QUICK_SWEEP_F32_BYTES // f32 if quick else None}
    caps = {k: v for k, v in caps.items() if v is not None and v < wanted}
    cap_by = min(caps, key=caps.get) if caps else None
    layers = max(1, caps[cap_by]) if cap_by else wanted
    if forced:
        layers, cap_by = forced, "--sweep-layers"
    return layers, {"llc_bytes": llc_bytes, "layers_wanted": wanted, "capped_by": cap_by,
                    "layers": layers, "adapter_bytes": {"float32": layers * f32, "half": layers * half,
                                                        "q8_0": layers * q8},
                    "half_over_llc": layers * half / llc_bytes, "q8_0_over_llc": layers * q8 / llc_bytes}


def sweep_pairs(ctx, layers, rank):
    """The float32 adapters of the sweep, shared by its float32/f16/bf16 rows (cached)."""
    key = ("sweep", layers, rank)
    if key not in ctx.cache:
        rng = np.random.default_rng(7)
        ctx.cache[key] = [(rows, cols, *pair(rng, rows, cols, rank))
                          for _ in range(layers) for _, rows, cols in LLAMA2_7B]
    return ctx.cache[key]


def build_sweep(ctx, layers, rank, dtype):
    """One decode token through every adapted projection of a Llama-2-7B-shaped model."""
    lora, torch = ctx.lora, ctx.torch
    pairs = sweep_pairs(ctx, layers, rank)
    rng = np.random.default_rng(8)
    xs = {c: rand(rng, (c,), 1.0) for c in (4096, 11008)}

    def outs():
        return {r: np.zeros(r, np.float32) for r in (4096, 11008)}

    deltas = [make_delta(lora, a, b, dtype, rank) for _, _, a, b in pairs]
    s = scale_of(deltas[0])
    o_ours = outs()
    calls = [(d.add_to, xs[cols], o_ours[rows]) for d, (rows, cols, _, _) in zip(deltas, pairs)]

    def ours(calls=calls):
        for f, x, o in calls:
            f(x, o)

    nbytes = layers * sweep_layer_bytes(rank, VALUE_BYTES[dtype])  # the factors only
    flops = sum(linear_model(rows, cols, [rank], 1, 4)[1] for rows, cols, _, _ in pairs)
    impls = {"ours": Impl(ours)}
    if ctx.dram_reader is not None:  # references, not baselines, measured alongside the sweep:
        impls["_dram_read"] = ctx.dram_reader  # DRAM read bandwidth right now (the target's)
        # and a read of as many bytes as the sweep moves (its roof: part of them may stay in L3)
        impls["_same_size_read"] = make_reader(np.ones(nbytes // 4 // 64 * 64, np.float32), ctx.threads)
        # and a read of our deltas' own storage, delta by delta as the calls meet it: what the
        # memory system gives these regions of a few hundred KiB each (no arithmetic at all)
        impls["_deltas_read"] = make_deltas_reader(deltas, ctx.threads)
    # and the same number of calls on the first layer's deltas only (from cache: the sweep's
    # arithmetic and call overhead, with no DRAM read; what no prefetching could go below)
    impls["_cached"] = Impl(ours, calls[:len(LLAMA2_7B)] * layers)
    if dtype == "float32":
        o_n, o_t = outs(), outs()
        impls["numpy_naive"] = numpy_naive([(a, b, s, xs[cols], o_n[rows]) for rows, cols, a, b in pairs])
        impls.update(numpy_tuned([(a, b, s, xs[cols], o_t[rows]) for rows, cols, a, b in pairs]))
    if torch is not None and torch_dtype(torch, dtype) is not None:
        xt = {c: torch.from_numpy(v) for c, v in xs.items()}
        ot = {r: torch.from_numpy(v) for r, v in outs().items()}
        impls.update(torch_baseline(torch, [(a, b, s, xt[cols], ot[rows]) for rows, cols, a, b in pairs],
                                    torch_dtype(torch, dtype)))

    def ours_once():  # the first layer's seven projections, into one concatenated output
        res = []
        for d, (rows, cols, _, _) in list(zip(deltas, pairs))[:7]:
            o = np.zeros(rows, np.float32)
            d.add_to(xs[cols], o)
            res.append(o)
        return np.concatenate(res)

    def ref_once():
        return np.concatenate([lora_ref(a, b, s, xs[cols]) for rows, cols, a, b in pairs[:7]])

    return Built(impls, nbytes, flops, (ours_once, ref_once, TOL[dtype]),
                 {"cached_working_set_bytes": sweep_layer_bytes(rank, VALUE_BYTES[dtype])})
