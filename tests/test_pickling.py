"""Pickling and copies by value of every adapter kind: LoraDelta, LoraStack, LoraBank,
LoraAdapter, AdapterSet (LoraExperts: tests/test_experts.py; DoraDelta: tests/test_dora.py;
corrupt payloads of all three here).  Round trips are bit-exact (the stored factors and every
output), a LoraScale shared within one pickle stays shared,
``copy.copy`` shares storage and LoraScale, ``copy.deepcopy`` owns new ones."""

import copy
import pickle

import numpy as np
import pytest

import lora
from lora.kinds.adapter_set import AdapterSet

from conftest import DTYPES, assert_same_bits, make_delta, rand


def same_delta(got, want):
    """Equal by value: stored bits, dtype, alpha, rsLoRA, alpha factor and scale value."""
    for g, w in zip(got.lora_weights(), want.lora_weights()):
        assert_same_bits(g, w, "stored factors")
    assert (got.dtype, got.alpha, got.rslora, got._alpha_factor) == \
        (want.dtype, want.alpha, want.rslora, want._alpha_factor)
    assert got.scale.value == want.scale.value
    assert got.effective_scale == want.effective_scale


def roundtrip(obj):
    return pickle.loads(pickle.dumps(obj))


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_round_trip_is_bit_exact(dtype):
    rng = np.random.default_rng(0)
    for rank, rows, cols, alpha, rslora in ((1, 7, 15, 0.0, False), (17, 33, 16, 8.0, True),
                                            (4, 1, 1, 3.0, False)):
        d = make_delta(rng, rank, rows, cols, dtype, alpha=alpha, scale=-0.7, rslora=rslora)
        r = roundtrip(d)
        same_delta(r, d)
        x = rand(rng, (5, cols))
        out0 = rand(rng, (5, rows))
        assert_same_bits(r.add_batch_to(x, out0.copy()), d.add_batch_to(x, out0.copy()))
        assert_same_bits(r.add_to(x[0], out0[0].copy()), d.add_to(x[0], out0[0].copy()))
        assert r.scale is not d.scale
        r.scale.set(2.0)  # the copy's scale is its own
        assert d.scale.value == -0.7


def test_peft_alpha_zero_rule_survives_a_pickle():
    from lora.kinds.delta import peft_delta

    rng = np.random.default_rng(1)
    d = peft_delta(rng.standard_normal((2, 3)), rng.standard_normal((4, 2)), alpha=0.0)
    assert d.effective_scale == 0.0
    assert roundtrip(d).effective_scale == 0.0 and copy.deepcopy(d).effective_scale == 0.0


def test_a_view_over_caller_memory_pickles_its_values():
    rng = np.random.default_rng(2)
    a = rand(rng, (3, 8))
    b = rand(rng, (5, 3))
    view = lora.LoraDelta.view((a.ctypes.data, 8), (b.ctypes.data, 3), dtype="float32", rank=3,
                               rows=5, cols=8, b_by_row=True, scale=0.5, alpha_factor=2.0,
                               keep=(a, b))
    data = pickle.dumps(view)
    deep = copy.deepcopy(view)
    want_a, want_b = a.copy(), b.copy()
    a[:] = 0.0  # the caller's memory changes after the pickle was made
    b[:] = 0.0
    r = pickle.loads(data)
    for got in (r, deep):
        ga, gb = got.lora_weights()
        assert_same_bits(ga, want_a)
        assert_same_bits(gb, want_b)
        assert got.effective_scale == 1.0 and got._keep is None
    x = rand(rng, (8,))
    want = np.float32(0.5 * 2.0) * (want_b.astype(np.float64) @ (want_a.astype(np.float64) @ x))
    np.testing.assert_allclose(r.add_to(x, np.zeros(5, np.float32)), want, rtol=1e-5)


