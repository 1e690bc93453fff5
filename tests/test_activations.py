"""Half-precision activations and leading dimensions, for every op, ISA path and storage dtype.

The rule under test: compute stays float32.  A float16/bfloat16 `x` is widened exactly, so it
gives the bits of its float32 copy; a float16/bfloat16 `out` gets, element by element, the float32
value a float32 `out` holding the same values would get, rounded once to nearest even:

    add_batch_to(x, out_h)  ==  o = out_h.astype(float32); add_batch_to(x, o); o.astype(out_h.dtype)

bit for bit (stacks: the whole stack applied to the float32 copy, then one rounding).  Leading
dimensions: ``[batch, seq, hidden]`` is ``batch * seq`` positions in C order.
"""

import numpy as np
import pytest

import lora
from conftest import assert_same_bits, make_delta, num_threads, rand, ref_batch
from test_half import rne_bf16

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
ACT = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
ACT_NAMES = list(ACT)
ROWS, COLS = 37, 53


def _act(rng, shape, name, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(ACT[name])


def _entries(rng, dtype):
    """A delta, a stack with a zero-scale member in the middle, and a bank over both."""
    d1 = make_delta(rng, 5, ROWS, COLS, dtype, alpha=3.0)
    d2 = make_delta(rng, 17, ROWS, COLS, dtype, scale=0.0)
    d3 = make_delta(rng, 2, ROWS, COLS, "float32", alpha=1.0, scale=-0.7)
    stack = lora.LoraStack([d1, d2, d3])
    return d1, stack, lora.LoraBank([d1, None, stack])


def _via_float32(call, out_h):
    """The identity's right-hand side: run `call` on a float32 copy, round once."""
    o = out_h.astype(np.float32)
    call(o)
    return o.astype(out_h.dtype)


@pytest.mark.parametrize("xdt", ACT_NAMES)
@pytest.mark.parametrize("odt", ACT_NAMES)
def test_batch_ops_equal_the_float32_path_rounded_once(xdt, odt, isa, dtype):
    rng = np.random.default_rng(1)
    d, stack, bank = _entries(rng, dtype)
    n = 9
    x = _act(rng, (n, COLS), xdt)
    x32 = x.astype(np.float32)
    out = _act(rng, (n, ROWS), odt, 4.0)
    aids = np.array([0, -1, 2, 2, 0, 1, 2, -1, 0])
    cases = {
        "delta": (lambda o, xx: d.add_batch_to(xx, o)),
        "stack": (lambda o, xx: stack.add_batch_to(xx, o)),
        "bank": (lambda o, xx: bank.add_batch_to(xx, o, aids)),
        "bank scales": (lambda o, xx: bank.add_batch_to(xx, o, aids,
                                                        np.linspace(-2, 2, n))),
    }
    for name, call in cases.items():
        got = out.copy()
        assert call(got, x) is got
        want = _via_float32(lambda o: call(o, x32), out)
        assert_same_bits(got.view(np.uint8), want.view(np.uint8), f"{name} x={xdt} out={odt}")


@pytest.mark.parametrize("xdt", ACT_NAMES)
@pytest.mark.parametrize("odt", ACT_NAMES)
def test_decode_equals_the_float32_path_rounded_once(xdt, odt, isa, dtype):
    rng = np.random.default_rng(2)
    d, stack, _ = _entries(rng, dtype)
    x = _act(rng, COLS, xdt)
    out = _act(rng, ROWS, odt, 4.0)
    for obj in (d, stack):
        got = out.copy()
        obj.add_to(x, got)
        want = _via_float32(lambda o: obj.add_to(x.astype(np.float32), o), out)
        assert_same_bits(got.view(np.uint8), want.view(np.uint8), f"x={xdt} out={odt}")


@pytest.mark.parametrize("odt", ACT_NAMES)
def test_gathers_equal_the_float32_path_rounded_once(odt, isa, dtype):
    rng = np.random.default_rng(3)
    d, stack, bank = _entries(rng, dtype)
    ids = rng.integers(0, ROWS, (2, 5))
    aids = np.array([[0, 2, -1, 2, 0], [2, 2, 0, -1, 0]])
    out = _act(rng, (2, 5, COLS), odt, 4.0)
    for name, call in {"delta": lambda o: d.add_rows_to(ids, o),
                       "stack": lambda o: stack.add_rows_to(ids, o),
                       "bank": lambda o: bank.add_rows_to(ids, o, aids, np.full((2, 5), 0.5))}.items():
        got = out.copy()
        call(got)
        assert_same_bits(got.view(np.uint8), _via_float32(call, out).view(np.uint8), name)
    row = _act(rng, COLS, odt)
    for obj in (d, stack):
        got = row.copy()
        obj.add_row_to(7, got)
        want = _via_float32(lambda o: obj.add_row_to(7, o), row)
        assert_same_bits(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("odt", ["float16", "bfloat16"])
def test_half_out_is_accurate_against_float64(odt, isa, dtype):
    """The rounded result is within half an ulp of the out dtype of the float32 result, which the
    accuracy rule holds to float64: so ||ours - ref|| <= ||ulp/2|| + 2 ||numpy32 - ref|| (+ a
    hair)."""
    rng = np.random.default_rng(4)
    d = make_delta(rng, 16, 300, 257, dtype, alpha=8.0)
    x = _act(rng, (12, 257), odt)
    out = _act(rng, (12, 300), odt)
    ref, np32 = ref_batch([d], x.astype(np.float64), out.astype(np.float64))
    got = d.add_batch_to(x, out.copy()).astype(np.float64)
    mant = 10 if odt == "float16" else 7
    half_ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(ref), 1e-30))) - mant - 1)
    err = np.linalg.norm(got - ref)
    bound = 1.01 * np.linalg.norm(half_ulp) + 2 * np.linalg.norm(np32 - ref) \
        + 1e-9 * np.linalg.norm(ref)
    assert err <= bound, (err, bound)


