"""Deltas over caller-owned memory (what ``accelerate_peft`` builds over PEFT's own tensors): A as
rows ``[rank, in]`` and B as rows ``[out, rank]`` (the by-row accumulate), or an embedding's
``[r, vocab]`` / ``[dim, r]`` pair.  The guarantees of packed deltas hold: accuracy against a float64
reference, the same bits for every thread count and batch size, stacks = members in order, writes
to the caller's memory seen at the next call."""

import numpy as np
import pytest

import lora
from conftest import (DTYPES, assert_accurate, assert_same_bits, num_threads, rand, ref_batch,
                      ref_rows)

ml_dtypes = pytest.importorskip("ml_dtypes")
NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def linear_view(a, b, dtype, scale=1.0):
    """A view of lora_a [rank, cols] and lora_b [rows, rank] (PEFT's Linear layout)."""
    rank, cols = a.shape
    rows = b.shape[0]
    return lora.LoraDelta.view((a.ctypes.data, cols), (b.ctypes.data, rank), dtype=dtype,
                               rank=rank, rows=rows, cols=cols, b_by_row=True, scale=scale,
                               keep=(a, b))


def embedding_view(emb_a, emb_b, dtype, scale=1.0):
    """A view of PEFT's lora_embedding_A [r, vocab] and lora_embedding_B [dim, r]."""
    rank, vocab = emb_a.shape
    dim = emb_b.shape[0]
    return lora.LoraDelta.view((emb_b.ctypes.data, rank), (emb_a.ctypes.data, vocab), dtype=dtype,
                               rank=rank, rows=vocab, cols=dim, a_by_row=True, scale=scale,
                               keep=(emb_a, emb_b))


def factors(rng, rank, rows, cols, dtype):
    a = (rng.standard_normal((rank, cols)) * 0.5).astype(NP[dtype])
    b = (rng.standard_normal((rows, rank)) * 0.5).astype(NP[dtype])
    return a, b


@pytest.mark.parametrize("rank,rows,cols", [(1, 7, 33), (16, 100, 257), (33, 64, 17),
                                            (7, 1001, 15), (64, 31, 1001)])
def test_linear_view_accuracy_and_invariance(rank, rows, cols, isa, dtype):
    rng = np.random.default_rng(rank * rows + cols)
    a, b = factors(rng, rank, rows, cols, dtype)
    v = linear_view(a, b, dtype, scale=0.75)
    assert v.lora_weights()[0].tobytes() == a.tobytes()
    n = 9
    x, out0 = rand(rng, (n, cols)), rand(rng, (n, rows))
    with num_threads(1):
        one = v.add_batch_to(x, out0.copy())
    with num_threads(2):
        two = v.add_batch_to(x, out0.copy())
    assert_same_bits(one, two, "threads")
    for i in (0, n - 1):
        assert_same_bits(one[i], v.add_to(x[i], out0[i].copy()), f"row {i}")
    ref, np32 = ref_batch([v], x, out0)
    assert_accurate(one, ref, np32, f"view {dtype} r{rank} [{rows} x {cols}]")


def test_embedding_view_gathers(isa, dtype):
    rng = np.random.default_rng(2)
    rank, vocab, dim = 12, 300, 70
    emb_a = (rng.standard_normal((rank, vocab))).astype(NP[dtype])
    emb_b = (rng.standard_normal((dim, rank))).astype(NP[dtype])
    v = embedding_view(emb_a, emb_b, dtype, scale=2.0)
    ids = rng.integers(0, vocab, 40)
    out0 = rand(rng, (40, dim))
    got = v.add_rows_to(ids, out0.copy())
    ref, np32 = ref_rows([v], ids, out0)
    assert_accurate(got, ref, np32, "embedding view")
    # PEFT's own formula: embedding(ids, A.T) @ B.T * scaling
    peft = out0.astype(np.float64) + 2.0 * (emb_a.astype(np.float64).T[ids] @ emb_b.astype(
        np.float64).T)
    assert np.allclose(got, peft, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError):  # a gather-only view has no linear op
        v.add_batch_to(rand(rng, (2, dim)), np.zeros((2, vocab), np.float32))


def test_stacks_and_banks_of_views_and_packed_deltas(isa):
    rng = np.random.default_rng(3)
    rows, cols = 96, 80
    views = [linear_view(*factors(rng, r, rows, cols, dt), dt, scale=s)
             for r, dt, s in ((4, "float32", 1.0), (16, "bfloat16", -0.5), (9, "float16", 2.0))]
    packed = lora.LoraDelta(rng.standard_normal((5, cols)), rng.standard_normal((rows, 5)))
    members = [views[0], packed, views[1], views[2]]
    stack = lora.LoraStack(members)
    x, out0 = rand(rng, (6, cols)), rand(rng, (6, rows))
    got = stack.add_batch_to(x, out0.copy())
    want = out0.copy()
    for d in members:
        d.add_batch_to(x, want)
    assert_same_bits(got, want, "stack of views = members in order")
    bank = lora.LoraBank([views[1], stack, None])
    ids = np.array([1, 0, 2, 1, -1, 0])
    got = bank.add_batch_to(x, out0.copy(), ids)
    for i, e in enumerate(ids):
        row = out0[i].copy()
        if e in (0, 1):
            bank[e].add_to(x[i], row)
        assert_same_bits(got[i], row, f"bank row {i}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_writes_to_the_callers_memory_are_seen(dtype):
    rng = np.random.default_rng(4)
    a, b = factors(rng, 8, 40, 30, dtype)
    v = linear_view(a, b, dtype)
    x = rand(rng, 30)
    first = v.add_to(x, np.zeros(40, np.float32))
    b[...] = (b.astype(np.float32) * 2).astype(b.dtype)  # exact: a power of two
    assert_same_bits(v.add_to(x, np.zeros(40, np.float32)), first * 2)