def test_shared_scales_and_deltas_stay_shared_within_one_pickle():
    rng = np.random.default_rng(3)
    s = lora.LoraScale(0.25)
    d1 = make_delta(rng, 4, 6, 9, scale=s)
    d2 = make_delta(rng, 2, 6, 9, "bfloat16", alpha=4.0, scale=s)
    stack = lora.LoraStack([d1, d2, d1])
    bank = lora.LoraBank([stack, None, d2])
    for load in (roundtrip, copy.deepcopy):
        r_stack, r_bank, r_s, r_d1 = load([stack, bank, s, d1])
        assert r_stack[0] is r_d1 and r_stack[2] is r_d1 and r_bank[0] is r_stack
        assert r_bank[2] is r_stack[1] and r_bank[1] is None
        assert r_d1.scale is r_s and r_stack[1].scale is r_s and r_s is not s
        x = rand(rng, (4, 9))
        out0 = rand(rng, (4, 6))
        ids = np.array([0, 2, -1, 0])
        assert_same_bits(r_stack.add_batch_to(x, out0.copy()), stack.add_batch_to(x, out0.copy()))
        assert_same_bits(r_bank.add_batch_to(x, out0.copy(), ids),
                         bank.add_batch_to(x, out0.copy(), ids))
        r_s.set(1.5)  # one set rescales every copied delta, not the originals
        assert r_stack[1].scale.value == 1.5 and s.value == 0.25


def test_copy_shares_storage_and_scale_deepcopy_owns_new_ones():
    rng = np.random.default_rng(4)
    d = make_delta(rng, 3, 5, 7, "float16", alpha=6.0, scale=0.5)
    c = copy.copy(d)
    assert c is not d and c._ptr is d._ptr and c.scale is d.scale
    dc = copy.deepcopy(d)
    assert dc._ptr is not d._ptr and dc.scale is not d.scale
    same_delta(dc, d)
    stack = lora.LoraStack([d])
    sc = copy.copy(stack)
    sc.append(make_delta(rng, 2, 5, 7))  # a shallow copy is a new container
    assert len(stack) == 1 and len(sc) == 2 and sc[0] is d
    x = rand(rng, (7,))
    assert_same_bits(stack.add_to(x, np.zeros(5, np.float32)), d.add_to(x, np.zeros(5, np.float32)))
    deep = copy.deepcopy(stack)
    assert deep[0] is not d and deep[0].scale is not d.scale
    bank = lora.LoraBank([d, None])
    bc = copy.copy(bank)
    assert bc is not bank and bc[0] is d
    s = lora.LoraScale(3.0)
    assert copy.copy(s) is not s and copy.copy(s).value == 3.0


def adapter(rng, name, scale=1.0, tokens=None, dtype="float32"):
    s = lora.LoraScale(scale)
    deltas = {"q": make_delta(rng, 4, 8, 6, dtype, alpha=8.0, scale=s),
              "v": make_delta(rng, 2, 5, 6, dtype, alpha=1.0, rslora=True, scale=s)}
    return lora.LoraAdapter(deltas, name=name, alpha=8.0, scale=s, invocation_tokens=tokens)


def test_lora_adapter_round_trip():
    rng = np.random.default_rng(5)
    for dtype in DTYPES:
        ad = adapter(rng, "sql", 0.75, tokens=[3, 9, 2**40], dtype=dtype)
        ad._peft_zero_alpha = frozenset({"v"})
        for r in (roundtrip(ad), copy.deepcopy(ad)):
            assert list(r) == list(ad) and r.name == "sql" and r.alpha == 8.0
            assert r.invocation_tokens == (3, 9, 2**40) and r.dtype == dtype
            assert r._peft_zero_alpha == {"v"}
            assert r.scale is not ad.scale and all(r[k].scale is r.scale for k in r)
            for k in ad:
                same_delta(r[k], ad[k])
        c = copy.copy(ad)
        assert c is not ad and c.scale is ad.scale and all(c[k] is ad[k] for k in ad)