@pytest.mark.parametrize("odt", ["float16", "bfloat16"])
def test_half_out_is_batch_and_thread_invariant(odt, isa, dtype):
    rng = np.random.default_rng(5)
    d = make_delta(rng, 16, 512, 515, dtype)  # enough work for a team
    stack = lora.LoraStack([d, make_delta(rng, 3, 512, 515, dtype)])
    x = _act(rng, (33, 515), "bfloat16")
    out = _act(rng, (33, 512), odt)
    for obj in (d, stack):
        with num_threads(1):
            one = obj.add_batch_to(x, out.copy())
        with num_threads(2):
            two = obj.add_batch_to(x, out.copy())
        assert_same_bits(one.view(np.uint16), two.view(np.uint16))
        for b in (0, 5, 32):
            row = out[b].copy()
            obj.add_to(x[b], row)
            assert_same_bits(row.view(np.uint16), one[b].view(np.uint16), f"row {b}")


def test_untouched_half_elements_keep_their_bits(isa):
    """Scale 0, id -1 and a zero per-position scale leave elements alone, NaN payloads included."""
    rng = np.random.default_rng(6)
    d = make_delta(rng, 4, ROWS, COLS)
    bank = lora.LoraBank([d])
    for dt, nan_bits in ((np.float16, 0x7d01), (BF16, 0x7f81)):  # signalling NaNs
        out = np.zeros((3, ROWS), dt)
        out.view(np.uint16)[...] = nan_bits
        before = out.copy()
        x = rand(rng, (3, COLS))
        bank.add_batch_to(x, out, [-1, 0, 0], scales=[1.0, 0.0, 0.0])
        d.scale.set(0.0)
        d.add_batch_to(x, out)
        d.scale.set(1.0)
        assert out.tobytes() == before.tobytes()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_rounding_overflows_to_inf_like_astype():
    rng = np.random.default_rng(7)
    d = lora.LoraDelta(np.ones((1, 4)), np.ones((3, 1)), scale=40000.0)
    x = np.ones(4, np.float32)
    out = np.full(3, 60000, np.float16)
    got = d.add_to(x, out.copy())
    want = _via_float32(lambda o: d.add_to(x, o), out)
    assert np.all(np.isinf(got)) and got.tobytes() == want.tobytes()
    del rng


# ------------------------------------------------------------------ leading dimensions


