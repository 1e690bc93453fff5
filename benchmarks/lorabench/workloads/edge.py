"""The Python edge of a call: deltas whose scale is 0 (the C call checks its arguments, then
skips all arithmetic), so the time is the Python layer's and the C entry's; NumPy arrays against
torch tensors, and ``LoraBank`` / ``AdapterSet`` banks against a ``LoraDelta``.  No bytes, no
flops, no baselines: the rows are judged in microseconds.
"""

from __future__ import annotations

import math

import numpy as np

from ..timing import Impl
from .core import Built, act_pair, as64, pair, rand

EDGE_BATCH = 8
EDGE_CALLS = (("add_to", None), ("add_batch_to", EDGE_BATCH))  # (method, batch)
EDGE_ACTS = ("float32", "bfloat16")


def edge_name(method, batch=None):
    return f"edge {method}" + (f" b{batch}" if batch else "") + " scale 0"


BANK_EDGE_NAME = f"edge bank 8x b{EDGE_BATCH} scale 0"


def build_edge(ctx, method, act, batch=None, rows=4096, cols=4096, rank=16):
    """The Python edge of one call: a delta whose LoraScale is 0 (the C call checks its
    arguments, then skips all arithmetic), so the time is the Python layer's and the C entry's.
    ours: NumPy x and out; ours_torch: CPU torch tensors of the same dtype and shape."""
    lora, torch, rng = ctx.lora, ctx.torch, ctx.rng
    a, b = pair(rng, rows, cols, rank)
    d = lora.LoraDelta(a, b, alpha=2.0 * rank, scale=0.0, dtype=act)
    xshape = (cols,) if batch is None else (batch, cols)
    oshape = (rows,) if batch is None else (batch, rows)
    x32 = rand(rng, xshape, 1.0)
    fn = getattr(d, method)
    kinds = ("ndarray",) + (("tensor",) if torch is not None else ())
    args = {k: act_pair(torch, x32, oshape, act, k) for k in kinds}
    impls = {"ours": Impl(fn, *args["ndarray"])}
    if torch is not None:
        impls["ours_torch"] = Impl(fn, *args["tensor"])

    def ours_once():  # scale 0 leaves out as it was (zeros), whatever the kind
        res = []
        for k in kinds:
            xk, ok = act_pair(torch, x32, oshape, act, k)
            fn(xk, ok)
            res.append(as64(ok).reshape(-1))
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
        a, b = pair(rng, rows, cols, rank)
        deltas.append(lora.LoraDelta(a, b, alpha=2.0 * rank, scale=0.0))
    bank = lora.LoraBank(deltas)
    aset = lora.AdapterSet({f"adapter{i}": lora.LoraAdapter({"proj": d}, name=f"adapter{i}", alpha=2.0 * rank,
                                                             scale=d.scale) for i, d in enumerate(deltas)})
    set_bank = aset.bank("proj")
    ids = aset.slots([f"adapter{i}" for i in rng.integers(0, n_adapters, size=batch)])
    pos = rng.uniform(0.25, 1.25, size=batch)
    x = rand(rng, (batch, cols), 1.0)

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
