"""LoraBank: every position's bits equal its entry applied alone, whatever the batch's
composition, order, thread count or ISA; -1 and None mean "no adapter" and leave the row's bits
alone; -1 never wraps to the last slot; the API surface."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lora
from conftest import (DTYPES, assert_same_bits, can_run_two_threads, make_delta, num_threads,
                      rand)

TWO = can_run_two_threads()


def _entries(rng, rows, cols, dtype, n_slots=8):
    """A mixed bank: deltas of several ranks and dtypes, a stack, empty slots (None) — the last
    slot always holds a real delta so a wrap-around of -1 would show."""
    other = "bfloat16" if dtype != "bfloat16" else "float16"
    pool = [
        lambda: make_delta(rng, 16, rows, cols, dtype, alpha=32.0),
        lambda: make_delta(rng, 4, rows, cols, other, scale=-0.75),
        lambda: lora.LoraStack([make_delta(rng, 8, rows, cols, dtype),
                                make_delta(rng, 3, rows, cols, "float32", alpha=6.0)]),
        lambda: None,
        lambda: make_delta(rng, 1, rows, cols, dtype),
        lambda: make_delta(rng, 33, rows, cols, dtype, alpha=8.0, rslora=True),
    ]
    entries = [pool[i % len(pool)]() for i in range(n_slots - 1)]
    entries.append(make_delta(rng, 5, rows, cols, dtype, alpha=10.0))
    return entries


def _alone_batch(entry, x, out_row):
    out = out_row.copy()
    if entry is not None:
        entry.add_to(x, out)
    return out


def _alone_rows(entry, tok, out_row):
    out = out_row.copy()
    if entry is not None:
        entry.add_row_to(int(tok), out)
    return out


def _check_bank(bank, entries, rng, rows, cols, n, threads):
    aid = rng.integers(-1, len(entries), size=n)      # unsorted, with -1 and None slots
    aid[: min(n, 3)] = [-1, len(entries) - 1, -1][: min(n, 3)]
    rng.shuffle(aid)
    x = rand(rng, (n, cols))
    out0 = rand(rng, (n, rows))
    ids = rng.integers(0, rows, size=n)
    rout0 = rand(rng, (n, cols))
    with num_threads(threads):
        out = bank.add_batch_to(x, out0.copy(), aid)
        rout = bank.add_rows_to(ids, rout0.copy(), aid)
        for b in range(n):
            e = entries[aid[b]] if aid[b] >= 0 else None
            assert_same_bits(out[b], _alone_batch(e, x[b], out0[b]),
                             f"add_batch_to position {b} (adapter {aid[b]}), {threads} threads")
            assert_same_bits(rout[b], _alone_rows(e, ids[b], rout0[b]),
                             f"add_rows_to position {b} (adapter {aid[b]}), {threads} threads")
            if aid[b] == -1:
                assert out[b].tobytes() == out0[b].tobytes()
                assert rout[b].tobytes() == rout0[b].tobytes()
    return aid, out, rout


@pytest.mark.parametrize("threads", [1, 2])
def test_bank_rows_equal_entry_alone(threads, isa, dtype):
    """Random unsorted id mixes (with -1 and None slots), small and large batches, below and above
    the parallel threshold: every row is bit-identical to its entry applied alone."""
    if threads == 2 and not TWO:
        pytest.skip("one thread only")
    rng = np.random.default_rng([threads, len(isa), len(dtype)])
    for rows, cols, batches in ((40, 24, (1, 2, 5, 9, 33)), (512, 384, (64, 512))):
        entries = _entries(rng, rows, cols, dtype)
        bank = lora.LoraBank(entries)
        for n in batches:
            _check_bank(bank, entries, rng, rows, cols, n, threads)


@pytest.mark.skipif(not TWO, reason="one thread only")
def test_bank_thread_count_invariance(isa, dtype):
    rng = np.random.default_rng(1)
    entries = _entries(rng, 512, 384, dtype)
    bank = lora.LoraBank(entries)
    aid = rng.integers(-1, len(entries), size=300)
    x, out0 = rand(rng, (300, 384)), rand(rng, (300, 512))
    ids, rout0 = rng.integers(0, 512, 300), rand(rng, (300, 384))
    res = {}
    for t in (1, 2):
        with num_threads(t):
            res[t] = (bank.add_batch_to(x, out0.copy(), aid), bank.add_rows_to(ids, rout0.copy(),
                                                                               aid))
    assert_same_bits(res[1][0], res[2][0], "bank.add_batch_to 1 vs 2 threads")
    assert_same_bits(res[1][1], res[2][1], "bank.add_rows_to 1 vs 2 threads")


def test_bank_result_independent_of_composition_and_order(isa):
    """Permuting the positions permutes the rows; the same position in another mix gives the
    same bits."""
    rng = np.random.default_rng(2)
    entries = _entries(rng, 64, 48, "float32")
    bank = lora.LoraBank(entries)
    n = 40
    aid = rng.integers(-1, len(entries), size=n)
    x, out0 = rand(rng, (n, 48)), rand(rng, (n, 64))
    base = bank.add_batch_to(x, out0.copy(), aid)
    perm = rng.permutation(n)
    permuted = bank.add_batch_to(x[perm], out0[perm].copy(), aid[perm])
    assert_same_bits(permuted, base[perm], "permuted batch")
    sorted_ = np.argsort(aid, kind="stable")
    assert_same_bits(bank.add_batch_to(x[sorted_], out0[sorted_].copy(), aid[sorted_]),
                     base[sorted_], "sorted batch")
    one = bank.add_batch_to(x[7:8], out0[7:8].copy(), aid[7:8])
    assert_same_bits(one[0], base[7], "position alone in the bank")


def test_minus_one_never_wraps_to_the_last_slot(isa, dtype):
    """id -1 must not apply the last entry (a known CPU bug elsewhere): every -1 row keeps its
    bits while the last slot's delta is large and non-zero."""
    rng = np.random.default_rng(3)
    last = make_delta(rng, 8, 32, 16, dtype, alpha=8.0, scale=100.0)
    bank = lora.LoraBank([make_delta(rng, 4, 32, 16, dtype), None, last])
    n = 12
    aid = np.full(n, -1)
    aid[5] = 2
    x, out0 = rand(rng, (n, 16)), rand(rng, (n, 32))
    out = bank.add_batch_to(x, out0.copy(), aid)
    assert out[aid == -1].tobytes() == out0[aid == -1].tobytes()
    assert not np.array_equal(out[5], out0[5])
    rout0 = rand(rng, (n, 16))
    rout = bank.add_rows_to(rng.integers(0, 32, n), rout0.copy(), aid)
    assert rout[aid == -1].tobytes() == rout0[aid == -1].tobytes()
    # all -1: nothing at all
    out = bank.add_batch_to(x, out0.copy(), np.full(n, -1))
    assert out.tobytes() == out0.tobytes()
    # None slots likewise
    out = bank.add_batch_to(x, out0.copy(), np.full(n, 1))
    assert out.tobytes() == out0.tobytes()


