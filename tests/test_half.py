"""float16 / bfloat16 storage (the storage-dtype rules of docs/api.md): round-to-nearest-even on
construction (no double rounding through float32), overflow refused, resident bytes halved,
float32 compute (activations above 65504 stay finite), results equal to the float32 path on the
same rounded weights within tolerance.  The per-dtype guarantees (determinism, threads, batch
invariance, zero scale, contract, every ISA) run in the other files, parametrized by dtype."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lora
from conftest import (assert_accurate, assert_same_bits, make_delta, rand, ref_batch, ref_rows,
                      weights32)

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


def stored(values, dtype):
    """The values as a delta stores them (A = values as one row; B = ones)."""
    v = np.asarray(values, np.float64).reshape(1, -1)
    d = lora.LoraDelta(v, np.ones((1, 1)), dtype=dtype)
    a, _ = d.lora_weights()
    assert a.dtype == (np.float16 if dtype == "float16" else BF16)
    return a.reshape(-1)


def rne_bf16(x):
    """Correct round-to-nearest-even of float64 values to bfloat16 (8 significant bits), by
    integer arithmetic on the float64 bits (normal range only), returned as bfloat16."""
    x = np.asarray(x, np.float64)
    bits = x.view(np.uint64).copy()
    drop = np.uint64(52 - 7)
    lsb = (bits >> drop) & np.uint64(1)
    bits += (np.uint64(1) << (drop - np.uint64(1))) - np.uint64(1) + lsb
    bits &= ~((np.uint64(1) << drop) - np.uint64(1))
    rounded = bits.view(np.float64)
    out = rounded.astype(BF16)          # exact: `rounded` has 8 significant bits
    assert np.all(out.astype(np.float64) == rounded)
    return out


# ------------------------------------------------------------- rounding


def test_float16_rounds_float64_to_nearest_even_directly():
    one = 1.0
    cases = {
        one + 2**-11: one,                      # a tie: to even (down)
        one + 3 * 2**-11: one + 2**-9,          # a tie: to even (up)
        one + 2**-11 + 2**-40: one + 2**-10,    # just above a tie: up (float32 first would tie)
        one + 2**-11 - 2**-40: one,             # just below a tie: down
        65519.0: 65504.0,                       # below the overflow midpoint
        -(one + 2**-11 + 2**-40): -(one + 2**-10),
        2**-24: 2**-24,                         # smallest subnormal
        2**-25 + 2**-40: 2**-24,                # above half the smallest subnormal: up
        2**-25: 0.0,                            # exactly half: to even (0)
    }
    got = stored(list(cases), "float16").astype(np.float64)
    assert got.tolist() == list(cases.values())


def test_float16_matches_numpy_rounding_on_random_values():
    rng = np.random.default_rng(1)
    v = rng.standard_normal(20000) * np.exp2(rng.integers(-20, 15, 20000))
    # plant near-ties: float16 ties +- a float64 ulp-ish nudge
    base = rng.standard_normal(2000).astype(np.float16).astype(np.float64)
    half_ulp = np.spacing(base.astype(np.float16)).astype(np.float64) / 2
    v = np.concatenate([v, base + half_ulp, base - half_ulp, base + half_ulp * (1 + 2**-30),
                        base + half_ulp * (1 - 2**-30)])
    v = v[np.abs(v) < 65504]
    got = stored(v, "float16")
    assert got.tobytes() == v.astype(np.float16).tobytes()


def test_bfloat16_rounds_float64_to_nearest_even_directly():
    one = 1.0
    cases = {
        one + 2**-8 + 2**-30: one + 2**-7,      # float32 first would make it a tie -> 1.0
        one + 2**-8: one,                       # a tie: to even (down)
        one + 3 * 2**-8: one + 2**-6,           # a tie: to even (up)
        one + 2**-8 - 2**-30: one,
        -(one + 2**-8 + 2**-40): -(one + 2**-7),
        3.0 + 2**-7 + 2**-35: 3.0 + 2**-6,
    }
    got = stored(list(cases), "bfloat16").astype(np.float64)
    assert got.tolist() == list(cases.values())


def test_bfloat16_matches_a_correct_rne_on_random_values():
    rng = np.random.default_rng(2)
    v = rng.standard_normal(20000) * np.exp2(rng.integers(-60, 60, 20000))
    base = rne_bf16(rng.standard_normal(2000)).astype(np.float64)
    ulp = np.abs(base) * 2.0**-7
    half = np.exp2(np.floor(np.log2(np.abs(base)))) * 2.0**-8   # half a bf16 ulp
    v = np.concatenate([v, base + half, base - half, base + half * (1 + 2**-30),
                        base + half * (1 - 2**-30), base + half + 2**-40 * ulp])
    got = stored(v, "bfloat16")
    assert got.tobytes() == rne_bf16(v).tobytes()


@given(st.lists(st.floats(-1e30, 1e30, allow_nan=False, allow_infinity=False)
                .filter(lambda f: f == 0 or 1e-30 < abs(f)), min_size=1, max_size=50))
def test_bfloat16_rne_hypothesis(values):
    assert stored(values, "bfloat16").tobytes() == rne_bf16(values).tobytes()


@given(st.lists(st.floats(-65000, 65000, allow_nan=False), min_size=1, max_size=50))
def test_float16_rne_hypothesis(values):
    assert stored(values, "float16").tobytes() == np.asarray(values).astype(np.float16).tobytes()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_inputs_already_in_the_storage_dtype_are_exact(dtype):
    rng = np.random.default_rng(3)
    np_dt = np.float16 if dtype == "float16" else BF16
    a = rng.standard_normal((4, 9)).astype(np_dt)
    b = rng.standard_normal((5, 4)).astype(np_dt)
    d = lora.LoraDelta(a, b, dtype=dtype)
    sa, sb = d.lora_weights()
    assert sa.tobytes() == a.tobytes() and sb.tobytes() == b.tobytes()
    # float32 and float64 copies of the same values store the same bits
    for conv in (np.float32, np.float64):
        d2 = lora.LoraDelta(a.astype(conv), b.astype(conv), dtype=dtype)
        assert d2.lora_weights()[0].tobytes() == a.tobytes()
    # and a half-precision input to a float32 delta is widened exactly
    d3 = lora.LoraDelta(a, b)
    assert np.all(d3.lora_weights()[0] == a.astype(np.float32))


def test_float32_storage_rounds_float64_to_nearest_even():
    v = np.array([1 + 2**-24, 1 + 3 * 2**-24, 1 + 2**-24 + 2**-50, 0.1])
    got = stored_f32 = lora.LoraDelta(v.reshape(1, -1), np.ones((1, 1))).lora_weights()[0]
    assert stored_f32.dtype == np.float32
    assert got.reshape(-1).tobytes() == v.astype(np.float32).tobytes()


# ------------------------------------------------------------- overflow


def test_overflow_refused_and_edges_accepted():
    with pytest.raises(ValueError, match="float16"):
        lora.LoraDelta(np.full((1, 2), 70000.0), np.ones((1, 1)), dtype="float16")
    with pytest.raises(ValueError, match="float16"):
        lora.LoraDelta(np.ones((1, 2)), np.full((1, 1), -65520.0), dtype="float16")
    with pytest.raises(ValueError, match="bfloat16"):
        lora.LoraDelta(np.full((1, 2), 3.4e38), np.ones((1, 1)), dtype="bfloat16")
    with pytest.raises(ValueError, match="float16"):
        lora.LoraDelta(np.full((1, 2), 70000.0, np.float32), np.ones((1, 1)), dtype="float16")
    assert lora.LoraDelta(np.full((1, 2), -65504.0), np.ones((1, 1)), dtype="float16")
    big = float(ml_dtypes.finfo(BF16).max)
    d = lora.LoraDelta(np.full((1, 2), big), np.ones((1, 1)), dtype="bfloat16")
    assert d.lora_weights()[0].astype(np.float64).max() == big


# ----------------------------------------------------------- properties


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_resident_bytes_halve(dtype):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((16, 1001)), rng.standard_normal((333, 16))
    full = lora.LoraDelta(a, b)
    half = lora.LoraDelta(a, b, dtype=dtype)
    assert full.resident_bytes == 16 * (333 + 1001) * 4
    assert half.resident_bytes * 2 == full.resident_bytes
    assert half.dtype == dtype and full.dtype == "float32"
    assert isinstance(half.dtype, str)
    mixed = lora.LoraStack([full, half])
    assert mixed.resident_bytes == full.resident_bytes + half.resident_bytes


# ----------------------------------------------------------- compute


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_equals_float32_path_on_the_rounded_weights(isa, dtype):
    """A half-precision delta computes in float32 on its rounded weights: its result and the one
    of a float32 delta built from those rounded weights both meet the accuracy rule and are
    within float32 tolerance of each other (the same values, summed in the same order)."""
    rng = np.random.default_rng(5)
    for rank, rows, cols in ((16, 257, 1001), (7, 33, 17), (1, 1, 1), (64, 16, 64)):
        half = make_delta(rng, rank, rows, cols, dtype, alpha=3.0 * rank)
        a32, b32 = weights32(half)
        full = lora.LoraDelta(a32, b32, alpha=3.0 * rank)
        n = 6
        x, ids = rand(rng, (n, cols)), rng.integers(0, rows, n)
        for op, arg, shape in (("add_to", x[0], (rows,)), ("add_batch_to", x, (n, rows)),
                               ("add_row_to", int(ids[0]), (cols,)),
                               ("add_rows_to", ids, (n, cols))):
            out0 = rand(rng, shape)
            got_h = getattr(half, op)(arg, out0.copy())
            got_f = getattr(full, op)(arg, out0.copy())
            ref, np32 = (ref_batch if op in ("add_to", "add_batch_to") else ref_rows)(
                [half], arg, out0)
            np.testing.assert_allclose(got_h, got_f, rtol=1e-5,
                                       atol=1e-5 * max(1.0, float(np.abs(ref).max())))
            if rows * cols > 100:
                assert_accurate(got_h, ref, np32, f"{dtype} {op}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_activations_above_float16_range(isa, dtype):
    """x up to 1e5 (float16 tops out at 65504) and A.x far beyond it: finite results equal to the
    float32 path on the same rounded weights, within tolerance."""
    rng = np.random.default_rng(6)
    rank, rows, cols = 16, 64, 256
    half = make_delta(rng, rank, rows, cols, dtype)
    full = lora.LoraDelta(*weights32(half))
    x = (1e5 * rng.standard_normal((5, cols))).astype(np.float32)
    x[:, 0] = 1e5
    x[1] = 1e5          # every activation 1e5: A.x ~ 1e5 * sqrt(cols) * ...
    out0 = rand(rng, (5, rows))
    got = half.add_batch_to(x, out0.copy())
    assert np.all(np.isfinite(got))
    ref, np32 = ref_batch([half], x, out0)
    assert_accurate(got, ref, np32, f"{dtype} x ~ 1e5")
    np.testing.assert_allclose(got, full.add_batch_to(x, out0.copy()), rtol=1e-5,
                               atol=1e-5 * float(np.abs(ref).max()))
    one = half.add_to(x[1], out0[1].copy())
    assert np.all(np.isfinite(one)) and np.abs(one).max() > 65504
    assert_same_bits(one, got[1], "batch row vs add_to")
