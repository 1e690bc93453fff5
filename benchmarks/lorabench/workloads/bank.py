"""Mixed batches: a ``LoraBank`` where position b gets adapter ids[b] (-1: none), with and
without per-position scales, against NumPy grouping, the gather + einsum of vLLM's CPU LoRA
path and PEFT-style grouping in torch (their own: no other family groups positions).

Bytes / flops (m positions with an adapter, u distinct adapters used): bytes = sum over used
adapters of rank*(rows+cols)*w + m*(cols*4 + rows*4*2) + n*8 (ids; 16 with scales); flops =
2*m*rank*(rows+cols).
"""

from __future__ import annotations

import numpy as np

from ..timing import Impl
from .core import TOL, Built, Skip, lora_ref, make_delta, pair, rand, scale_of

BANK_BATCHES = (64, 512)
BANK_SCALED_BATCHES = (1, 8, 64)


def bank_name(batch, scaled=False):
    return f"bank 8x r16 b{batch} 4096x4096" + (" scaled" if scaled else "")


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
    pairs = [pair(rng, rows, cols, rank) for _ in range(n_adapters)]
    deltas = [make_delta(lora, a, b, "float32", rank) for a, b in pairs]
    s = scale_of(deltas[0])
    bank = lora.LoraBank(deltas)
    ids = rng.integers(0 if scaled else -1, n_adapters, size=batch, dtype=np.int64)
    pos = rng.uniform(0.25, 1.25, size=batch) if scaled else None
    pos_args = (pos,) if scaled else ()
    x = rand(rng, (batch, cols), 1.0)

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
                o[i] = lora_ref(*pairs[u], s * (pos[i] if scaled else 1.0), x[i])
        return o

    used = [u for u in np.unique(ids) if u >= 0]
    m = int(np.count_nonzero(ids >= 0))
    nbytes = len(used) * rank * (rows + cols) * 4 + m * (cols * 4 + rows * 8) + batch * (16 if scaled else 8)
    return Built(impls, nbytes, 2 * m * rank * (rows + cols), (ours_once, ref_once, TOL["float32"]))
