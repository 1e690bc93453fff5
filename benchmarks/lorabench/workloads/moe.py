"""Mixtures of experts: ``LoraExperts.add_to`` on routed (token, slot) pairs, at the expert
shapes of Qwen3-30B-A3B (hidden 2048, moe_intermediate 768, 128 experts, top-8, rank 16): the
gate/up projection (``[2*768 x 2048]`` per expert, one x row per token shared by its 8 slots)
and the down projection (``[2048 x 768]``, one x row per slot), routed decode (1 token) and
routed prefill (512 tokens), float32 and bfloat16 storage, float32 x and out.

The routing is a router's: 8 distinct experts per token, drawn at random, and every call of
every implementation takes the next of several routings (as the layers and tokens of a model
do), so a call reads its routed experts' factors from wherever all the experts' factors live,
not from a core's cache that the same routing warmed: the row's working set is the whole
expert table (``working_set_bytes``), its bytes per call only the routed experts'.  Baselines,
the ways a PyTorch user writes it (``best torch`` is the fastest of them in each row):

* ``torch_bmm``: gather each pair's expert factors and ``bmm`` (transformers' ``batched_mm``
  experts path does this with the base weights);
* ``gather_einsum``: vLLM's CPU LoRA path, per-pair gathered factors and ``einsum``;
* ``torch_group``: a loop over the routed experts, ``index_select`` of their rows, two ``mm``
  and ``index_add_`` (transformers' eager experts loop, pairs sorted by expert once);
* ``torch_grouped_mm``: pairs sorted by expert, ``torch.nn.functional.grouped_mm`` twice
  (transformers' default ``grouped_mm`` experts path on CPU);
* ``dense``: our own dense delta doing the same number of positions (decode: each pair as its
  own ``LoraDelta.add_to`` on its expert; prefill: one expert's ``add_batch_to`` over all the
  pairs, its factors in cache), the yardstick for "as fast per routed pair as a dense delta per
  position";
* ``bank``: the same pairs through a ``LoraBank`` of the experts' ``LoraDelta``s (adapter id =
  expert id, x one row per pair): the plain bank path doing the routed work.

Bytes / flops (S pairs, u distinct routed experts, a mean over the routings): bytes =
u*rank*(rows+cols)*w + x rows * cols*4 + S*rows*4*2 (out read and written) + S*8 (ids); flops =
2*S*rank*(rows+cols); working set: every expert's factors, x and out.
"""

from __future__ import annotations

import itertools

import numpy as np

from ..timing import Impl
from .core import TOL, Built, Skip, pair, rand

HIDDEN, INTER, N_EXPERTS, TOP_K, RANK = 2048, 768, 128, 8, 16
MOE_PROJ = {"gate_up": (2 * INTER, HIDDEN, True), "down": (HIDDEN, INTER, False)}  # rows, cols, shared x
MOE_TOKENS = (1, 512)
QUICK = dict(proj="gate_up", tokens=4, rows=256, cols=128, n_experts=16, k=4, rank=8)


def moe_name(proj, tokens, quick=False):
    if quick:
        q = QUICK
        return f"moe quick {q['n_experts']}e top{q['k']} t{q['tokens']} {q['rows']}x{q['cols']} r{q['rank']}"
    rows, cols, _ = MOE_PROJ[proj]
    step = "decode" if tokens == 1 else f"prefill t{tokens}"
    return f"moe {step} {proj} {N_EXPERTS}e top{TOP_K} {rows}x{cols} r{RANK}"