def test_adapter_set_round_trip_keeps_slots():
    rng = np.random.default_rng(6)
    aset = AdapterSet({"a": adapter(rng, "a", 0.5), "b": adapter(rng, "b", 2.0),
                       "c": adapter(rng, "c", -1.0)})
    aset.remove("b")  # a free slot in the middle: slot ids must keep their meaning
    x = rand(rng, (6, 6))
    out0 = rand(rng, (6, 8))
    ids = np.array([0, 2, -1, 2, 0, 0])
    want = aset.bank("q").add_batch_to(x, out0.copy(), ids)
    for r in (roundtrip(aset), copy.deepcopy(aset)):
        assert r.names == ["a", "c"] and r.slot("c") == 2
        assert r["a"].scale is not aset["a"].scale
        assert_same_bits(r.bank("q").add_batch_to(x, out0.copy(), ids), want)
        with pytest.raises(IndexError, match="free slot"):
            r.bank("q").add_batch_to(x, out0.copy(), np.array([1, 0, 0, 0, 0, 0]))
        assert r.add("d", adapter(rng, "d")) == 1
    c = copy.copy(aset)
    assert c["a"] is aset["a"] and c.slot("c") == 2
    c.remove("a")  # a shallow copy changes independently
    assert "a" in aset and "a" not in c


def test_corrupt_pickled_factors_are_refused():
    from lora.kinds.delta import LoraDelta, _restore

    rng = np.random.default_rng(7)
    d = make_delta(rng, 3, 4, 5)
    fn, args = d.__reduce__()
    assert fn is _restore
    a, b = args[:2]
    for bad in ((a[:2], b), (a, b[:, :2]), (a.astype(np.uint16), b), (a[None], b),
                (a.view(np.float32), b), (a[:, :0], b)):
        with pytest.raises(ValueError, match="stored factors"):
            fn(*bad, *args[2:])
    with pytest.raises(TypeError):
        fn(a, b, "float32", 0.0, False, 1.0, 0.5)  # a scale that is not a LoraScale
    assert isinstance(fn(*args), LoraDelta)


@pytest.mark.parametrize("dtype", DTYPES)
def test_corrupt_pickled_non_finite_values_are_refused(dtype):
    """A pickle is checked as the constructors check: NaN / inf bits in the stored factors of a
    delta or of routed experts, or in a DoRA delta's statistics, are refused at load."""
    rng = np.random.default_rng(8)
    d = lora.LoraDelta(rng.standard_normal((3, 6)), rng.standard_normal((5, 3)), dtype=dtype)
    fn, args = d.__reduce__()
    nan_bits = np.array([np.nan], lora._dtypes.BY_NAME[dtype].numpy).view(args[0].dtype)[0]
    for which in (0, 1):
        bad = list(args)
        bad[which] = bad[which].copy()
        bad[which].flat[1] = nan_bits
        with pytest.raises(ValueError, match="non-finite"):
            fn(*bad)
    ex = lora.LoraExperts(rng.standard_normal((2, 3, 6)), rng.standard_normal((2, 5, 3)),
                          dtype=dtype)
    fn, args = ex.__reduce__()
    bad = list(args)
    bad[1] = bad[1].copy()
    bad[1].flat[0] = nan_bits
    with pytest.raises(ValueError, match="non-finite"):
        fn(*bad)
    w = rng.standard_normal((5, 6))
    dd = lora.DoraDelta(rng.standard_normal((3, 6)), rng.standard_normal((5, 3)), np.ones(5), w,
                        dtype=dtype)
    fn, args = dd.__reduce__()
    for which in (2, 3, 4):  # sq, vp, gram
        bad = list(args)
        bad[which] = np.array(bad[which], dtype=np.float64)
        bad[which].flat[0] = np.nan
        with pytest.raises(ValueError, match="non-finite"):
            fn(*bad)
    assert isinstance(fn(*args), lora.DoraDelta)
