"""Accuracy of every op against the float64 oracle (the accuracy rule, docs/guarantees.md), on every ISA path and
storage dtype; size sweeps that straddle the register widths; row-strided views; accepted input
conversions; the API surface of LoraDelta and LoraStack."""

import math
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lora
from conftest import (DTYPES, RANKS, SIZES, assert_accurate, assert_same_bits, make_delta,
                      members, rand, ref_batch, ref_rows)

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None

OPS = ["add_to", "add_batch_to", "add_row_to", "add_rows_to"]
BASE = {"rank": 8, "rows": 24, "cols": 40}
BATCH = 6  # more than one 4-position kernel block, with a partial one
MIN_OUTPUTS = 512      # output values pooled per accuracy verdict
MIN_PROJECTIONS = 512  # independent rank values (distinct positions x rank) pooled per verdict
# LORA_TEST_SEED=n reseeds every random test here (to look for seed-dependent verdicts)
SALT = int(os.environ.get("LORA_TEST_SEED", "0"))


def run_op_once(op, entry, rng, rows, cols, batch):
    """Apply `op` of `entry` (LoraDelta or LoraStack) to random data; check the result is `out`
    itself; return (ours, ref64, numpy32)."""
    if op == "add_to":
        x, out = rand(rng, cols), rand(rng, rows)
        out0 = out.copy()
        assert entry.add_to(x, out) is out
        ref, np32 = ref_batch(members(entry), x, out0)
    elif op == "add_batch_to":
        x, out = rand(rng, (batch, cols)), rand(rng, (batch, rows))
        out0 = out.copy()
        assert entry.add_batch_to(x, out) is out
        ref, np32 = ref_batch(members(entry), x, out0)
    elif op == "add_row_to":
        r = int(rng.integers(rows))
        out = rand(rng, cols)
        out0 = out.copy()
        assert entry.add_row_to(r, out) is out
        ref, np32 = ref_rows(members(entry), r, out0)
    else:
        ids = rng.integers(0, rows, size=batch)
        out = rand(rng, (batch, cols))
        out0 = out.copy()
        assert entry.add_rows_to(ids, out) is out
        ref, np32 = ref_rows(members(entry), ids, out0)
    return out.ravel(), ref.ravel(), np32.ravel()


def run_op(op, make_entry_, rng, rows, cols, batch=BATCH, min_outputs=MIN_OUTPUTS,
           min_projections=MIN_PROJECTIONS):
    """`run_op_once` on a fresh entry (``make_entry_()``) and fresh random inputs, repeated until
    at least `min_outputs` output values were produced; the results concatenated.

    The accuracy rule compares error *norms*.  Over a handful of values it is a coin toss (NumPy's
    own float32 error can happen to be near 0 while ours is an ordinary 1-2 ulp), and with one
    fixed delta the rounding of its few products is shared by every call, so tiny shapes
    (rows = 1, cols = 1, rank 1) are judged over several independent deltas and inputs: at least
    `min_outputs` output values and `min_projections` independent rank values (positions x rank)."""
    parts = []
    outputs = projections = 0
    if op in ("add_batch_to", "add_rows_to"):  # tiny outputs: more positions per call
        batch = max(batch, math.ceil(64 / (rows if op == "add_batch_to" else cols)))
    while outputs < min_outputs or projections < min_projections:
        entry = make_entry_()
        part = run_op_once(op, entry, rng, rows, cols, batch)
        parts.append(part)
        outputs += part[0].size
        # each rank value of A.x (or of s * B[r]) is shared by a whole output row: count them too;
        # a gather has at most `rows` distinct tokens, and positions on one token share its sums
        positions = {"add_to": 1, "add_row_to": 1, "add_batch_to": batch}.get(op, min(batch, rows))
        projections += positions * min(d.rank for d in members(entry))
    return tuple(np.concatenate(p) for p in zip(*parts))


def make_entry(kind, rng, rank, rows, cols, dtype):
    d = make_delta(rng, rank, rows, cols, dtype, alpha=2.0 * rank, scale=0.75)
    if kind == "delta":
        return d
    other = "float32" if dtype != "float32" else "bfloat16"
    d2 = make_delta(rng, rank + 3, rows, cols, other, alpha=4.0, scale=-1.25, rslora=True)
    return lora.LoraStack([d, d2])