def build_moe(ctx, proj, tokens, dtype, rows=None, cols=None, n_experts=N_EXPERTS, k=TOP_K,
              rank=RANK):
    lora, torch, rng = ctx.lora, ctx.torch, ctx.rng
    if not hasattr(lora, "LoraExperts"):
        raise Skip("lora.LoraExperts not in this build")
    prows, pcols, shared = MOE_PROJ[proj]
    rows, cols = rows or prows, cols or pcols
    pairs = [pair(rng, rows, cols, rank) for _ in range(n_experts)]
    a_all = np.stack([a for a, _ in pairs])
    b_all = np.stack([b for _, b in pairs])
    ex = lora.LoraExperts(a_all, b_all, alpha=2.0 * rank, dtype=dtype)
    s = ex.effective_scale
    n_routes = max(2, min(32, 4 * n_experts // (tokens * k)))  # enough to visit every expert
    routes = [np.stack([rng.choice(n_experts, size=k, replace=False) for _ in range(tokens)])
              for _ in range(n_routes)]
    flats = [ids.reshape(-1) for ids in routes]
    S = tokens * k
    x = rand(rng, (tokens, cols) if shared else (tokens, k, cols), 1.0)
    xs = np.repeat(x, k, axis=0) if shared else x.reshape(S, cols)   # one row per pair
    oshape = (tokens, k, rows)

    def zeros():
        return np.zeros(oshape, np.float32)

    nxt = itertools.cycle(range(n_routes)).__next__

    def ours(ex=ex, x=x, o=zeros(), routes=routes, nxt=nxt):
        ex.add_to(x, o, routes[nxt()])

    impls = {"ours": Impl(ours)}
    if tokens == 1:
        per_route = [[ex.expert(int(e)) for e in f] for f in flats]

        def dense(per_route=per_route, xs=xs, o=np.zeros((S, rows), np.float32), nxt=nxt):
            for i, d in enumerate(per_route[nxt()]):
                d.add_to(xs[i], o[i])
    else:
        d0 = ex.expert(0)

        def dense(d0=d0, xs=xs, o=np.zeros((S, rows), np.float32)):
            d0.add_batch_to(xs, o)
    impls["dense"] = Impl(dense)
    bank = lora.LoraBank([ex.expert(e) for e in range(n_experts)])

    def bank_call(bank=bank, xs=xs, o=np.zeros((S, rows), np.float32), flats=flats, nxt=nxt):
        bank.add_batch_to(xs, o, flats[nxt()])
    impls["bank"] = Impl(bank_call)
    if torch is not None:
        impls.update(_torch_impls(torch, a_all, b_all, dtype, s, xs, flats, oshape, nxt))

    def ours_once():
        return ex.add_to(x, zeros(), routes[0])

    stored_a, stored_b = (f.astype(np.float64) for f in ex.lora_weights())

    def ref_once():
        y = np.einsum("src,sc->sr", stored_a[flats[0]], xs.astype(np.float64))
        return (s * np.einsum("sor,sr->so", stored_b[flats[0]], y)).reshape(oshape)

    w = 4 if dtype == "float32" else 2
    per_expert = rank * (rows + cols) * w
    used = float(np.mean([np.unique(f).size for f in flats]))
    moved = x.size * 4 + S * rows * 8 + S * 8
    nbytes = int(used * per_expert) + moved
    flops = 2 * S * rank * (rows + cols)
    info = {"distinct_experts": used, "pairs": int(S), "routings": n_routes,
            "working_set_bytes": n_experts * per_expert + moved}
    return Built(impls, nbytes, flops, (ours_once, ref_once, TOL[dtype]), info=info)


def _torch_impls(torch, a_all, b_all, dtype, s, xs, flats, oshape, nxt):
    """The PyTorch formulations (see the module docstring), factors in the row's storage dtype;
    for bfloat16 factors x is converted to bfloat16 in the call (a user's bf16 matmuls) and the
    result added into the float32 out.  Each call takes the next routing (``nxt``)."""
    td = torch.float32 if dtype == "float32" else torch.bfloat16
    A = torch.from_numpy(a_all).to(td)                   # [E, r, cols]
    B = torch.from_numpy(b_all).to(td)                   # [E, rows, r]
    At = A.transpose(1, 2).contiguous()                  # [E, cols, r]
    Bt = B.transpose(1, 2).contiguous()                  # [E, r, rows]
    x32 = torch.from_numpy(xs)
    routes = [torch.from_numpy(f) for f in flats]
    n_experts = A.shape[0]
    S, rows = flats[0].size, oshape[-1]

    def out():
        return torch.zeros(S, rows)

    def torch_bmm(x=x32, o=out()):
        ids = routes[nxt()]
        xc = x.to(td)
        y = torch.bmm(A[ids], xc.unsqueeze(-1))
        o.add_(torch.bmm(B[ids], y).squeeze(-1), alpha=s)

    def gather_einsum(x=x32, o=out()):
        ids = routes[nxt()]
        xc = x.to(td)
        y = torch.einsum("sc,src->sr", xc, A[ids])
        o.add_(torch.einsum("sr,sor->so", y, B[ids]), alpha=s)

    def torch_group(x=x32, o=out()):
        ids = routes[nxt()]
        xc = x.to(td)
        order = torch.argsort(ids, stable=True)
        counts = torch.bincount(ids, minlength=n_experts).tolist()
        start = 0
        for e, c in enumerate(counts):
            if c:
                idx = order[start:start + c]
                y = xc.index_select(0, idx) @ At[e]
                o.index_add_(0, idx, (y @ Bt[e]).to(o.dtype), alpha=s)
                start += c

    impls = {"torch_bmm": Impl(torch_bmm), "gather_einsum": Impl(gather_einsum),
             "torch_group": Impl(torch_group)}
    grouped = getattr(torch.nn.functional, "grouped_mm", None)
    if grouped is not None:
        def torch_grouped_mm(x=x32, o=out()):
            ids = routes[nxt()]
            xc = x.to(td)
            ev, perm = torch.sort(ids, stable=True)
            offs = torch.cumsum(torch.bincount(ev, minlength=n_experts), 0).to(torch.int32)
            y = grouped(xc[perm], At, offs=offs)
            o.index_add_(0, perm, grouped(y, Bt, offs=offs).to(o.dtype), alpha=s)

        try:
            torch_grouped_mm()  # the CPU kernel refuses some strides and dtypes: then not a baseline
            impls["torch_grouped_mm"] = Impl(torch_grouped_mm)
        except RuntimeError:
            pass
    return impls
