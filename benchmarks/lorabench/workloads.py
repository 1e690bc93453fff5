"""The workloads: what each one computes through the library and through the baselines, its
bytes / flops model, and the per-row analysis (GB/s, GFLOP/s, roofline, speedups).

Bytes / flops model (compulsory traffic of one call; ``w`` = storage itemsize of A and B,
4 for float32, 2 for float16 / bfloat16; activations and outputs are float32):

* linear, ``add_to`` / ``add_batch_to`` (batch ``n``, 1 for decode):
  bytes = rank*(rows+cols)*w  +  n*cols*4 (read x)  +  n*rows*4*2 (read and write out);
  flops = 2*n*rank*(rows+cols)  (A@x, then B@y; the scale is O(n*rank) and not counted).
* stack of k deltas: the sum of the k adapters' bytes and flops, x and out counted once.
* token rows, ``add_row_to`` (n=1) / ``add_rows_to`` (n ids, u of them distinct):
  bytes = rank*cols*w (A) + u*rank*w (rows of B) + n*cols*4*2 (out) + n*8 (ids);
  flops = 2*n*rank*cols.
* model sweep: the sum over its deltas of the decode model.
* mixed batch (``LoraBank``), m positions with an adapter (id != -1), u distinct adapters used:
  bytes = sum over used adapters of rank*(rows+cols)*w + m*(cols*4 + rows*4*2) + n*8 (ids);
  flops = 2*m*rank*(rows+cols).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from . import startup
from .machine import level_for, make_reader
from .timing import Impl, measure, summarize


class Skip(Exception):
    """A workload this build or environment cannot run (not an error)."""


@dataclass
class Built:
    impls: dict  # name -> Impl; "ours" first
    bytes: int
    flops: int
    check: tuple = None  # (ours_fn, reference_fn, tolerance): each returns a fresh result array
    info: dict = None  # extra facts for the report (merged into the row's result)
    timing: dict = None  # TimingConfig fields this row sets for itself (e.g. more, shorter rounds)


@dataclass(eq=False)
class Workload:
    name: str
    group: str
    dtype: str
    build: object  # ctx -> Built; or, with `run`, None
    key: str = ""  # shape key shared by the float32 twin of a half-precision row
    result: dict = field(default_factory=dict)
    run: object = None  # (ctx, cfg, status, monitor) -> result dict: rows not timed by timing.measure


def _rand(rng, shape, amp):
    a = rng.random(shape, dtype=np.float32)
    a -= 0.5
    a *= 2 * amp
    return a


def _pair(rng, rows, cols, rank):
    """A [rank, cols], B [rows, rank] with values of realistic size (|A x| ~ 1, |delta| ~ 1e-2)."""
    return _rand(rng, (rank, cols), 1.7 / math.sqrt(cols)), _rand(rng, (rows, rank), 0.02)


def _half_torch(torch, dtype):
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def _make_delta(lora, a, b, dtype, rank):
    """A LoraDelta with effective scale 2 (alpha = 2*rank); Skip if this build lacks the dtype."""
    try:
        d = lora.LoraDelta(a, b, alpha=2.0 * rank, dtype=dtype)
    except (TypeError, ValueError, NotImplementedError) as e:
        if dtype != "float32":
            raise Skip(f"LoraDelta(dtype={dtype!r}) not supported by this build: {e}") from None
        raise
    return d


def _scale_of(d, rank):
    s = getattr(d, "effective_scale", None)
    return float(s) if s is not None else 2.0


def linear_model(rows, cols, ranks, n, w):
    nbytes = sum(r * (rows + cols) * w for r in ranks) + n * cols * 4 + n * rows * 8
    flops = sum(2 * n * r * (rows + cols) for r in ranks)
    return nbytes, flops


def numpy_decode_naive(calls):
    """NumPy naive decode of (A, B, s, x, out) calls: out += s * (B @ (A @ x))."""
    for a, b, s, x, o in calls:
        o += s * (b @ (a @ x))


def numpy_decode_tuned(calls, mm=np.matmul, add=np.add, mul=np.multiply):
    """NumPy tuned decode of (A, B, s, x, out, y, z) calls, y and z preallocated."""
    for a, b, s, x, o, y, z in calls:
        mm(a, x, out=y)
        mul(y, s, out=y)
        mm(b, y, out=z)
        add(o, z, out=o)


def build_linear(ctx, rows, cols, ranks, batch, dtype):
    """decode (batch None: add_to on 1-D), prefill (add_batch_to) and stacks (len(ranks) > 1)."""
    lora, torch, rng = ctx.lora, ctx.torch, ctx.rng
    pairs = [_pair(rng, rows, cols, r) for r in ranks]
    deltas = [_make_delta(lora, a, b, dtype, r) for (a, b), r in zip(pairs, ranks)]
    ours = deltas[0] if len(deltas) == 1 else lora.LoraStack(deltas)
    scales = [_scale_of(d, r) for d, r in zip(deltas, ranks)]
    n = 1 if batch is None else batch
    xshape = (cols,) if batch is None else (batch, cols)
    oshape = (rows,) if batch is None else (batch, rows)
    x = _rand(rng, xshape, 1.0)

    def zeros():
        return np.zeros(oshape, np.float32)

    out = zeros()
    method = ours.add_to if batch is None else ours.add_batch_to
    impls = {"ours": Impl(method, x, out)}
    mm, add, mul = np.matmul, np.add, np.multiply
    trip = [(a, b, s) for (a, b), s in zip(pairs, scales)]

    if dtype == "float32":
        o_naive, o_tuned = zeros(), zeros()
        if batch is None:
            impls["numpy_naive"] = Impl(numpy_decode_naive, [(a, b, s, x, o_naive) for a, b, s in trip])
            impls["numpy_tuned"] = Impl(numpy_decode_tuned, [
                (a, b, s, x, o_tuned, np.empty(a.shape[0], np.float32), np.empty(rows, np.float32))
                for a, b, s in trip])
        else:
            def naive(o=o_naive, x=x, trip=trip):
                for a, b, s in trip:
                    o += s * ((x @ a.T) @ b.T)

            bufs = [(a.T, b.T, s, np.empty((batch, a.shape[0]), np.float32), np.empty(oshape, np.float32))
                    for a, b, s in trip]

            def tuned(o=o_tuned, x=x, bufs=bufs, mm=mm, add=add, mul=mul):
                for at, bt, s, y, z in bufs:
                    mm(x, at, out=y)
                    mul(y, s, out=y)
                    mm(y, bt, out=z)
                    add(o, z, out=o)

            impls["numpy_naive"] = Impl(naive)
            impls["numpy_tuned"] = Impl(tuned)

    if torch is not None:
        o_t = torch.from_numpy(zeros())
        x_t = torch.from_numpy(x)
        tm = torch.matmul
        if dtype == "float32":
            if batch is None:
                tb = [(torch.from_numpy(a), torch.from_numpy(b), s, torch.empty(a.shape[0])) for a, b, s in trip]

                def torch_fn(o=o_t, x=x_t, tb=tb, tm=tm):
                    for a, b, s, y in tb:
                        tm(a, x, out=y)
                        o.addmv_(b, y, alpha=s)
            else:
                tb = [(torch.from_numpy(a).T, torch.from_numpy(b).T, s, torch.empty(batch, a.shape[0]))
                      for a, b, s in trip]

                def torch_fn(o=o_t, x=x_t, tb=tb, tm=tm):
                    for at, bt, s, y in tb:
                        tm(x, at, out=y)
                        o.addmm_(y, bt, alpha=s)
        else:
            hd = _half_torch(torch, dtype)
            xh = torch.empty(xshape, dtype=hd)
            if batch is None:
                tb = [(torch.from_numpy(a).to(hd), torch.from_numpy(b).to(hd), s,
                       torch.empty(a.shape[0], dtype=hd), torch.empty(rows, dtype=hd)) for a, b, s in trip]

                def torch_fn(o=o_t, x=x_t, xh=xh, tb=tb, tm=tm):
                    xh.copy_(x)
                    for a, b, s, y, z in tb:
                        tm(a, xh, out=y)
                        tm(b, y, out=z)
                        o.add_(z, alpha=s)
            else:
                tb = [(torch.from_numpy(a).to(hd).T, torch.from_numpy(b).to(hd).T, s,
                       torch.empty(batch, a.shape[0], dtype=hd), torch.empty(oshape, dtype=hd))
                      for a, b, s in trip]

                def torch_fn(o=o_t, x=x_t, xh=xh, tb=tb, tm=tm):
                    xh.copy_(x)
                    for at, bt, s, y, z in tb:
                        tm(xh, at, out=y)
                        tm(y, bt, out=z)
                        o.add_(z, alpha=s)

        impls["torch"] = Impl(torch_fn)

    def ours_once():
        o = zeros()
        method(x, o)
        return o

    def ref_once():
        o = np.zeros(oshape, np.float64)
        x64 = x.astype(np.float64)
        for a, b, s in trip:
            if batch is None:
                o += s * (b.astype(np.float64) @ (a.astype(np.float64) @ x64))
            else:
                o += s * ((x64 @ a.T.astype(np.float64)) @ b.T.astype(np.float64))
        return o

    w = 4 if dtype == "float32" else 2
    nbytes, flops = linear_model(rows, cols, ranks, n, w)
    return Built(impls, nbytes, flops, (ours_once, ref_once, _TOL[dtype]))


# relative-norm tolerance of the sanity check against float64 (half storage rounds A and B)
_TOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


def build_gather(ctx, vocab, dim, rank, n):
    """Token-embedding deltas: add_row_to (n == 1) or add_rows_to (n ids)."""
    lora, torch, rng = ctx.lora, ctx.torch, ctx.rng
    a, b = _pair(rng, vocab, dim, rank)  # A [rank, dim], B [vocab, rank]: row t of s B A
    d = _make_delta(lora, a, b, "float32", rank)
    s = _scale_of(d, rank)
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
    if n == 1:
        def naive(o=zeros(), a=a, b=b, r=r, s=s):
            o += s * (b[r] @ a)

        g, z = np.empty(rank, np.float32), np.empty(dim, np.float32)

        def tuned(o=zeros(), a=a, b=b, r=r, s=s, g=g, z=z):
            mul(b[r], s, out=g)
            mm(g, a, out=z)
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
    impls["numpy_naive"] = Impl(naive)
    impls["numpy_tuned"] = Impl(tuned)
    if torch is not None:
        a_t, b_t = torch.from_numpy(a), torch.from_numpy(b)
        if n == 1:
            def torch_fn(o=torch.from_numpy(zeros()), at=a_t.T, b=b_t, r=r, s=s):
                o.addmv_(at, b[r], alpha=s)
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
    return Built(impls, nbytes, 2 * n * rank * dim, (ours_once, ref_once, _TOL["float32"]))


LLAMA2_7B = (("q", 4096, 4096), ("k", 4096, 4096), ("v", 4096, 4096), ("o", 4096, 4096),
             ("gate", 11008, 4096), ("up", 11008, 4096), ("down", 4096, 11008))
LLAMA2_7B_LAYERS = 32
SWEEP_RANK = 16


def sweep_layer_bytes(rank, w):
    """Adapter bytes of one layer of the sweep, A and B stored with itemsize w."""
    return sum(rank * (rows + cols) * w for _, rows, cols in LLAMA2_7B)


QUICK_SWEEP_F32_BYTES = 256 << 20  # --quick: a CI smoke run streams at most this much per token


def size_sweep(llc_bytes, mem_available, forced=None, quick=False, rank=SWEEP_RANK):
    """Layers of the model sweep, sized from the machine so that it measures DRAM.

    Its half-precision adapters (the smallest of its three rows) are at least twice the
    last-level cache, so a token finds none of them left in cache from the previous one; never
    fewer than the model's 32 layers.  Memory: the float32 row holds the source arrays, our
    copies and a read buffer of the same size, and the DRAM bandwidth buffer is alive too: about
    4x the float32 adapters, kept under half the available memory (a cap that is reported).
    `quick` caps the float32 adapters at QUICK_SWEEP_F32_BYTES (on a large-cache machine the
    quick sweep then stays in cache, and its DRAM targets say so instead of judging it);
    `forced` (--sweep-layers) overrides the result.  Both are reported.
    """
    half, f32 = sweep_layer_bytes(rank, 2), sweep_layer_bytes(rank, 4)
    wanted = max(LLAMA2_7B_LAYERS, math.ceil(2 * llc_bytes / half))
    caps = {"memory": int(mem_available / 2 // (4 * f32)) if mem_available else None,
            "--quick": QUICK_SWEEP_F32_BYTES // f32 if quick else None}
    caps = {k: v for k, v in caps.items() if v is not None and v < wanted}
    cap_by = min(caps, key=caps.get) if caps else None
    layers = max(1, caps[cap_by]) if cap_by else wanted
    if forced:
        layers, cap_by = forced, "--sweep-layers"
    return layers, {"llc_bytes": llc_bytes, "layers_wanted": wanted, "capped_by": cap_by,
                    "layers": layers, "adapter_bytes": {"float32": layers * f32, "half": layers * half},
                    "half_over_llc": layers * half / llc_bytes}


def sweep_pairs(ctx, layers, rank):
    """The float32 adapters of the sweep, shared by its float32/f16/bf16 rows (cached)."""
    key = ("sweep", layers, rank)
    if key not in ctx.cache:
        rng = np.random.default_rng(7)
        ctx.cache[key] = [(rows, cols, *_pair(rng, rows, cols, rank))
                          for _ in range(layers) for _, rows, cols in LLAMA2_7B]
    return ctx.cache[key]


def build_sweep(ctx, layers, rank, dtype):
    """One decode token through every adapted projection of a Llama-2-7B-shaped model."""
    lora, torch = ctx.lora, ctx.torch
    pairs = sweep_pairs(ctx, layers, rank)
    rng = np.random.default_rng(8)
    xs = {c: _rand(rng, (c,), 1.0) for c in (4096, 11008)}

    def outs():
        return {r: np.zeros(r, np.float32) for r in (4096, 11008)}

    deltas = [_make_delta(lora, a, b, dtype, rank) for _, _, a, b in pairs]
    s = _scale_of(deltas[0], rank)
    o_ours = outs()
    calls = [(d.add_to, xs[cols], o_ours[rows]) for d, (rows, cols, _, _) in zip(deltas, pairs)]

    def ours(calls=calls):
        for f, x, o in calls:
            f(x, o)

    w = 4 if dtype == "float32" else 2
    nbytes = flops = 0
    for rows, cols, _, _ in pairs:
        b_, f_ = linear_model(rows, cols, [rank], 1, w)
        nbytes, flops = nbytes + b_, flops + f_
    impls = {"ours": Impl(ours)}
    if ctx.dram_reader is not None:  # references, not baselines, measured alongside the sweep:
        impls["_dram_read"] = ctx.dram_reader  # DRAM read bandwidth right now (the target's)
        # and a read of as many bytes as the sweep moves (its roof: part of them may stay in L3)
        impls["_same_size_read"] = make_reader(np.ones(nbytes // 4 // 64 * 64, np.float32), ctx.threads)
    if dtype == "float32":
        o_n, o_t = outs(), outs()
        y, zs = np.empty(rank, np.float32), {r: np.empty(r, np.float32) for r in (4096, 11008)}
        impls["numpy_naive"] = Impl(numpy_decode_naive, [(a, b, s, xs[cols], o_n[rows]) for rows, cols, a, b in pairs])
        impls["numpy_tuned"] = Impl(numpy_decode_tuned, [(a, b, s, xs[cols], o_t[rows], y, zs[rows])
                                                          for rows, cols, a, b in pairs])
    if torch is not None:
        xt = {c: torch.from_numpy(v) for c, v in xs.items()}
        ot = {r: torch.from_numpy(v) for r, v in outs().items()}
        tm = torch.matmul
        if dtype == "float32":
            y = torch.empty(rank)
            tcalls = [(torch.from_numpy(a), torch.from_numpy(b), xt[cols], ot[rows]) for rows, cols, a, b in pairs]

            def torch_fn(calls=tcalls, s=s, y=y, tm=tm):
                for a, b, x, o in calls:
                    tm(a, x, out=y)
                    o.addmv_(b, y, alpha=s)
        else:
            hd = _half_torch(torch, dtype)
            xh = {c: torch.empty(c, dtype=hd) for c in xs}
            y = torch.empty(rank, dtype=hd)
            zh = {r: torch.empty(r, dtype=hd) for r in ot}
            tcalls = [(torch.from_numpy(a).to(hd), torch.from_numpy(b).to(hd), xh[cols], ot[rows], zh[rows])
                      for rows, cols, a, b in pairs]
            pairs_x = [(xh[c], xt[c]) for c in xs]

            def torch_fn(calls=tcalls, s=s, y=y, tm=tm, pairs_x=pairs_x):
                for h, f in pairs_x:  # the two activations, converted once per token
                    h.copy_(f)
                for a, b, x, o, z in calls:
                    tm(a, x, out=y)
                    tm(b, y, out=z)
                    o.add_(z, alpha=s)
        impls["torch"] = Impl(torch_fn)

    def ours_once():  # the first layer's seven projections, into one concatenated output
        res = []
        for d, (rows, cols, _, _) in list(zip(deltas, pairs))[:7]:
            o = np.zeros(rows, np.float32)
            d.add_to(xs[cols], o)
            res.append(o)
        return np.concatenate(res)

    def ref_once():
        return np.concatenate([s * (b.astype(np.float64) @ (a.astype(np.float64) @ xs[cols]))
                               for rows, cols, a, b in pairs[:7]])

    return Built(impls, nbytes, flops, (ours_once, ref_once, _TOL[dtype]))


def build_bank(ctx, n_adapters, rows, cols, rank, batch, scaled=False):
    """Mixed batch: position b gets adapter ids[b], vs grouping and gather+einsum.

    Unscaled rows draw ids from [-1, n) (-1: no adapter).  `scaled` rows give every position an
    adapter (ids from [0, n)) and a per-position scale (float64, uniform in [0.25, 1.25)) that
    every implementation applies per row; at batch 1 they are also timed against a
    single-adapter ``add_to`` (``single_add_to``)."""
    lora, torch = ctx.lora, ctx.torch
    if not hasattr(lora, "LoraBank"):
        raise Skip("lora.LoraBank not in this build")
    rng = ctx.rng
    pairs = [_pair(rng, rows, cols, rank) for _ in range(n_adapters)]
    deltas = [_make_delta(lora, a, b, "float32", rank) for a, b in pairs]
    s = _scale_of(deltas[0], rank)
    bank = lora.LoraBank(deltas)
    ids = rng.integers(0 if scaled else -1, n_adapters, size=batch, dtype=np.int64)
    pos = rng.uniform(0.25, 1.25, size=batch) if scaled else None
    pos_args = (pos,) if scaled else ()
    x = _rand(rng, (batch, cols), 1.0)

    def zeros():
        return np.zeros((batch, rows), np.float32)

    impls = {"ours": Impl(bank.add_batch_to, x, zeros(), ids, *pos_args),
             "single": Impl(deltas[0].add_batch_to, x, zeros())}
    if scaled and batch == 1:
        impls["single_add_to"] = Impl(deltas[0].add_to, x[0], np.zeros(rows, np.float32))

    if scaled:
        def numpy_group(x=x, o=zeros(), ids=ids, pos=pos, pairs=pairs, s=s):
            for u in np.unique(ids):
                idx = np.flatnonzero(ids == u)
                a, b = pairs[u]
                y = x[idx] @ a.T
                y *= (s * pos[idx]).astype(np.float32)[:, None]  # the per-row scales, rank-sized
                o[idx] += y @ b.T
    else:
        def numpy_group(x=x, o=zeros(), ids=ids, pairs=pairs, s=s):
            for u in np.unique(ids):
                if u < 0:
                    continue
                idx = np.flatnonzero(ids == u)
                a, b = pairs[u]
                o[idx] += s * ((x[idx] @ a.T) @ b.T)

    impls["numpy_group"] = Impl(numpy_group)
    if torch is not None:
        # vLLM's CPU LoRA path (lora/ops/torch_ops): gather each token's adapter, then einsum;
        # slot n_adapters is all zeros and stands for -1.
        a_all = torch.stack([torch.from_numpy(a) for a, _ in pairs] + [torch.zeros(rank, cols)])
        b_all = torch.stack([torch.from_numpy(b) for _, b in pairs] + [torch.zeros(rows, rank)])
        ids_t, x_t = torch.from_numpy(ids), torch.from_numpy(x)
        pos_t = torch.from_numpy(pos) if scaled else None  # float64, as the caller hands it over

        def gather_einsum(x=x_t, o=torch.from_numpy(zeros()), ids=ids_t, pos=pos_t, a_all=a_all, b_all=b_all,
                          s=s):
            slot = torch.where(ids < 0, n_adapters, ids)
            y = torch.einsum("bc,brc->br", x, a_all[slot])
            if pos is not None:
                y *= pos.to(y.dtype).unsqueeze(1)
            o.add_(torch.einsum("br,bor->bo", y, b_all[slot]), alpha=s)

        tp = [(torch.from_numpy(a).T, torch.from_numpy(b).T) for a, b in pairs]

        def torch_group(x=x_t, o=torch.from_numpy(zeros()), ids=ids_t, pos=pos_t, tp=tp, s=s):
            # PEFT's mixed-batch forward: one sub-batch per adapter
            for u in torch.unique(ids).tolist():
                if u < 0:
                    continue
                idx = torch.nonzero(ids == u).squeeze(1)
                at, bt = tp[u]
                y = x[idx] @ at
                if pos is not None:
                    y *= pos[idx].to(y.dtype).unsqueeze(1)
                o.index_add_(0, idx, y @ bt, alpha=s)

        impls["gather_einsum"] = Impl(gather_einsum)
        impls["torch_group"] = Impl(torch_group)
    else:
        a_all = np.stack([a for a, _ in pairs] + [np.zeros((rank, cols), np.float32)])
        b_all = np.stack([b for _, b in pairs] + [np.zeros((rows, rank), np.float32)])

        def gather_einsum(x=x, o=zeros(), ids=ids, pos=pos, a_all=a_all, b_all=b_all, s=s):
            slot = np.where(ids < 0, n_adapters, ids)
            y = np.einsum("bc,brc->br", x, a_all[slot])
            if pos is not None:
                y *= pos.astype(np.float32)[:, None]
            o += s * np.einsum("br,bor->bo", y, b_all[slot])

        impls["gather_einsum"] = Impl(gather_einsum)

    def ours_once():
        o = zeros()
        bank.add_batch_to(x, o, ids, *pos_args)
        return o

    def ref_once():
        o = np.zeros((batch, rows), np.float64)
        for i, u in enumerate(ids):
            if u >= 0:
                a, b = pairs[u]
                si = s * (pos[i] if scaled else 1.0)
                o[i] = si * (b.astype(np.float64) @ (a.astype(np.float64) @ x[i]))
        return o

    used = [u for u in np.unique(ids) if u >= 0]
    m = int(np.count_nonzero(ids >= 0))
    nbytes = len(used) * rank * (rows + cols) * 4 + m * (cols * 4 + rows * 8) + batch * (16 if scaled else 8)
    return Built(impls, nbytes, 2 * m * rank * (rows + cols), (ours_once, ref_once, _TOL["float32"]))


def _bf16():
    import ml_dtypes  # a dependency of lora

    return np.dtype(ml_dtypes.bfloat16)


def _act_pair(torch, x32, oshape, act, kind):
    """x and a zero out of dtype `act` ("float32" | "bfloat16"), as NumPy arrays (bfloat16 from
    ml_dtypes) or, kind "tensor", CPU torch tensors (rounded to nearest even either way)."""
    if kind == "tensor":
        td = torch.float32 if act == "float32" else torch.bfloat16
        return torch.from_numpy(x32).to(td), torch.zeros(oshape, dtype=td)
    nd = np.dtype(np.float32) if act == "float32" else _bf16()
    return x32.astype(nd), np.zeros(oshape, nd)


def _as64(a):
    return a.double().numpy() if hasattr(a, "double") else np.asarray(a, np.float64)


def build_halfact(ctx, batch, kind, rows=4096, cols=4096, rank=16):
    """bf16 adapters applied to bf16 activations (x and out), NumPy arrays or torch tensors
    (`kind`), against

    * torch: PyTorch doing the same job in bf16 by hand, preallocated: ``torch.mv/mm(out=)``
      then ``out.addmv_/addmm_(..., alpha=s)`` on bf16 tensors (the rank-sized intermediate is
      rounded to bf16, as torch does);
    * peft: PEFT's default (adapters upcast to float32): ``x.float()`` into a buffer, float32
      matmuls, ``out.add_(z, alpha=s)`` rounding once into the bf16 out;
    * ours_f32act: our own call on the same delta with float32 x and out (NumPy).
    """
    lora, torch, rng = ctx.lora, ctx.torch, ctx.rng
    if kind == "tensor" and torch is None:
        raise Skip("torch tensors: torch is not importable (or --no-torch)")
    a, b = _pair(rng, rows, cols, rank)
    d = _make_delta(lora, a, b, "bfloat16", rank)
    s = _scale_of(d, rank)
    n = 1 if batch is None else batch
    xshape = (cols,) if batch is None else (batch, cols)
    oshape = (rows,) if batch is None else (batch, rows)
    x32 = _rand(rng, xshape, 1.0)
    x, out = _act_pair(torch, x32, oshape, "bfloat16", kind)
    method = d.add_to if batch is None else d.add_batch_to
    impls = {"ours": Impl(method, x, out),
             "ours_f32act": Impl(method, x32, np.zeros(oshape, np.float32))}
    if torch is not None:
        bf = torch.bfloat16
        xt = torch.from_numpy(x32).to(bf)
        ah, bh = torch.from_numpy(a).to(bf), torch.from_numpy(b).to(bf)
        af, bf32 = torch.from_numpy(a), torch.from_numpy(b)
        xf, zf = torch.empty(xshape), torch.empty(oshape)
        if batch is None:
            def torch_fn(o=torch.zeros(oshape, dtype=bf), x=xt, a=ah, b=bh, s=s, y=torch.empty(rank, dtype=bf),
                         mv=torch.mv):
                mv(a, x, out=y)
                o.addmv_(b, y, alpha=s)

            def peft_fn(o=torch.zeros(oshape, dtype=bf), x=xt, a=af, b=bf32, s=s, xf=xf, y=torch.empty(rank),
                        z=zf, mv=torch.mv):
                xf.copy_(x)  # x.float()
                mv(a, xf, out=y)
                mv(b, y, out=z)
                o.add_(z, alpha=s)  # computed in float32, rounded once into bf16
        else:
            def torch_fn(o=torch.zeros(oshape, dtype=bf), x=xt, at=ah.T, bt=bh.T, s=s,
                         y=torch.empty(batch, rank, dtype=bf), mm=torch.mm):
                mm(x, at, out=y)
                o.addmm_(y, bt, alpha=s)

            def peft_fn(o=torch.zeros(oshape, dtype=bf), x=xt, at=af.T, bt=bf32.T, s=s, xf=xf,
                        y=torch.empty(batch, rank), z=zf, mm=torch.mm):
                xf.copy_(x)
                mm(xf, at, out=y)
                mm(y, bt, out=z)
                o.add_(z, alpha=s)

        impls["torch"] = Impl(torch_fn)
        impls["peft"] = Impl(peft_fn)

    def ours_once():
        o = _act_pair(torch, x32, oshape, "bfloat16", kind)[1]
        method(x, o)
        return _as64(o)

    def ref_once():
        x64 = _as64(x)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        return s * ((x64 @ a64.T) @ b64.T)

    nbytes = rank * (rows + cols) * 2 + n * cols * 2 + n * rows * 2 * 2
    _, flops = linear_model(rows, cols, [rank], n, 2)
    return Built(impls, nbytes, flops, (ours_once, ref_once, _TOL["bfloat16"]))


MERGE_N, QUICK_MERGE_N, MERGE_RANK = 4096, 2048, 16


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
    a, b = _pair(rng, n, n, rank)
    d = _make_delta(lora, a, b, "float32", rank)
    s = _scale_of(d, rank)
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[wdt]
    w0 = torch.from_numpy(_rand(rng, (n, n), 0.02)).to(tdt)
    a32, b32 = torch.from_numpy(a), torch.from_numpy(b)
    ah, bh = a32.to(tdt), b32.to(tdt)

    def torch_fn(w=w0.clone(), a=ah, b=bh, s=s):
        w.add_((b @ a).mul_(s))

    def peft_fn(w=w0.clone(), a=a32, b=b32, s=s, dt=tdt):
        w += (b @ a * s).to(dt)

    impls = {"ours": Impl(d.merge_into, w0.clone()), "torch": Impl(torch_fn), "peft": Impl(peft_fn)}

    def ours_once():
        return _as64(d.merge_into(w0.clone()))

    def ref_once():
        return _as64(w0) + s * (b.astype(np.float64) @ a.astype(np.float64))

    item = w0.element_size()
    return Built(impls, 2 * n * n * item + rank * 2 * n * 4, 2 * n * n * rank,
                 (ours_once, ref_once, _TOL[wdt]), info={"merge_n": n})


def merge_name(n):
    return f"merge r{MERGE_RANK} into w {n}x{n}"


EDGE_BATCH = 8


def build_edge(ctx, method, act, batch=None, rows=4096, cols=4096, rank=16):
    """The Python edge of one call: a delta whose LoraScale is 0 (the C call checks its
    arguments, then skips all arithmetic), so the time is the Python layer's and the C entry's.
    ours: NumPy x and out; ours_torch: CPU torch tensors of the same dtype and shape."""
    lora, torch, rng = ctx.lora, ctx.torch, ctx.rng
    a, b = _pair(rng, rows, cols, rank)
    d = lora.LoraDelta(a, b, alpha=2.0 * rank, scale=0.0, dtype=act)
    xshape = (cols,) if batch is None else (batch, cols)
    oshape = (rows,) if batch is None else (batch, rows)
    x32 = _rand(rng, xshape, 1.0)
    fn = getattr(d, method)
    kinds = ("ndarray",) + (("tensor",) if torch is not None else ())
    args = {k: _act_pair(torch, x32, oshape, act, k) for k in kinds}
    impls = {"ours": Impl(fn, *args["ndarray"])}
    if torch is not None:
        impls["ours_torch"] = Impl(fn, *args["tensor"])

    def ours_once():  # scale 0 leaves out as it was (zeros), whatever the kind
        res = []
        for k in kinds:
            xk, ok = _act_pair(torch, x32, oshape, act, k)
            fn(xk, ok)
            res.append(_as64(ok).reshape(-1))
        return np.concatenate(res)

    def ref_once():
        return np.zeros(len(kinds) * math.prod(oshape))

    return Built(impls, 0, 0, (ours_once, ref_once, 0.0))


def build_bank_edge(ctx, n_adapters=8, rows=4096, cols=4096, rank=16, batch=EDGE_BATCH):
    """The edge of a bank call (every adapter's scale 0): ours = ``LoraBank.add_batch_to`` with
    random ids and per-position float64 scales; set = an ``AdapterSet`` bank over the same
    deltas, same ids and scales; delta = ``LoraDelta.add_batch_to`` at scale 0 of the same x
    and out (all float32 NumPy)."""
    lora, rng = ctx.lora, ctx.rng
    deltas = []
    for _ in range(n_adapters):
        a, b = _pair(rng, rows, cols, rank)
        deltas.append(lora.LoraDelta(a, b, alpha=2.0 * rank, scale=0.0))
    bank = lora.LoraBank(deltas)
    aset = lora.AdapterSet({f"adapter{i}": lora.LoraAdapter({"proj": d}, name=f"adapter{i}", alpha=2.0 * rank,
                                                             scale=d.scale) for i, d in enumerate(deltas)})
    set_bank = aset.bank("proj")
    ids = aset.slots([f"adapter{i}" for i in rng.integers(0, n_adapters, size=batch)])
    pos = rng.uniform(0.25, 1.25, size=batch)
    x = _rand(rng, (batch, cols), 1.0)

    def zeros():
        return np.zeros((batch, rows), np.float32)

    impls = {"ours": Impl(bank.add_batch_to, x, zeros(), ids, pos),
             "set": Impl(set_bank.add_batch_to, x, zeros(), ids, pos),
             "delta": Impl(deltas[0].add_batch_to, x, zeros())}

    def ours_once():
        o1, o2 = zeros(), zeros()
        bank.add_batch_to(x, o1, ids, pos)
        set_bank.add_batch_to(x, o2, ids, pos)
        return np.concatenate([o1, o2])

    return Built(impls, 0, 0, (ours_once, lambda: np.zeros((2 * batch, rows)), 0.0))


SET_ADAPTERS, SET_RANK, SET_BATCH = 8, 16, 8
QUICK_SET_LAYERS = 2  # --quick: the adapter-set step builds 2 of the 32 layers


def build_set_step(ctx, layers, n_adapters=SET_ADAPTERS, rank=SET_RANK, batch=SET_BATCH):
    """One decode step of `batch` sequences through an ``AdapterSet`` of `n_adapters` adapters
    (bf16 storage) over every adapted projection of `layers` Llama-2-7B-shaped layers: one bank
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
                a, b = _pair(rng, rows, cols, rank)
                ds[f"{layer}.{proj}"] = lora.LoraDelta(a, b, alpha=2.0 * rank, scale=sc, dtype="bfloat16")
                if layer == 0 and proj == "q":
                    checked.append((a, b))
        aset.add(f"adapter{k}", lora.LoraAdapter(ds, name=f"adapter{k}", alpha=2.0 * rank, scale=sc))
        scales.append(sc)
    build_s = time.perf_counter() - t0
    ids = aset.slots([f"adapter{i}" for i in rng.integers(0, n_adapters, size=batch)])
    pos = rng.uniform(0.25, 1.25, size=batch)
    xs = {c: _rand(rng, (batch, c), 1.0) for c in (4096, 11008)}
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
            a, b = checked[u]
            o[i] = s * pos[i] * (b.astype(np.float64) @ (a.astype(np.float64) @ xs[4096][i]))
        return o

    used = len(np.unique(ids))
    nbytes = flops = 0
    for _ in range(layers):
        for _, rows, cols in LLAMA2_7B:
            nbytes += used * rank * (rows + cols) * 2 + batch * (cols * 4 + rows * 8) + batch * 16
            flops += 2 * batch * rank * (rows + cols)
    info = {"build_s": build_s, "adapter_bytes": aset.resident_bytes, "layers": layers,
            "bank_calls": len(calls), "adapters": n_adapters}
    return Built(impls, nbytes, flops, (ours_once, ref_once, _TOL["bfloat16"]), info)


DECODE_SHAPES = ((4096, 4096, 8), (4096, 4096, 16), (4096, 4096, 64), (11008, 4096, 16), (4096, 11008, 16))
PREFILL_BATCHES = (1, 8, 32, 128, 512)
GATHER = (32000, 4096, 16)
BANK_BATCHES = (64, 512)
BANK_SCALED_BATCHES = (1, 8, 64)
HALF_ACT_BATCHES = (None, 128, 512)  # None: decode (add_to)


def decode_name(rows, cols, rank):
    return f"decode {rows}x{cols} r{rank}"


def prefill_name(batch):
    return f"prefill b{batch} 4096x4096 r16"


def gather_name(n):
    return f"gather n{n} {GATHER[0]}x{GATHER[1]} r{GATHER[2]}"


def bank_name(batch, scaled=False):
    return f"bank 8x r16 b{batch} 4096x4096" + (" scaled" if scaled else "")


def halfact_name(batch, kind):
    """bf16 activations: kind "ndarray" (NumPy, ml_dtypes) or "tensor" (torch)."""
    return f"{decode_name(4096, 4096, 16) if batch is None else prefill_name(batch)} x/out {kind}"


def edge_name(method, batch=None):
    return f"edge {method}" + (f" b{batch}" if batch else "") + " scale 0"


BANK_EDGE_NAME = f"edge bank 8x b{EDGE_BATCH} scale 0"


def set_step_name(layers):
    return f"adapter-set step {layers}L 8x r16 b8"


LOAD_NAME = "under load: mean call time / one thread's (worst shape)"


def measure_under_load(quick, status):
    """benchmarks/oversubscription.py's measurement (children under busy processes and a busy
    torch pool in-process; it makes the load itself, so foreign load does not make it noisy):
    the worst mean ratio of a default call to a one-thread call under the same load."""
    import oversubscription  # benchmarks/ is on the path: bench.py lives there

    status("under load: busy processes and a busy torch pool (child processes)")
    res = oversubscription.under_load(loads=("procs", "torch"), policies=("default",), quick=quick)
    worst = res["worst"].get("default")
    if worst is None:
        return {"skip": "no loaded run finished"}
    per = {f"{load}: {shape}": round(v["ratio"]["mean"], 2)
           for load, pol in res["loads"].items()
           for shape, v in pol.get("default", {}).get("shapes", {}).items()}
    return {"impls": {"ours": {"median_s": worst, "min_s": worst, "max_s": worst}},
            "worst": worst, "ratios": per, "others_cpu": None}


def workloads(sweep_layers, startup_runs, set_layers=LLAMA2_7B_LAYERS, quick=False):
    W = [Workload(name, "startup", "-", None, run=lambda ctx, cfg, status, monitor, args=args:
                  startup.measure(ctx.lora, args, startup_runs, status, monitor, cfg.settle_s))
         for name, args in startup.COMMANDS.items()]
    W.append(Workload(LOAD_NAME, "load", "-", None,
                      run=lambda ctx, cfg, status, monitor: measure_under_load(quick, status)))

    def add(name, group, dtype, build, key=""):
        W.append(Workload(name, group, dtype, build, key))

    for dtype in ("float32", "float16", "bfloat16"):
        for rows, cols, r in DECODE_SHAPES:
            key = decode_name(rows, cols, r)
            add(key, "decode", dtype, lambda c, a=(rows, cols, [r], None, dtype): build_linear(c, *a), key)
        for n in PREFILL_BATCHES:
            key = prefill_name(n)
            add(key, "prefill", dtype, lambda c, a=(4096, 4096, [16], n, dtype): build_linear(c, *a), key)
        if dtype == "float32":
            for n in (1, 512):
                add(gather_name(n), "gather", dtype, lambda c, n=n: build_gather(c, *GATHER[:2], GATHER[2], n))
            add("stack 4x r16 b1 4096x4096", "stack", dtype, lambda c: build_linear(c, 4096, 4096, [16] * 4, None, "float32"))
            add("stack 4x r16 b128 4096x4096", "stack", dtype,
                lambda c: build_linear(c, 4096, 4096, [16] * 4, 128, "float32"))
        key = f"sweep llama2-7b {sweep_layers}L r{SWEEP_RANK}"
        add(key, "sweep", dtype, lambda c, d=dtype: build_sweep(c, sweep_layers, SWEEP_RANK, d), key)
    for n in BANK_BATCHES:
        add(bank_name(n), "bank", "float32", lambda c, n=n: build_bank(c, 8, 4096, 4096, 16, n))
    for n in BANK_SCALED_BATCHES:
        add(bank_name(n, True), "bank", "float32", lambda c, n=n: build_bank(c, 8, 4096, 4096, 16, n, True))
    for kind in ("ndarray", "tensor"):  # bf16 activations; their f32 twins: the decode / prefill rows
        for n in HALF_ACT_BATCHES:
            key = decode_name(4096, 4096, 16) if n is None else prefill_name(n)
            add(halfact_name(n, kind), "halfact", "bfloat16", lambda c, n=n, k=kind: build_halfact(c, n, k), key)
    for method, batch in (("add_to", None), ("add_batch_to", EDGE_BATCH)):
        for act in ("float32", "bfloat16"):
            add(edge_name(method, batch), "edge", act, lambda c, a=(method, act, batch): build_edge(c, *a))
    add(BANK_EDGE_NAME, "edge", "float32", build_bank_edge)
    add(set_step_name(set_layers), "setstep", "bfloat16", lambda c: build_set_step(c, set_layers))
    merge_n = QUICK_MERGE_N if quick else MERGE_N
    for wdt in ("float32", "float16", "bfloat16"):
        add(merge_name(merge_n), "merge", wdt, lambda c, w=wdt: build_merge(c, w, merge_n))
    return W


@dataclass
class Ctx:
    lora: object
    torch: object
    rng: object
    dram_reader: object = None  # Impl reading the DRAM-sized buffer once (or None)
    threads: int = 1
    cache: dict = field(default_factory=dict)


def rel_err(ours, ref):
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(np.asarray(ours, np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def run_workload(wl, ctx, cfg, status, monitor=None):
    """Check the row's result against float64 once, then time every implementation."""
    if wl.run is not None:
        return wl.run(ctx, cfg, status, monitor)
    built = wl.build(ctx)
    ours_once, ref_once, tol = built.check
    err = rel_err(ours_once(), ref_once())
    res = {"bytes": built.bytes, "flops": built.flops, "check_rel_err": err}
    if not err <= tol:
        raise AssertionError(f"result differs from the float64 reference: relative error {err:.2e} > {tol:.0e}")
    res.update(built.info or {})
    if built.timing:
        cfg = replace(cfg, **built.timing)
        res["timing"] = built.timing
    samples, res["others_cpu"] = measure(built.impls, cfg, status, wl.name, monitor)
    res["impls"] = {name: {**summarize(v), "calls_per_sample": built.impls[name].k} for name, v in samples.items()}
    for name, impl in built.impls.items():
        if impl.keep is not None:  # a read reference: record its size
            res["impls"][name]["bytes"] = impl.keep.nbytes
    return res


def analyse(wl, res, bw, peak, threads, caches, by_key):
    """GB/s, GFLOP/s, roofline and speedups of one finished workload (in place).

    The roofline: a working set lives in the smallest level that holds it (``level_for``); the
    lower bound of a call's time is max(bytes / bandwidth(level), flops / peak); "% roof" is that
    bound over the measured median.  The sweep's bandwidth is that of a read of its own size
    measured alongside it."""
    t = res["impls"]["ours"]["median_s"]
    res["gb_per_s"] = res["bytes"] / t / 1e9
    res["gflop_per_s"] = res["flops"] / t / 1e9
    level = level_for(res["bytes"], threads, caches)
    res["level"] = level
    for ref, key in (("_dram_read", "dram_now_bytes_per_s"), ("_same_size_read", "same_size_read_bytes_per_s")):
        if ref in res["impls"]:
            r = res["impls"][ref]
            res[key] = r["bytes"] / r["median_s"]
    if bw and (res["bytes"] or res["flops"]):  # the edge rows move nothing: no roof
        level_bw = res.get("same_size_read_bytes_per_s", bw[level]["bytes_per_s"])
        bound = res["bytes"] / level_bw
        binds = "memory"
        if peak and res["flops"] / peak > bound:
            bound, binds = res["flops"] / peak, "compute"
        res["roof_time_s"], res["roof_binds"] = bound, binds
        res["roof_pct"] = 100.0 * bound / t
    sp = {}
    for name, r in res["impls"].items():
        if name != "ours" and not name.startswith("_"):
            sp[name] = r["median_s"] / t
    twin = by_key.get(wl.key) if wl.dtype != "float32" and wl.key else None
    if twin is not None and "impls" in twin.result:
        for name in ("numpy_naive", "numpy_tuned", "torch"):
            if name in twin.result["impls"]:
                sp[name + "_f32"] = twin.result["impls"][name]["median_s"] / t
        sp["ours_f32"] = twin.result["impls"]["ours"]["median_s"] / t
    res["speedup"] = sp