def test_leading_dimensions_are_positions_in_c_order(isa, dtype):
    rng = np.random.default_rng(8)
    d, stack, bank = _entries(rng, dtype)
    x = rand(rng, (2, 3, COLS))
    out = rand(rng, (2, 3, ROWS))
    for obj in (d, stack):
        got = obj.add_batch_to(x, out.copy())
        flat = obj.add_batch_to(x.reshape(6, COLS), out.reshape(6, ROWS).copy())
        assert_same_bits(got.reshape(6, ROWS), flat)
    # bank ids of the leading shape, or of a prefix repeated over the rest
    ids2 = np.array([[0, 2, -1], [2, 0, 0]])
    got = bank.add_batch_to(x, out.copy(), ids2, scales=np.full((2, 3), 1.5))
    flat = bank.add_batch_to(x.reshape(6, COLS), out.reshape(6, ROWS).copy(), ids2.reshape(6),
                             scales=np.full(6, 1.5))
    assert_same_bits(got.reshape(6, ROWS), flat)
    per_seq = bank.add_batch_to(x, out.copy(), [2, 0], scales=[0.5, 2.0])
    flat = bank.add_batch_to(x.reshape(6, COLS), out.reshape(6, ROWS).copy(),
                             [2, 2, 2, 0, 0, 0], scales=[0.5] * 3 + [2.0] * 3)
    assert_same_bits(per_seq.reshape(6, ROWS), flat)


def test_row_strided_views_are_written_in_place(isa):
    rng = np.random.default_rng(9)
    d = make_delta(rng, 8, ROWS, COLS)
    qkv = rand(rng, (2, 4, 3 * ROWS))
    x = rand(rng, (2, 4, 2 * COLS))[..., :COLS]  # a strided x is read in place too
    view = qkv[:, :, ROWS:2 * ROWS]
    want = qkv.copy()
    want[:, :, ROWS:2 * ROWS] = d.add_batch_to(np.ascontiguousarray(x), view.copy())
    assert d.add_batch_to(x, view) is view
    assert_same_bits(qkv, want)


def test_leading_axes_that_do_not_collapse(isa):
    rng = np.random.default_rng(10)
    d = make_delta(rng, 4, ROWS, COLS)
    out = rand(rng, (4, 8, ROWS))[:, :3]  # rows 1 apart within a sequence, 8 apart across
    before = out.copy()
    with pytest.raises(ValueError, match="collapse"):
        d.add_batch_to(rand(rng, (4, 3, COLS)), out)
    assert_same_bits(out, before)
    # an x that does not collapse is copied, with the same result
    x = rand(rng, (4, 8, COLS))[:, :3]
    got = d.add_batch_to(x, np.zeros((4, 3, ROWS), np.float32))
    assert_same_bits(got, d.add_batch_to(np.ascontiguousarray(x), np.zeros((4, 3, ROWS),
                                                                             np.float32)))


def test_leading_shape_mismatch_and_bad_ids_shape(isa):
    rng = np.random.default_rng(11)
    d = make_delta(rng, 4, ROWS, COLS)
    bank = lora.LoraBank([d])
    out = rand(rng, (2, 3, ROWS))
    before = out.copy()
    with pytest.raises(ValueError, match=r"\(3, 2, 53\)"):
        d.add_batch_to(rand(rng, (3, 2, COLS)), out)
    with pytest.raises(ValueError, match="adapter_ids"):
        bank.add_batch_to(rand(rng, (2, 3, COLS)), out, [0, 0, 0])
    with pytest.raises(ValueError, match="scales"):
        bank.add_batch_to(rand(rng, (2, 3, COLS)), out, [0, 0], scales=[1.0, 1.0, 1.0])
    assert_same_bits(out, before)


# ------------------------------------------------------------------ per-position scales


def test_per_position_scale_equals_the_entry_alone_at_that_scale(isa, dtype):
    rng = np.random.default_rng(12)
    shared = lora.LoraScale(0.75)
    members = [make_delta(rng, r, ROWS, COLS, dtype, scale=shared) for r in (3, 16)]
    stack = lora.LoraStack(members)
    bank = lora.LoraBank([members[0], stack])
    n = 8
    x = rand(rng, (n, COLS))
    out = rand(rng, (n, ROWS))
    aids = rng.integers(0, 2, n)
    scales = np.array([0.3, -1.25, 1.0, 7.0, 1e-3, 2.0 / 3.0, 1.0, 0.1])
    got = bank.add_batch_to(x, out.copy(), aids, scales)
    for b in range(n):
        shared.set(0.75 * scales[b])  # alpha factor 1: value * scales[b] is the product
        want = out[b].copy()
        bank[aids[b]].add_to(x[b], want)
        assert_same_bits(got[b], want, f"position {b}")
    shared.set(0.75)
    # scale 1 gives the bits of no scales; scale 0 leaves the row untouched
    ones = bank.add_batch_to(x, out.copy(), aids, np.ones(n))
    assert_same_bits(ones, bank.add_batch_to(x, out.copy(), aids))
    zero = bank.add_batch_to(x, out.copy(), aids, np.zeros(n))
    assert_same_bits(zero, out)