def sweep_params():
    for dim in ("cols", "rows", "rank"):
        for size in (RANKS if dim == "rank" else SIZES):
            yield pytest.param(dim, size, id=f"{dim}={size}")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", ["delta", "stack"])
@pytest.mark.parametrize("dim,size", list(sweep_params()))
def test_accuracy_sweep(dim, size, kind, op, isa, dtype):
    """One dimension swept over 1, 7, 15, 16, 17, 31, 32, 33 and a large odd size, the others
    fixed: every op of a delta and of a stack meets the accuracy rule."""
    dims = dict(BASE, **{dim: size})
    rng = np.random.default_rng([size, len(dim), OPS.index(op), DTYPES.index(dtype), SALT])
    ours, ref, np32 = run_op(
        op, lambda: make_entry(kind, rng, dims["rank"], dims["rows"], dims["cols"], dtype), rng,
        dims["rows"], dims["cols"])
    assert_accurate(ours, ref, np32, f"{kind}.{op} {dims} {isa} {dtype}")


@pytest.mark.parametrize("op", ["add_batch_to", "add_rows_to"])
@pytest.mark.parametrize("dim,size", list(sweep_params()))
def test_bank_accuracy_sweep(dim, size, op, isa, dtype):
    """A bank of a delta, an empty slot, a stack and another delta: every position meets the
    accuracy rule against its own entry's float64 reference."""
    dims = dict(BASE, **{dim: size})
    rank, rows, cols = dims["rank"], dims["rows"], dims["cols"]
    rng = np.random.default_rng([size, len(dim), 7, DTYPES.index(dtype), SALT])
    pooled, total, projections = [], 0, 0
    while total < MIN_OUTPUTS or projections < MIN_PROJECTIONS:
        entries = [make_delta(rng, rank, rows, cols, dtype, alpha=8.0),
                   None,
                   make_entry("stack", rng, rank, rows, cols, dtype),
                   make_delta(rng, max(1, rank // 2), rows, cols, dtype, scale=-0.5)]
        bank = lora.LoraBank(entries)
        n = max(9, math.ceil(64 / (rows if op == "add_batch_to" else cols)))
        aid = rng.integers(-1, len(entries), size=n)
        aid[:2] = [3, -1]
        if op == "add_batch_to":
            x, out = rand(rng, (n, cols)), rand(rng, (n, rows))
            out0 = out.copy()
            assert bank.add_batch_to(x, out, aid) is out
        else:
            ids = rng.integers(0, rows, size=n)
            out = rand(rng, (n, cols))
            out0 = out.copy()
            assert bank.add_rows_to(ids, out, aid) is out
        for b in range(n):
            e = entries[aid[b]] if aid[b] >= 0 else None
            ms = members(e) if e is not None else []
            if op == "add_batch_to":
                ref, np32 = ref_batch(ms, x[b], out0[b])
            else:
                ref, np32 = ref_rows(ms, ids[b], out0[b])
            if not ms:
                assert_same_bits(out[b], out0[b], "adapter -1 / None leaves the row untouched")
            pooled.append((out[b], ref, np32))
            total += out[b].size
            projections += min(d.rank for d in ms) if ms else 0
    ours, ref, np32 = (np.concatenate(p) for p in zip(*pooled))
    assert_accurate(ours, ref, np32, f"bank.{op} {dims}")


@st.composite
def shapes_and_scales(draw):
    rank = draw(st.integers(1, 40))
    rows = draw(st.integers(1, 80))
    cols = draw(st.integers(1, 80))
    batch = draw(st.integers(1, 12))
    scale = draw(st.floats(-4, 4, allow_nan=False).filter(lambda v: abs(v) > 1e-3))
    alpha = draw(st.sampled_from([0.0, 1.0, 16.0, -8.0, 3.0]))
    rslora = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    return rank, rows, cols, batch, scale, alpha, rslora, seed


@given(params=shapes_and_scales(), op=st.sampled_from(OPS), dtype=st.sampled_from(DTYPES))
def test_accuracy_random_shapes(params, op, dtype, isa):
    """Hypothesis: random shapes, scales, alphas, ops and storage dtypes, on every ISA."""
    rank, rows, cols, batch, scale, alpha, rslora, seed = params
    rng = np.random.default_rng(seed)
    ours, ref, np32 = run_op(
        op, lambda: make_delta(rng, rank, rows, cols, dtype, alpha=alpha, scale=scale,
                               rslora=rslora), rng, rows, cols, batch)
    assert_accurate(ours, ref, np32, f"{op} {dtype} rank={rank} [{rows} x {cols}] batch={batch}")


@pytest.mark.parametrize("op,rank,rows,cols,batch", [
    pytest.param("add_to", 256, 1, 40, 1, id="decode-rank256-1x40"),
    pytest.param("add_batch_to", 512, 24, 40, 6, id="prefill-rank512-24x40"),
])
def test_accuracy_high_rank(op, rank, rows, cols, batch, isa):
    """High rank with few outputs, where the sum over the rank dimension dominates the error and
    NumPy sums it in blocks: the rule must still hold (pooled over many deltas, so the verdict is
    not a coin toss; NumPy's error norm is ~1e-6 relative here)."""
    rng = np.random.default_rng([rank, rows, SALT])
    ours, ref, np32 = run_op(op, lambda: make_delta(rng, rank, rows, cols), rng, rows, cols,
                             batch, min_outputs=1000, min_projections=1000)
    assert_accurate(ours, ref, np32, f"{op} rank={rank} [{rows} x {cols}]")


def test_accuracy_large_decode_and_prefill(isa, dtype):
    """The sizes of the benchmark (4096 x 4096 rank 16; a 1024 x 1024 prefill of 64 positions),
    where the threads split the work."""
    rng = np.random.default_rng(11)
    d = make_delta(rng, 16, 4096, 4096, dtype, alpha=32.0)
    ours, ref, np32 = run_op("add_to", lambda: d, rng, 4096, 4096)
    assert_accurate(ours, ref, np32, "decode 4096")
    d = make_delta(rng, 16, 1024, 1024, dtype, alpha=32.0)
    ours, ref, np32 = run_op("add_batch_to", lambda: d, rng, 1024, 1024, batch=64)
    assert_accurate(ours, ref, np32, "prefill 1024")
    ours, ref, np32 = run_op("add_rows_to", lambda: d, rng, 1024, 1024, batch=64)
    assert_accurate(ours, ref, np32, "gather 1024")


@pytest.mark.parametrize("cols", [14336, 28672, 100003])
def test_accuracy_long_rows(cols, isa, dtype):
    """Rows of Llama-3-8B's (14336) and Llama-2-70B's (28672) down projections, and a longer odd
    one: each lane of the projection sums its columns in blocks of LORA_JBLOCK, so its rounding
    error does not grow with the row (one chain a lane put AVX2 and the portable path at 2.1-2.9x
    NumPy's error at these lengths, and every path at 3-5x at 100003)."""
    rng = np.random.default_rng([cols, SALT])
    for op in ("add_to", "add_batch_to"):
        ours, ref, np32 = run_op(op, lambda: make_delta(rng, 16, 64, cols, dtype, alpha=32.0), rng,
                                 64, cols, batch=4)
        assert_accurate(ours, ref, np32, f"{op} [64 x {cols}] rank 16")


def test_large_activations_stay_float32(isa, dtype):
    """x around 1e5 (above float16's 65504): A.x is kept in float32, so the result is finite and
    accurate (llama.cpp's CPU path would round x and A.x to f16 and overflow)."""
    rng = np.random.default_rng(5)
    d = make_delta(rng, 16, 48, 64, dtype)
    x = (1e5 * rng.standard_normal(64)).astype(np.float32)
    x[0] = 1e5
    out = rand(rng, 48)
    out0 = out.copy()
    d.add_to(x, out)
    ref, np32 = ref_batch([d], x, out0)
    assert_accurate(out, ref, np32, "x ~ 1e5")
    xb = np.stack([x, -x])
    outb = np.zeros((2, 48), np.float32)
    d.add_batch_to(xb, outb)
    ref, np32 = ref_batch([d], xb, np.zeros((2, 48), np.float32))
    assert_accurate(outb, ref, np32, "x ~ 1e5, batch")


# ----------------------------------------------------------- row-strided views


def test_fused_qkv_output_written_in_place(isa, dtype):
    """out = qkv[:, :d] of a fused output: written in place, bit-identical to a contiguous out,
    and the k/v columns are untouched."""
    rng = np.random.default_rng(21)
    d_model, cols, batch = 40, 33, 9
    delta = make_delta(rng, 8, d_model, cols, dtype, alpha=16.0)
    x = rand(rng, (batch, cols))
    qkv = rand(rng, (batch, 3 * d_model))
    before = qkv.copy()
    q = qkv[:, :d_model]
    assert not q.flags.c_contiguous
    assert delta.add_batch_to(x, q) is q
    expect = before[:, :d_model].copy()
    delta.add_batch_to(x, expect)
    assert_same_bits(qkv[:, :d_model], expect, "q columns")
    assert_same_bits(qkv[:, d_model:], before[:, d_model:], "k/v columns untouched")
    # the middle (k) slice too
    qkv2 = before.copy()
    delta.add_batch_to(x, qkv2[:, d_model:2 * d_model])
    expect = before[:, d_model:2 * d_model].copy()
    delta.add_batch_to(x, expect)
    assert_same_bits(qkv2[:, d_model:2 * d_model], expect, "k columns")
    assert_same_bits(qkv2[:, :d_model], before[:, :d_model], "q untouched")
    assert_same_bits(qkv2[:, 2 * d_model:], before[:, 2 * d_model:], "v untouched")


def test_row_strided_x_and_out_everywhere(isa, dtype):
    """Row-strided x (a column slice of a bigger activation) and row-strided out for every
    batched op of a delta, a stack and a bank: bit-identical to contiguous copies."""
    rng = np.random.default_rng(22)
    rows, cols, n = 24, 17, 7
    d1 = make_delta(rng, 5, rows, cols, dtype, alpha=10.0)
    d2 = make_delta(rng, 3, rows, cols, dtype)
    stack = lora.LoraStack([d1, d2])
    bank = lora.LoraBank([d1, stack, None])
    aid = np.array([1, 0, -1, 2, 1, 0, 1])
    big_x = rand(rng, (n, cols + 11))
    x = big_x[:, 3:3 + cols]
    assert not x.flags.c_contiguous and x.strides[1] == 4
    xc = np.ascontiguousarray(x)
    ids = rng.integers(0, rows, size=n)
    calls = [
        (lambda e, xx, o: e.add_batch_to(xx, o), [d1, stack], rows),
        (lambda e, xx, o: e.add_rows_to(ids, o), [d1, stack], cols),
        (lambda e, xx, o: bank.add_batch_to(xx, o, aid), [bank], rows),
        (lambda e, xx, o: bank.add_rows_to(ids, o, aid), [bank], cols),
    ]
    for fn, entries, width in calls:
        for e in entries:
            wide = rand(rng, (n, width + 9))
            before = wide.copy()
            fn(e, x, wide[:, 4:4 + width])
            expect = before[:, 4:4 + width].copy()
            fn(e, xc, expect)
            assert_same_bits(wide[:, 4:4 + width], expect, "strided out")
            assert_same_bits(wide[:, :4], before[:, :4], "left columns untouched")
            assert_same_bits(wide[:, 4 + width:], before[:, 4 + width:], "right columns untouched")


# ------------------------------------------------------------ accepted inputs


def _x_variants(x32):
    """Other real-float forms of x32 holding the very same values."""
    out = {"float64": x32.astype(np.float64), "list": x32.tolist()}
    if np.all(x32.astype(np.float16).astype(np.float32) == x32):
        out["float16"] = x32.astype(np.float16)
    if BF16 is not None and np.all(x32.astype(BF16).astype(np.float32) == x32):
        out["bfloat16"] = x32.astype(BF16)
    out[">f4"] = x32.astype(">f4")
    return out


def test_x_conversions_give_the_float32_bits(isa, dtype):
    """x as float64, float16, bfloat16, a list, big-endian float32, a strided 1-D view or an
    F-order 2-D array is converted: the result is bit-identical to float32 C-contiguous x."""
    rng = np.random.default_rng(3)
    rows, cols, n = 20, 18, 5
    d = make_delta(rng, 6, rows, cols, dtype)
    # values exact in float16 and bfloat16, so every variant holds the same numbers
    x = (rng.integers(-64, 64, size=(n, cols)) / 16).astype(np.float32)
    out0 = rand(rng, (n, rows))
    expect1 = out0[0].copy()
    d.add_to(x[0], expect1)
    expect2 = out0.copy()
    d.add_batch_to(x, expect2)
    for name, xv in _x_variants(x[0]).items():
        o = out0[0].copy()
        d.add_to(xv, o)
        assert_same_bits(o, expect1, f"add_to x {name}")
    for name, xv in _x_variants(x).items():
        o = out0.copy()
        d.add_batch_to(xv, o)
        assert_same_bits(o, expect2, f"add_batch_to x {name}")
    strided = np.zeros(2 * cols, np.float32)
    strided[::2] = x[0]
    o = out0[0].copy()
    d.add_to(strided[::2], o)
    assert_same_bits(o, expect1, "1-D strided x")
    o = out0.copy()
    d.add_batch_to(np.asfortranarray(x), o)
    assert_same_bits(o, expect2, "F-order x")
    o = out0.copy()
    d.add_batch_to(np.asfortranarray(x.astype(np.float64)), o)
    assert_same_bits(o, expect2, "F-order float64 x")
    o = out0.copy()
    d.add_batch_to(x[::-1][::-1], o)
    assert_same_bits(o, expect2, "reversed-twice view")
    o = out0[::-1].copy()
    d.add_batch_to(x[::-1], o)
    assert_same_bits(o[::-1], expect2, "negative-stride x")


def test_ids_accept_any_integer_array_like(isa):
    rng = np.random.default_rng(4)
    d = make_delta(rng, 4, 30, 12)
    ids = np.array([3, 0, 29, 3])
    expect = np.zeros((4, 12), np.float32)
    d.add_rows_to(ids, expect)
    for form in (ids.tolist(), ids.astype(np.int8), ids.astype(np.uint16), ids.astype(np.int32),
                 ids.astype(np.uint64), np.repeat(ids, 2)[::2], tuple(ids.tolist())):
        o = np.zeros((4, 12), np.float32)
        d.add_rows_to(form, o)
        assert_same_bits(o, expect, f"ids {type(form).__name__} {getattr(form, 'dtype', '')}")
    o = np.zeros(12, np.float32)
    for r in (np.int64(29), np.uint8(29), 29):
        o[:] = 0
        d.add_row_to(r, o)
        assert_same_bits(o, expect[2], f"row id {type(r).__name__}")


# --------------------------------------------------------------------- API


def test_delta_properties(dtype):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((4, 10)), rng.standard_normal((7, 4))
    s = lora.LoraScale(0.5)
    d = lora.LoraDelta(a, b, alpha=8.0, scale=s, base_shape=(7, 10), dtype=dtype)
    assert (d.rank, d.rows, d.cols, d.alpha, d.dtype) == (4, 7, 10, 8.0, dtype)
    assert d.scale is s
    assert d.effective_scale == 0.5 * 8.0 / 4
    assert d.resident_bytes == 4 * (7 + 10) * (4 if dtype == "float32" else 2)
    f = lora.LoraDelta.from_flat(a.ravel(), b.ravel(), 4, 7, 10, alpha=8.0, scale=s, dtype=dtype)
    for x, y in zip(d.lora_weights(), f.lora_weights()):
        assert x.tobytes() == y.tobytes()
    x = rng.standard_normal(10).astype(np.float32)
    o1, o2 = np.zeros(7, np.float32), np.zeros(7, np.float32)
    d.add_to(x, o1)
    f.add_to(x, o2)
    assert_same_bits(o1, o2, "from_flat == 2-D constructor")


def test_weights_are_copied(dtype):
    """The delta owns its storage: mutating the caller's arrays afterwards changes nothing."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((3, 9)).astype(np.float32)
    b = rng.standard_normal((5, 3)).astype(np.float32)
    d = lora.LoraDelta(a, b, dtype=dtype)
    x = rng.standard_normal(9).astype(np.float32)
    o1 = np.zeros(5, np.float32)
    d.add_to(x, o1)
    a[:] = 100
    b[:] = -100
    o2 = np.zeros(5, np.float32)
    d.add_to(x, o2)
    assert_same_bits(o1, o2, "after mutating the inputs")


def test_delta_weight_merge_unmerge(isa, dtype):
    rng = np.random.default_rng(6)
    d = make_delta(rng, 6, 20, 14, dtype, alpha=12.0, scale=0.7)
    a64, b64 = (w.astype(np.float64) for w in d.lora_weights())
    dw64 = d.effective_scale * b64 @ a64
    dw = d.delta_weight()
    assert dw.dtype == np.float32 and dw.shape == (20, 14)
    np.testing.assert_allclose(dw, dw64, rtol=1e-6, atol=1e-6 * np.abs(dw64).max())
    w = rand(rng, (20, 14))
    w0 = w.copy()
    assert d.merge_into(w) is w
    np.testing.assert_allclose(w, w0 + dw64, rtol=1e-6, atol=1e-6 * np.abs(w0 + dw64).max())
    assert d.unmerge_from(w) is w
    np.testing.assert_allclose(w, w0, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(w0).max())
    # fan_in_fan_out: the base is the transposed view of a C-contiguous [cols, rows] array
    wt = np.ascontiguousarray(w0.T)
    d.merge_into(wt.T)
    np.testing.assert_allclose(wt.T, w0 + dw64, rtol=1e-6, atol=1e-6 * np.abs(w0 + dw64).max())
    # merged weights reproduce the delta: (W + dW) x == W x + delta(x) within tolerance
    x = rand(rng, 14)
    y = (w0 @ x).astype(np.float32)
    d.add_to(x, y)
    np.testing.assert_allclose(y, (w0.astype(np.float64) + dw64) @ x, rtol=1e-4, atol=1e-4)


def test_stack_api():
    rng = np.random.default_rng(8)
    d1 = make_delta(rng, 4, 10, 6)
    d2 = make_delta(rng, 2, 10, 6, "bfloat16")
    st_ = lora.LoraStack([d1])
    st_.append(d2)
    assert len(st_) == 2 and st_[0] is d1 and st_[1] is d2 and list(st_) == [d1, d2]
    assert st_.resident_bytes == d1.resident_bytes + d2.resident_bytes
    st_.append(d1)  # the same delta twice is applied twice, but resides once
    assert len(st_) == 3 and st_.resident_bytes == d1.resident_bytes + d2.resident_bytes
    empty = lora.LoraStack()
    assert len(empty) == 0 and list(empty) == []
    for call in (lambda o: empty.add_to(rand(rng, 6), o),):
        o = rand(rng, 10)
        before = o.tobytes()
        assert call(o) is o and o.tobytes() == before
    o = rand(rng, (3, 10))
    before = o.tobytes()
    assert empty.add_batch_to(rand(rng, (3, 6)), o) is o and o.tobytes() == before
    o = rand(rng, 6)
    before = o.tobytes()
    assert empty.add_row_to(2, o) is o and o.tobytes() == before
    o = rand(rng, (2, 6))
    before = o.tobytes()
    assert empty.add_rows_to([1, 2], o) is o and o.tobytes() == before


def test_stack_merge_matches_delta_weight():
    rng = np.random.default_rng(9)
    ds = [make_delta(rng, r, 12, 9, dt, alpha=4.0) for r, dt in ((3, "float32"), (5, "float16"))]
    stack = lora.LoraStack(ds)
    total = sum(d.delta_weight().astype(np.float64) for d in ds)
    np.testing.assert_allclose(stack.delta_weight(), total, rtol=1e-6, atol=1e-6)
    w = rand(rng, (12, 9))
    w0 = w.copy()
    stack.merge_into(w)
    np.testing.assert_allclose(w, w0 + total, rtol=1e-5, atol=1e-5)
    stack.unmerge_from(w)
    np.testing.assert_allclose(w, w0, rtol=0, atol=1e-5)
