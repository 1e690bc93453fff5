"""Decode (``add_to`` on one activation), prefill (``add_batch_to`` on a batch) and stacks of
deltas (a ``LoraStack``), in float32, float16 and bfloat16 storage with float32 activations.

Bytes / flops: `core.linear_model` (a stack: the sum over its deltas, x and out counted once).
Baselines: `baselines.numpy_naive` / `numpy_tuned` (float32 rows; a half row is compared with
the float32 NumPy row of its shape, a NumPy user having no fast half matmul) and
`baselines.torch_baseline` with the adapters in the row's storage dtype, each tuned one in its
formulations (views, factors transposed once), the fastest kept; a stack also against its
members concatenated once into one pair (`baselines.numpy_concat`, `torch_concat`), the table's
"tuned" and "torch" columns taking the faster formulation and naming it.
"""

from __future__ import annotations

import numpy as np

from ..timing import Impl
from .baselines import calls, numpy_concat, numpy_naive, numpy_tuned, torch_baseline, torch_concat
from .core import TOL, VALUE_BYTES, Built, linear_model, lora_ref, make_delta, pair, rand, scale_of, torch_dtype

DECODE_SHAPES = ((4096, 4096, 8), (4096, 4096, 16), (4096, 4096, 64), (11008, 4096, 16), (4096, 11008, 16))
PREFILL_BATCHES = (1, 8, 32, 128, 512)
STACK_BATCHES = (None, 128)  # None: decode (add_to)


def decode_name(rows, cols, rank):
    return f"decode {rows}x{cols} r{rank}"


def prefill_name(batch):
    return f"prefill b{batch} 4096x4096 r16"


def stack_name(batch):
    return f"stack 4x r16 b{1 if batch is None else batch} 4096x4096"


def build_linear(ctx, rows, cols, ranks, batch, dtype):
    """decode (batch None: add_to on 1-D), prefill (add_batch_to) and stacks (len(ranks) > 1)."""
    lora, torch, rng = ctx.lora, ctx.torch, ctx.rng
    pairs = [pair(rng, rows, cols, r) for r in ranks]
    deltas = [make_delta(lora, a, b, dtype, r) for (a, b), r in zip(pairs, ranks)]
    ours = deltas[0] if len(deltas) == 1 else lora.LoraStack(deltas)
    terms = [(a, b, scale_of(d)) for (a, b), d in zip(pairs, deltas)]
    n = 1 if batch is None else batch
    xshape = (cols,) if batch is None else (batch, cols)
    oshape = (rows,) if batch is None else (batch, rows)
    x = rand(rng, xshape, 1.0)

    def zeros():
        return np.zeros(oshape, np.float32)

    method = ours.add_to if batch is None else ours.add_batch_to
    impls = {"ours": Impl(method, x, zeros())}
    if dtype == "float32":
        impls["numpy_naive"] = numpy_naive(calls(terms, x, zeros()))
        impls.update(numpy_tuned(calls(terms, x, zeros())))
        if len(terms) > 1:
            impls.update(numpy_concat(terms, x, zeros()))
    if torch is not None and torch_dtype(torch, dtype) is not None:
        impls.update(torch_baseline(
            torch, calls(terms, torch.from_numpy(x), torch.from_numpy(zeros())), torch_dtype(torch, dtype)))
        if len(terms) > 1:
            impls.update(torch_concat(torch, terms, torch.from_numpy(x), torch.from_numpy(zeros()),
                                      torch_dtype(torch, dtype)))

    def ours_once():
        o = zeros()
        method(x, o)
        return o

    def ref_once():
        return sum(lora_ref(a, b, s, x) for a, b, s in terms)

    nbytes, flops = linear_model(rows, cols, ranks, n, VALUE_BYTES[dtype])
    return Built(impls, nbytes, flops, (ours_once, ref_once, TOL[dtype]))