def test_per_position_scale_is_formed_in_double(isa):
    """float32(float64(s) * float64(m)), never m rounded to float32 first."""
    s = 1.0 + 2.0**-30          # the effective scale (float32 would make it 1.0)
    m = 1.0 + 2.0**-24 - 2.0**-40  # just below a float32 tie: float32(m) == 1.0
    d = lora.LoraDelta(np.ones((1, 1)), np.ones((1, 1)), scale=s)
    bank = lora.LoraBank([d])
    got = bank.add_batch_to(np.ones((1, 1), np.float32), np.zeros((1, 1), np.float32), [0], [m])
    assert got[0, 0] == np.float32(s * m) == np.float32(1.0 + 2.0**-23)
    assert got[0, 0] != np.float32(s * float(np.float32(m)))


def test_bad_scales_are_refused_before_any_write(isa):
    rng = np.random.default_rng(13)
    d = make_delta(rng, 4, ROWS, COLS, scale=1e30)
    bank = lora.LoraBank([d, None])
    x = rand(rng, (3, COLS))
    out = rand(rng, (3, ROWS))
    before = out.copy()
    for scales, exc, frag in (([1.0, np.nan, 1.0], ValueError, "non-finite"),
                              ([1.0, np.inf, 1.0], ValueError, "non-finite"),
                              ([1.0, 1.0], ValueError, "shape"),
                              ([True, False, True], TypeError, "bool"),
                              (["a", "b", "c"], TypeError, "real"),
                              ([1.0, 1.0, 1e10], ValueError, "not finite in float32")):
        with pytest.raises(exc, match=frag):
            bank.add_batch_to(x, out, [0, 1, 0], scales)
        assert_same_bits(out, before)
    # the product of a finite scale and a position's scale overflowing float32: position named
    with pytest.raises(ValueError, match=r"scales\[2\]"):
        bank.add_batch_to(x, out, [0, 0, 0], [1.0, 1.0, 1e9])
    assert_same_bits(out, before)


def test_a_position_scale_past_float32_is_fine_when_its_products_are(isa):
    """The rule is on the product: 1e40 times an effective scale of 1e-10 is 1e30, finite in
    float32; a position on no adapter (-1) has no product at all."""
    rng = np.random.default_rng(18)
    d = make_delta(rng, 4, ROWS, COLS, scale=1e-10)
    bank = lora.LoraBank([d, None])
    x = rand(rng, (3, COLS))
    out = rand(rng, (3, ROWS))
    want = out.copy()
    alone = lora.LoraDelta(*d.lora_weights(), scale=float(np.float32(d.effective_scale * 1e40)))
    alone.add_to(x[0], want[0])
    bank.add_batch_to(x, out, [0, -1, 1], [1e40, 1e300, 1e300])
    assert_same_bits(out, want)
    with pytest.raises(ValueError, match=r"scales\[0\] = 1e\+50 times the effective scale"):
        bank.add_batch_to(x, out, [0, 0, 0], [1e50, 1.0, 1.0])
    assert_same_bits(out, want)


# ------------------------------------------------------------------ merges into half weights


def _product(b, a):
    """B @ A in float64 summed over the rank in order from the first product (no fma): the
    merge's documented order, element by element."""
    b, a = b.astype(np.float64), a.astype(np.float64)
    t = b[:, :1] * a[:1]
    for k in range(1, a.shape[0]):
        t = t + b[:, k:k + 1] * a[k:k + 1]
    return t


@pytest.mark.parametrize("wdt", ACT_NAMES)
@pytest.mark.parametrize("transposed", [False, True])
def test_merge_rounds_once_into_w(wdt, transposed, dtype):
    rng = np.random.default_rng(14)
    d = make_delta(rng, 6, ROWS, COLS, dtype, alpha=2.0)
    base = _act(rng, (COLS, ROWS) if transposed else (ROWS, COLS), wdt)
    w = base.T if transposed else base
    a, b = d.lora_weights()
    exact = w.astype(np.float64) + d.effective_scale * _product(b, a)
    # one correct rounding of the float64 sum (bfloat16: by integer arithmetic, not via float32)
    want = rne_bf16(exact) if wdt == "bfloat16" else exact.astype(ACT[wdt])
    got = d.merge_into(w)
    assert got is w
    assert np.array_equal(got.astype(np.float64), want.astype(np.float64))
    back = d.unmerge_from(w)
    assert np.allclose(back.astype(np.float64), base.T.astype(np.float64) if transposed
                       else base.astype(np.float64), atol=0.05, rtol=0.02)