def test_bank_sees_a_stack_appended_after_construction(isa):
    rng = np.random.default_rng(4)
    stack = lora.LoraStack([make_delta(rng, 4, 20, 12)])
    bank = lora.LoraBank([stack, None])
    extra = make_delta(rng, 6, 20, 12, alpha=2.0)
    stack.append(extra)
    x, out0 = rand(rng, (3, 12)), rand(rng, (3, 20))
    got = bank.add_batch_to(x, out0.copy(), [0, -1, 0])
    for b, a in enumerate([0, -1, 0]):
        want = out0[b].copy()
        if a == 0:
            stack.add_to(x[b], want)
        assert_same_bits(got[b], want, f"position {b}")
    assert bank.resident_bytes == stack.resident_bytes


def test_bank_api():
    rng = np.random.default_rng(5)
    d1 = make_delta(rng, 4, 20, 12)
    d2 = make_delta(rng, 8, 20, 12, "bfloat16")
    st_ = lora.LoraStack([d1, d2])
    bank = lora.LoraBank([d1, None, st_, d1])
    assert len(bank) == 4
    assert bank[0] is d1 and bank[1] is None and bank[2] is st_ and bank[3] is d1
    # distinct deltas count once
    assert bank.resident_bytes == d1.resident_bytes + d2.resident_bytes
    assert lora.LoraBank([]).resident_bytes == 0 and len(lora.LoraBank([])) == 0
    assert lora.LoraBank([None]).resident_bytes == 0
    # batch 0 is a no-op that returns out
    out = np.zeros((0, 20), np.float32)
    assert bank.add_batch_to(np.zeros((0, 12), np.float32), out, np.zeros(0, int)) is out
    out = np.zeros((0, 12), np.float32)
    assert bank.add_rows_to(np.zeros(0, int), out, np.zeros(0, int)) is out
    # an empty bank: only -1 is a valid id
    empty = lora.LoraBank([])
    out = rand(rng, (2, 20))
    before = out.tobytes()
    assert empty.add_batch_to(rand(rng, (2, 12)), out, [-1, -1]) is out
    assert out.tobytes() == before
    with pytest.raises(IndexError):
        empty.add_batch_to(rand(rng, (2, 12)), out, [-1, 0])
    assert out.tobytes() == before


@given(n=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(DTYPES),
       n_slots=st.integers(1, 6))
def test_bank_hypothesis(n, seed, dtype, n_slots, isa):
    """Random banks and id mixes: every row equals its entry alone, bit for bit."""
    rng = np.random.default_rng(seed)
    rows, cols = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    entries = _entries(rng, rows, cols, dtype, n_slots=n_slots)
    _check_bank(lora.LoraBank(entries), entries, rng, rows, cols, n, 1)


def test_many_slots_and_an_empty_stack_entry(isa):
    """1000 slots (the plan no longer fits the kernel's stack buffer), mostly None, one an empty
    LoraStack (adds nothing, like None): rows still equal their entry alone."""
    rng = np.random.default_rng(6)
    entries = [None] * 1000
    entries[3] = make_delta(rng, 4, 30, 20)
    entries[999] = make_delta(rng, 8, 30, 20, "float16")
    entries[500] = lora.LoraStack()
    bank = lora.LoraBank(entries)
    assert bank.resident_bytes == entries[3].resident_bytes + entries[999].resident_bytes
    aid = rng.choice([3, 999, 500, -1, 0], size=300)
    x, out0 = rand(rng, (300, 20)), rand(rng, (300, 30))
    for threads in (1, 2):
        with num_threads(threads):
            got = bank.add_batch_to(x, out0.copy(), aid)
        for b in range(300):
            e = entries[aid[b]] if aid[b] >= 0 else None
            assert_same_bits(got[b], _alone_batch(e, x[b], out0[b]), f"position {b}")
            if aid[b] in (-1, 0, 500):
                assert got[b].tobytes() == out0[b].tobytes()