def _merge_want(w, terms, wdt):
    """w + each term's s * (B @ A) in float64, in order, rounded once to w's dtype."""
    exact = w.astype(np.float64)
    for d, sign in terms:
        a, b = d.lora_weights()
        exact = exact + (sign * d.effective_scale) * _product(b, a)
    return rne_bf16(exact) if wdt == "bfloat16" else exact.astype(ACT[wdt])


@pytest.mark.parametrize("wdt", ACT_NAMES)
@pytest.mark.parametrize("transposed", [False, True])
def test_merge_stacks_chunks_and_checking_sweep_give_the_same_bits(wdt, transposed, isa):
    """Stacks (terms in order), rows longer than one chunk of the C pass (512), values down to
    float16's subnormals, on every ISA path (the same bits everywhere); a w holding a NaN takes
    the checking sweep before writing (no bound), with the same bits elsewhere, the NaN kept."""
    rng = np.random.default_rng(16)
    rows, cols = 9, 1100
    d1 = make_delta(rng, 5, rows, cols, "bfloat16", alpha=3.0, wscale=0.05)
    d2 = make_delta(rng, 3, rows, cols, "float32", scale=-0.3, wscale=1e-3)
    mags = 10.0 ** rng.uniform(-7, 2, (rows, cols))
    base = _act(rng, (cols, rows) if transposed else (rows, cols), wdt)
    base[...] = ((mags if not transposed else mags.T) * np.sign(
        rng.standard_normal(base.shape))).astype(base.dtype)
    for stack in (lora.LoraStack([d1]), lora.LoraStack([d1, d2])):
        terms = [(d, 1.0) for d in stack]
        w0 = base.copy()
        w = w0.T if transposed else w0
        want = _merge_want(w, terms, wdt)
        assert stack.merge_into(w) is w
        assert_same_bits(np.ascontiguousarray(w), np.ascontiguousarray(want))
        w1 = base.copy()
        w = w1.T if transposed else w1
        w[5, 7] = np.nan
        stack.merge_into(w)
        assert np.isnan(w[5, 7].astype(np.float32))
        w[5, 7] = want[5, 7]
        assert_same_bits(np.ascontiguousarray(w), np.ascontiguousarray(want))


def test_merge_bits_do_not_depend_on_threads():
    """Large enough for a team of threads: the same bits on one thread and on the team, and
    those of the reference sum."""
    rng = np.random.default_rng(19)
    d = make_delta(rng, 8, 100, 1100, "float32", alpha=16.0, wscale=0.05)  # 2^19.7 mult-adds
    w0 = rng.standard_normal((100, 1100)).astype(np.float32)
    want = _merge_want(w0, [(d, 1.0)], "float32")
    team = w0.copy()
    d.merge_into(team)
    with num_threads(1):
        one = w0.copy()
        d.merge_into(one)
    assert_same_bits(team, want)
    assert_same_bits(one, want)


@pytest.mark.parametrize("transposed", [False, True])
def test_merge_overflow_in_a_later_row_names_it_and_writes_nothing(transposed):
    b = np.zeros((10, 1))
    b[7, 0] = 1.0
    d = lora.LoraDelta(np.ones((1, 4)), b, scale=70000.0)
    base = np.ones((4, 10) if transposed else (10, 4), np.float16)
    w = base.T if transposed else base
    before = base.copy()
    with pytest.raises(ValueError, match=r"float16 at \[7, 0\]: 70001 "):
        d.merge_into(w)
    assert base.tobytes() == before.tobytes()


def test_merge_into_a_misaligned_array():
    rng = np.random.default_rng(17)
    d = make_delta(rng, 4, ROWS, COLS, alpha=2.0)
    raw = np.zeros(ROWS * COLS * 4 + 1, np.uint8)
    w = np.frombuffer(raw[1:].data, np.float32).reshape(ROWS, COLS)
    assert not w.flags.aligned and w.flags.writeable
    w[...] = rng.standard_normal((ROWS, COLS))
    want = _merge_want(w, [(d, 1.0)], "float32")
    d.merge_into(w)
    assert_same_bits(w.copy(), want)


def test_merge_overflow_is_refused_and_w_untouched(dtype):
    rng = np.random.default_rng(15)
    d = lora.LoraDelta(np.ones((1, 4)), np.ones((3, 1)), scale=70000.0)
    for w in (np.full((3, 4), 1.0, np.float16), np.full((3, 4), 3e38, np.float32)):
        if w.dtype == np.float32:
            d.scale.set(1e38)
        before = w.copy()
        with pytest.raises(ValueError, match="overflow"):
            d.merge_into(w)
        assert w.tobytes() == before.tobytes()
    del rng


def test_merge_keeps_non_finite_w_elements_and_names_overflow():
    """inf/nan already in w stay (w + delta), not an 'overflow'; a finite element that would
    become inf is refused, naming where, with w untouched."""
    d = lora.LoraDelta(np.ones((1, 4)), np.ones((3, 1)))
    w = np.ones((3, 4), np.float16)
    w[0, 0], w[1, 1] = np.nan, np.inf
    d.merge_into(w)
    assert np.isnan(w[0, 0]) and np.isinf(w[1, 1]) and w[2, 3] == 2
    d.scale.set(70000.0)
    w = np.zeros((3, 4), np.float16)
    with pytest.raises(ValueError, match=r"unmerging from w overflows its dtype float16 at \[0, 0\]"):
        d.unmerge_from(w)
    assert not w.any()


NARROW = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float6_e2m3fn", "float4_e2m1fn"]


@pytest.mark.parametrize("name", NARROW + ["torch.float8_e4m3fn", "torch.float8_e5m2"])
def test_narrow_float_x_is_converted_to_float32(name):
    """One rule for every real float dtype the kernels do not read (ml_dtypes' float8, float6
    and float4 arrays, torch's float8 tensors): x, factors and scales are converted to float32,
    exactly, as float64 is, giving the bits of that float32 copy; out is written in place, so it
    must be float32, float16 or bfloat16 (TypeError)."""
    rng = np.random.default_rng(40)
    d, stack, bank = _entries(rng, "float32")
    x = (rng.standard_normal((4, COLS)) * 0.5).astype(np.float32)
    if name.startswith("torch."):
        torch = pytest.importorskip("torch")
        narrow = torch.from_numpy(x).to(getattr(torch, name[6:]))
        wide = narrow.float().numpy()
        wrap = torch.from_numpy
    else:
        narrow = x.astype(getattr(ml_dtypes, name))
        wide = narrow.astype(np.float32)
        wrap = np.asarray
    out = rand(rng, (4, ROWS))
    for entry, extra in ((d, ()), (stack, ()), (bank, ([0, 2, -1, 0],))):
        want = entry.add_batch_to(wide, out.copy(), *extra)
        assert_same_bits(entry.add_batch_to(narrow, out.copy(), *extra), want)
        if entry is not bank:   # decode too
            assert_same_bits(entry.add_to(narrow[1], out[1].copy()), want[1])
    a, b = (rng.standard_normal(s).astype(np.float32) for s in ((3, COLS), (ROWS, 3)))
    a_narrow = wrap(a).to(narrow.dtype) if name.startswith("torch.") else a.astype(narrow.dtype)
    a_wide = a_narrow.float().numpy() if name.startswith("torch.") else a_narrow.astype(np.float32)
    assert_same_bits(lora.LoraDelta(a_narrow, b).delta_weight(),
                     lora.LoraDelta(a_wide, b).delta_weight())
    scales = np.array([0.5, 1.5, 1.0, 2.0], np.float32)
    s_narrow = wrap(scales).to(narrow.dtype) if name.startswith("torch.") else \
        scales.astype(narrow.dtype)
    assert_same_bits(bank.add_batch_to(x, out.copy(), [0, 2, -1, 0], scales=s_narrow),
                     bank.add_batch_to(x, out.copy(), [0, 2, -1, 0], scales=scales))
    with pytest.raises(TypeError, match="out must have dtype"):
        d.add_batch_to(x, wrap(np.zeros((4, ROWS), np.float32)).to(narrow.dtype)
                       if name.startswith("torch.") else np.zeros((4, ROWS), narrow.dtype))


def test_non_float_ml_dtypes_are_refused():
    x = np.ones((2, COLS), ml_dtypes.int4)
    d = make_delta(np.random.default_rng(41), 2, ROWS, COLS, "float32")
    with pytest.raises(TypeError, match="real floating array.*got dtype int4"):
        d.add_batch_to(x, np.zeros((2, ROWS), np.float32))
