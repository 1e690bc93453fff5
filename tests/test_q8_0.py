"""Storage dtype "q8_0": llama.cpp's Q8_0 blocks (32 int8 values, one float16 scale).

What this file pins:
  - the quantizer is llama.cpp's reference rule (``quantize_row_q8_0_ref``): the bytes of
    ``gguf.quants.quantize`` for whole blocks, and a NumPy reference of the rule written from
    its definition for ties (roundf: away from zero), all-zero blocks and the short last block;
    blocks lie along A's rows and B's columns; a block whose scale overflows float16 is refused
    naming the factor;
  - every op on every ISA path gives, bit for bit, what the float32 delta holding the
    dequantized values gives (d * q is exact in float32, and q8_0 is summed in float32's
    order): decode, batches (past the size where the plan widens a delta to float32), the
    gather, stacks, banks, AdapterSet rows, routed experts, DoRA; x and out in every dtype;
  - a pair mixing q8_0 with float16 is bit-exact to the float32 pair on its values;
  - loaders: GGUF files in llama.cpp's layout (Q8_0 lora_a + F16 lora_b at rank 16, both Q8_0
    at rank 32, Q8_0 experts and token embeddings), applied against ``gguf.quants``'
    dequantization; a file's Q8_0 values are never quantized again; PEFT files quantized on
    load; bad Q8_0 tensors refused naming them;
  - resident_bytes, pickling, merges.
"""

import copy
import pickle
import warnings

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

import _adapter_files as af
import lora
from conftest import assert_format_error, num_threads
from lora import _formats, _runtime

DTYPES = ("float32", "float16", "bfloat16")


def _np(name):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _bits(arr):
    arr = np.asarray(arr)
    return arr.view(np.uint16 if arr.itemsize == 2 else np.uint32)


def _same(got, want):
    np.testing.assert_array_equal(_bits(got), _bits(want))


# Only the AVX-512 path has two builds; a machine without it (AVX2-only, aarch64 under qemu)
# runs each test once.
_WIDENINGS = ["shuffle", "cvt"] if "avx512" in _runtime.available_isas() else ["shuffle"]


@pytest.fixture(autouse=True, params=_WIDENINGS)
def widening(request):
    """Every test under both ways the AVX-512 path builds q8_0 values (the CPU table picks one
    per core; both must give the float32 path's bits).  Other paths ignore it."""
    previous, reason = _runtime.q8_0_widening(), _runtime._q8_0_forced_by
    _runtime.set_q8_0_widening(request.param)
    try:
        yield request.param
    finally:
        _runtime.set_q8_0_widening(previous)
        _runtime._q8_0_forced_by = reason  # the table's, or LORA_Q8_0_WIDENING's, as before


# ------------------------------------------------------------------ the quantizer


def _q8_0_reference(x):
    """llama.cpp's quantize_row_q8_0_ref on float32 rows, written from its definition: per
    block of 32 (the last one shorter), amax = max |x|, d = amax / 127, id = d ? 1 / d : 0,
    q = roundf(x * id) (ties away from zero), d stored as float16; returns (d as float32, q)
    per block, q padded with zeros to 32."""
    x = np.asarray(x, np.float32)
    n = x.shape[-1]
    nblk = -(-n // 32)
    d_all, q_all = [], []
    for k in range(nblk):
        blk = x[..., 32 * k:32 * k + 32]
        amax = np.abs(blk).max(axis=-1).astype(np.float32)
        d = (amax / np.float32(127)).astype(np.float32)
        inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d))
        v = blk * inv.astype(np.float32)[..., None]
        q = np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)      # roundf
        pad = np.zeros((*blk.shape[:-1], 32))
        pad[..., :blk.shape[-1]] = q
        d_all.append(d.astype(np.float16).astype(np.float32))
        q_all.append(pad.astype(np.int8))
    return np.stack(d_all, -1), np.stack(q_all, -2)


def _dequant_reference(x):
    d, q = _q8_0_reference(x)
    v = (q.astype(np.float32) * d[..., None]).reshape(*q.shape[:-2], -1)
    return v[..., :np.asarray(x).shape[-1]]


def test_store_is_gguf_quants_bytes_for_whole_blocks():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((9, 160)) * rng.uniform(1e-4, 10, (9, 1))).astype(np.float32)
    x[0, :32] = 0.0                                      # an all-zero block
    x[1, 32:64] = np.arange(32) * 0.5 * (127 / 15.5)     # x * (1 / d) lands on .5: ties
    x[2, :32] = -x[1, 32:64]
    x[3, 64:96] = 7e-3 * rng.standard_normal(32)         # a subnormal float16 scale
    stored = _formats.Q8_0.store(x, "lora_a")
    np.testing.assert_array_equal(stored, quantize(x, Q.Q8_0))
    np.testing.assert_array_equal(_formats.Q8_0.load(stored), dequantize(stored, Q.Q8_0))


def test_ties_round_away_from_zero():
    """The case that tells roundf from NumPy's rint: x * (1 / d) exactly k + 0.5."""
    x = np.zeros(32, np.float32)
    x[0] = 127.0                      # d = 1, 1 / d = 1
    x[1], x[2], x[3], x[4] = 0.5, 2.5, -0.5, -2.5
    d, q = _q8_0_reference(x)
    assert d[0] == 1.0 and list(q[0, :5]) == [127, 1, 3, -1, -3]
    got = _formats.Q8_0.load(_formats.Q8_0.store(x, "a"))
    np.testing.assert_array_equal(got[:5], [127, 1, 3, -1, -3])
    assert list(np.rint(x[1:5])) != [1, 3, -1, -3]    # rint would round to even


@pytest.mark.parametrize("n", [1, 7, 31, 32, 33, 63, 95])
def test_short_last_block_and_zero_blocks_follow_the_rule(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((5, n)).astype(np.float32)
    x[1] = 0.0
    x[2, -min(n, 3):] = 0.0
    stored = _formats.Q8_0.store(x, "a")
    assert stored.shape == (5, -(-n // 32) * 34)
    d, q = _q8_0_reference(x)
    raw = stored.reshape(5, -1, 34)
    np.testing.assert_array_equal(raw[..., :2].copy().view("<f2")[..., 0].astype(np.float32), d)
    np.testing.assert_array_equal(raw[..., 2:].view(np.int8), q)
    np.testing.assert_array_equal(_formats.Q8_0.load(stored, n), _dequant_reference(x))


def test_factors_block_along_a_rows_and_b_columns():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((5, 70))
    b = rng.standard_normal((45, 5)) * np.linspace(0.01, 10, 45)[:, None]   # scales vary by row
    d = lora.LoraDelta(a, b, dtype="q8_0")
    got_a, got_b = d.lora_weights()
    assert got_a.dtype == got_b.dtype == np.float32
    np.testing.assert_array_equal(got_a, _dequant_reference(a.astype(np.float32)))
    np.testing.assert_array_equal(got_b, _dequant_reference(b.T.astype(np.float32)).T)
    assert d.dtype == "q8_0" and d.dtypes == ("q8_0", "q8_0")
    # 34 bytes a whole block, 2 + its values a short one: A 5 x (2 x 34 + 2 + 6), B 5 x (34 + 2 + 13)
    assert d.resident_bytes == 5 * (2 * 34 + 8) + 5 * (34 + 15)


def test_a_block_whose_scale_overflows_float16_is_refused_naming_the_factor():
    a = np.ones((2, 40))
    b = np.ones((3, 2))
    a[1, 35] = 65504.0 * 127 * 1.001
    with pytest.raises(ValueError, match=r"lora_a.*block 1 of row \(1,\)"):
        lora.LoraDelta(a, b, dtype="q8_0")
    b[2, 1] = 65504.0 * 128
    with pytest.raises(ValueError, match="lora_b"):
        lora.LoraDelta(np.ones((2, 40)), b, dtype="q8_0")
    with pytest.raises(ValueError, match="non-finite"):
        lora.LoraDelta(np.full((2, 40), np.nan), np.ones((3, 2)), dtype="q8_0")
    lora.LoraDelta(np.full((2, 40), 65504.0 * 127), np.ones((3, 2)), dtype="q8_0")
    # llama.cpp's rule: d = max|x| / 127 in float32, then rounded to float16, so a block up to
    # just below 65520 x 127 keeps a finite scale (65504), and from there it is infinite
    edge = lora.LoraDelta(np.full((2, 40), 65519.0 * 127), np.ones((3, 2)), dtype="q8_0")
    assert np.all(edge.lora_weights()[0] == 65504.0 * 127)
    with pytest.raises(ValueError, match="infinite float16"):
        lora.LoraDelta(np.full((2, 40), 65520.0 * 127), np.ones((3, 2)), dtype="q8_0")


def _recorded(make):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = make()
    return result, [str(w.message) for w in seen]


def test_a_factor_quantization_loses_warns_naming_it():
    """Q8_0 keeps Gaussian factors within ~0.6 %; values near 3e-5 get coarse subnormal float16
    scales and values below ~4e-6 a scale of 0: past 2 % of the factor, a RuntimeWarning names
    the factor and the blocks it zeroed."""
    rng = np.random.default_rng(3)
    for scale in (1.0, 1e-2, 1e-4):   # normal, small, subnormal-but-fine: silent
        _, seen = _recorded(lambda: lora.LoraDelta(rng.standard_normal((8, 256)) * scale,
                                                   rng.standard_normal((64, 8)) * scale,
                                                   dtype="q8_0"))
        assert seen == [], (scale, seen)
    d, seen = _recorded(lambda: lora.LoraDelta(np.full((4, 64), 1e-3), np.full((64, 4), 1e-6),
                                               dtype="q8_0"))
    assert len(seen) == 1
    assert seen[0].startswith("lora_b: stored as q8_0, its values are 100.0% off")
    assert "8 nonzero block(s) became all zero" in seen[0] and "'bfloat16'" in seen[0]
    assert not d.lora_weights()[1].any()
    _, seen = _recorded(lambda: lora.LoraDelta(rng.standard_normal((8, 256)) * 1e-5,
                                               np.ones((64, 8)), dtype="q8_0"))
    assert len(seen) == 1 and seen[0].startswith("lora_a:") and "became all zero" not in seen[0]
    with pytest.warns(RuntimeWarning, match="lora_a") as caught:   # at the caller's line
        lora.LoraDelta(np.full((4, 64), 1e-6), np.ones((64, 4)), dtype="q8_0")
    assert caught[0].filename == __file__


def test_a_block_of_float32_subnormals_quantizes_without_numpy_warnings():
    """1 / d overflows for a block of float32 subnormals: its float16 scale is 0 and q is 0,
    with the one warning above and none of NumPy's on the way."""
    a = np.full((1, 32), 1e-40)
    a[0, -1] = 1e-38
    d, seen = _recorded(lambda: lora.LoraDelta(a, np.ones((8, 1)), dtype="q8_0"))
    assert len(seen) == 1 and seen[0].startswith("lora_a: stored as q8_0"), seen
    assert d._stored_bits()[0].tobytes() == bytes(34)


def test_a_loader_names_every_lost_factor_in_one_warning(tmp_path):
    rng = np.random.default_rng(21)
    tensors = {}
    for i in range(5):
        tensors.update(af.linear_pair(rng, f"model.layers.{i}.self_attn.q_proj", 64, 64, 8))
        tensors[f"{af.PREFIX}model.layers.{i}.self_attn.q_proj.lora_B.weight"] *= 1e-6
    tensors.update(af.linear_pair(rng, "model.layers.0.mlp.up_proj", 64, 64, 8))
    path = af.write_peft(tmp_path / "peft", tensors,
                         af.peft_config(r=8, lora_alpha=16, target_modules=["q_proj", "up_proj"]))
    with pytest.warns(RuntimeWarning) as caught:
        lora.load_peft(path, dtype="q8_0")
    lost = [str(w.message) for w in caught if "q8_0" in str(w.message)]
    assert len(lost) == 1 and "5 factor(s) are more than 2% off" in lost[0], lost
    assert "model.layers.0.self_attn.q_proj.lora_b 100.0%" in lost[0] and "2 more" in lost[0]
    assert "up_proj" not in lost[0]
    assert caught[0].filename == __file__
    _, seen = _recorded(lambda: lora.load_peft(path, dtype="bfloat16"))
    assert seen == []


# ------------------------------------------------------------------ the same bits as float32


def _pair(rank, rows, cols, seed, dtype, alpha=0.0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((rank, cols)) * 0.1
    b = rng.standard_normal((rows, rank)) * 0.1
    q = lora.LoraDelta(a, b, dtype=dtype, alpha=alpha, scale=0.75)
    qa, qb = q.lora_weights()
    return q, lora.LoraDelta(np.asarray(qa, np.float32), np.asarray(qb, np.float32),
                             alpha=alpha, scale=0.75)


@pytest.mark.parametrize("rank, rows, cols", [(1, 1, 1), (7, 17, 33), (17, 45, 70),
                                              (40, 129, 95), (16, 300, 4096 + 17)])
def test_every_op_equals_the_float32_path_on_the_dequantized_values(isa, rank, rows, cols):
    q, f = _pair(rank, rows, cols, rank + rows, "q8_0", alpha=2.0 * rank)
    rng = np.random.default_rng(3)
    for xt in DTYPES:
        for ot in DTYPES:
            for n in (1, 3, 6, 300):       # 300: past the plan's widening to float32
                x = rng.standard_normal((n, cols)).astype(_np(xt))
                o1 = rng.standard_normal((n, rows)).astype(_np(ot))
                o2 = o1.copy()
                if n == 1:
                    q.add_to(x[0], o1[0])
                    f.add_to(x[0], o2[0])
                else:
                    q.add_batch_to(x, o1)
                    f.add_batch_to(x, o2)
                _same(o1, o2)
        ids = rng.integers(0, rows, 37)
        o1 = rng.standard_normal((37, cols)).astype(_np(xt))
        o2 = o1.copy()
        q.add_rows_to(ids, o1)
        f.add_rows_to(ids, o2)
        _same(o1, o2)


@pytest.mark.parametrize("other", ["float32", "float16", "bfloat16"])
def test_a_pair_mixing_q8_0_with_another_format(isa, other):
    """q8_0 with float32 or float16 (loaded exactly, summed in float32's order) gives the
    float32 pair's bits; with bfloat16, which AVX-512 sums in its own pair order, within float32
    rounding of it (and its bits on the other paths)."""
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((17, 70)), rng.standard_normal((45, 17))
    for dtype in (f"q8_0/{other}", f"{other}/q8_0"):
        d = lora.LoraDelta(a, b, dtype=dtype, scale=0.5)
        assert d.dtype == dtype
        assert d.dtypes == tuple(dtype.split("/"))
        wa, wb = (np.asarray(v, np.float32) for v in d.lora_weights())
        f = lora.LoraDelta(wa, wb, scale=0.5)
        x = rng.standard_normal((6, 70)).astype(np.float32)
        o1, o2 = np.zeros((6, 45), np.float32), np.zeros((6, 45), np.float32)
        d.add_batch_to(x, o1)
        f.add_batch_to(x, o2)
        if other == "bfloat16" and isa == "avx512" and dtype.startswith("bfloat16"):
            ref = 0.5 * (wb.astype(np.float64) @ (wa.astype(np.float64) @ x.T.astype(np.float64))).T
            mag = 0.5 * (np.abs(wb) @ (np.abs(wa) @ np.abs(x.T))).T
            assert np.all(np.abs(o1 - ref) <= 4 * 2.0**-24 * 100 * mag + 1e-30)
        else:
            _same(o1, o2)


def test_stacks_banks_and_adapter_sets_mixing_q8_0_bf16_f32(isa):
    """Each row of a bank or an AdapterSet whose entries mix q8_0, bfloat16 and float32 is
    bit-identical to its entry applied alone; a q8_0 stack equals its members in order."""
    rng = np.random.default_rng(5)
    rows, cols = 96, 80
    entries = [lora.LoraDelta(rng.standard_normal((r, cols)), rng.standard_normal((rows, r)),
                              dtype=st, alpha=float(r))
               for r, st in ((8, "q8_0"), (16, "bfloat16"), (5, "float32"), (33, "q8_0"))]
    stack = lora.LoraStack([entries[0], entries[1]])
    bank = lora.LoraBank([entries[0], entries[1], entries[2], stack, entries[3]])
    n = 70
    x = rng.standard_normal((n, cols)).astype(np.float32)
    ids = rng.integers(-1, 5, n)
    for ot in DTYPES:
        out = rng.standard_normal((n, rows)).astype(_np(ot))
        got = out.copy()
        bank.add_batch_to(x, got, ids)
        for i in range(n):
            want = out[i].copy()
            if ids[i] >= 0:
                [entries[0], entries[1], entries[2], stack, entries[3]][ids[i]].add_to(x[i], want)
            _same(got[i], want)
    o1, o2 = np.zeros((3, rows), np.float32), np.zeros((3, rows), np.float32)
    stack.add_batch_to(x[:3], o1)
    entries[0].add_batch_to(x[:3], o2)
    entries[1].add_batch_to(x[:3], o2)
    _same(o1, o2)

    adapters = {name: lora.LoraAdapter({"proj": d}, name=name, alpha=0.0, scale=d.scale)
                for name, d in (("q", entries[0]), ("bf", entries[1]), ("f", entries[2]),
                                ("q33", entries[3]))}
    aset = lora.AdapterSet(adapters)
    slots = aset.slots(["q", "bf", None, "f", "q33", "q", "q33", "bf"])
    xs = rng.standard_normal((len(slots), cols)).astype(np.float32)
    out = np.zeros((len(slots), rows), np.float32)
    aset.bank("proj").add_batch_to(xs, out, slots)
    names = aset.names
    for i, s in enumerate(slots):
        want = np.zeros(rows, np.float32)
        if s >= 0:
            aset[names[s]]["proj"].add_to(xs[i], want)
        _same(out[i], want)


def test_threads_and_batches_keep_the_bits(isa):
    q, _ = _pair(32, 2048, 1024, 9, "q8_0")
    x = np.random.default_rng(6).standard_normal((64, 1024)).astype(np.float32)
    with num_threads(1):
        one = np.zeros((64, 2048), np.float32)
        q.add_batch_to(x, one)
    with num_threads(2):
        two = np.zeros((64, 2048), np.float32)
        q.add_batch_to(x, two)
    _same(one, two)
    alone = np.zeros(2048, np.float32)
    q.add_to(x[17], alone)
    _same(one[17], alone)


@pytest.mark.parametrize("rank", [16, 40])
def test_batch_positions_at_scale_zero_keep_negative_zeros(isa, rank):
    """A block of 2 to 4 positions whose per-position scales round to 0: those rows of out keep
    their bits (a -0.0 that out = out + 0 * term would turn into +0.0), the others equal the
    float32 path on the dequantized factors, over rows that cross many strips and a block edge
    16 into a row (rows % 32 == 16)."""
    rows, cols = 1040, 96
    q, f = _pair(rank, rows, cols, 11, "q8_0", alpha=float(rank))
    bank_q, bank_f = lora.LoraBank([q]), lora.LoraBank([f])
    rng = np.random.default_rng(12)
    for n in (2, 3, 4, 7):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        pos = rng.uniform(0.5, 1.5, n)
        pos[0::4] = 0.0
        pos[2::4] = 1e-300  # its float32 scale is 0 while the position stays in the block
        for ot in DTYPES:
            o1 = np.full((n, rows), -0.0, _np(ot))
            o2 = o1.copy()
            bank_q.add_batch_to(x, o1, np.zeros(n, np.int64), pos)
            bank_f.add_batch_to(x, o2, np.zeros(n, np.int64), pos)
            _same(o1, o2)
            assert np.all(np.signbit(o1[::2].astype(np.float32)))


def test_scale_zero_leaves_out_untouched(isa):
    q, _ = _pair(8, 40, 64, 10, "q8_0")
    q.scale.set(0.0)
    out = np.random.default_rng(7).standard_normal((5, 40)).astype(np.float16)
    before = out.copy()
    q.add_batch_to(np.ones((5, 64), np.float32), out)
    _same(out, before)


def test_experts_and_dora_in_q8_0(isa):
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((4, 8, 40)), rng.standard_normal((4, 50, 8))
    ex = lora.LoraExperts(a, b, dtype="q8_0", alpha=4.0)
    assert ex.dtype == "q8_0" and ex.resident_bytes == 4 * ex.expert(0).resident_bytes
    wa, wb = ex.lora_weights()
    ref = lora.LoraExperts(wa, wb, alpha=4.0)
    x = rng.standard_normal((6, 2, 40)).astype(np.float32)
    eids = rng.integers(0, 4, (6, 2))
    o1, o2 = np.zeros((6, 2, 50), np.float32), np.zeros((6, 2, 50), np.float32)
    ex.add_to(x, o1, eids)
    ref.add_to(x, o2, eids)
    _same(o1, o2)

    w = rng.standard_normal((50, 40)).astype(np.float32)
    mag = np.linalg.norm(w, axis=1) * 1.1
    dq = lora.DoraDelta(a[0], b[0], mag, w, dtype="q8_0")
    df = lora.DoraDelta(wa[0], wb[0], mag, w)
    assert dq.dtype == "q8_0"
    o1, o2 = np.zeros((6, 50), np.float32), np.zeros((6, 50), np.float32)
    dq.add_batch_to(x[:, 0], o1)
    df.add_batch_to(x[:, 0], o2)
    _same(o1, o2)


def test_merges_add_the_dequantized_factors():
    q, f = _pair(17, 45, 70, 11, "q8_0", alpha=8.0)
    for wt in DTYPES:
        w = np.random.default_rng(12).standard_normal((45, 70)).astype(_np(wt))
        w1, w2 = w.copy(), w.copy()
        q.merge_into(w1)
        f.merge_into(w2)
        _same(w1, w2)
    np.testing.assert_array_equal(q.delta_weight(), f.delta_weight())


def test_pickling_keeps_the_blocks_and_copies_share_them():
    q, _ = _pair(9, 33, 70, 13, "q8_0/float16")
    back = pickle.loads(pickle.dumps(q))
    assert back.dtype == "q8_0/float16" and back.dtypes == ("q8_0", "float16")
    for x, y in zip(q._stored_bits(), back._stored_bits()):
        np.testing.assert_array_equal(x, y)
    deep = copy.deepcopy(q)
    np.testing.assert_array_equal(deep.lora_weights()[0], q.lora_weights()[0])
    ex = lora.LoraExperts(np.ones((2, 3, 40)), np.ones((2, 5, 3)), dtype="q8_0")
    ex2 = pickle.loads(pickle.dumps(ex))
    assert ex2.dtype == "q8_0"
    np.testing.assert_array_equal(ex2.lora_weights()[1], ex.lora_weights()[1])


def test_a_corrupt_pickle_of_blocks_is_refused():
    q, _ = _pair(3, 33, 70, 14, "q8_0")
    fn, args = q._parts()
    a, b = args[0].copy(), args[1]
    with pytest.raises(ValueError, match="not the stored factors"):
        fn(a[:, :-1], b, *args[2:])
    a[0, 0:2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)   # an inf scale
    with pytest.raises(ValueError, match="non-finite"):
        fn(a, b, *args[2:])


# ------------------------------------------------------------------ loaders


def _apply_check(delta, a_vals, b_vals, s):
    """delta's batch against s * B A x on the given values, within float32 rounding."""
    x = np.random.default_rng(15).standard_normal((4, delta.cols)).astype(np.float32)
    out = np.zeros((4, delta.rows), np.float32)
    delta.add_batch_to(x, out)
    ref = s * (b_vals.astype(np.float64) @ (a_vals.astype(np.float64) @ x.T.astype(np.float64))).T
    mag = abs(s) * (np.abs(b_vals) @ (np.abs(a_vals) @ np.abs(x.T))).T
    assert np.all(np.abs(out - ref) <= 4 * 2.0**-24 * (delta.cols + delta.rank + 4) * mag + 1e-30)


def test_gguf_q8_0_lora_a_with_f16_lora_b_at_rank_16(tmp_path):
    """llama.cpp's --outtype q8_0 file below rank 32: lora_a Q8_0 (its rows are whole blocks),
    lora_b F16 (ne[0] = 16 is no whole block): kept as q8_0/float16, applied as gguf.quants'
    dequantization of the file says."""
    rng = np.random.default_rng(16)
    a = (rng.standard_normal((16, 256)) * 0.02).astype(np.float32)
    b = (rng.standard_normal((192, 16)) * 0.01).astype(np.float16)
    path = af.write_gguf(tmp_path / "r16.gguf", [("blk.0.attn_q.weight.lora_a", a, Q.Q8_0),
                                                 ("blk.0.attn_q.weight.lora_b", b, None)],
                         alpha=32.0)
    ad = lora.load_gguf(path)
    d = ad["blk.0.attn_q.weight"]
    assert d.dtype == "q8_0/float16" and ad.dtype == "q8_0/float16"
    want_a = dequantize(quantize(a, Q.Q8_0), Q.Q8_0)
    got_a, got_b = d.lora_weights()
    np.testing.assert_array_equal(got_a, want_a)
    np.testing.assert_array_equal(got_b, b)
    assert d.resident_bytes == 16 * 8 * 34 + 16 * 192 * 2
    np.testing.assert_array_equal(d._stored_bits()[0], quantize(a, Q.Q8_0))   # the file's bytes
    _apply_check(d, want_a, b.astype(np.float32), 2.0)
    # dtype="q8_0" quantizes the F16 lora_b, leaves the file's blocks as they are
    dq = lora.load_gguf(path, dtype="q8_0")["blk.0.attn_q.weight"]
    assert dq.dtype == "q8_0"
    np.testing.assert_array_equal(dq.lora_weights()[0], want_a)
    np.testing.assert_array_equal(dq.lora_weights()[1],
                                  _dequant_reference(b.astype(np.float32).T).T)
    # another dtype stores every value in it
    assert lora.load_gguf(path, dtype="float32")["blk.0.attn_q.weight"].dtype == "float32"


def test_gguf_both_q8_0_at_rank_32(tmp_path):
    """Rank 32: llama.cpp writes lora_b in Q8_0 too, blocked along the rank: dequantized
    exactly to float32, never quantized again (not even under dtype="q8_0")."""
    rng = np.random.default_rng(17)
    a = (rng.standard_normal((32, 128)) * 0.02).astype(np.float32)
    b = (rng.standard_normal((96, 32)) * 0.01).astype(np.float32)
    path = af.write_gguf(tmp_path / "r32.gguf", [("blk.1.ffn_up.weight.lora_a", a, Q.Q8_0),
                                                 ("blk.1.ffn_up.weight.lora_b", b, Q.Q8_0)],
                         alpha=16.0)
    want_a = dequantize(quantize(a, Q.Q8_0), Q.Q8_0)
    want_b = dequantize(quantize(b, Q.Q8_0), Q.Q8_0)
    for dtype in (None, "q8_0"):
        d = lora.load_gguf(path, dtype=dtype)["blk.1.ffn_up.weight"]
        assert d.dtype == "q8_0/float32"
        got_a, got_b = d.lora_weights()
        np.testing.assert_array_equal(got_a, want_a)
        np.testing.assert_array_equal(got_b, want_b)
        _apply_check(d, want_a, want_b, 0.5)


def test_gguf_q8_0_experts_and_token_embedding(tmp_path):
    rng = np.random.default_rng(18)
    ea = (rng.standard_normal((3, 4, 64)) * 0.1).astype(np.float32)   # ne [64, 4, 3]
    eb = (rng.standard_normal((3, 40, 4)) * 0.1).astype(np.float32)
    ta = (rng.standard_normal((50, 32)) * 0.1).astype(np.float32)     # ne [32, 50]: [r, vocab]
    tb = (rng.standard_normal((64, 32)) * 0.1).astype(np.float32)     # ne [32, 64]: [r, n_embd]
    path = af.write_gguf(tmp_path / "moe.gguf", [
        ("blk.0.ffn_up_exps.weight.lora_a", ea, Q.Q8_0),
        ("blk.0.ffn_up_exps.weight.lora_b", eb, None),
        ("token_embd.weight.lora_a", ta, Q.Q8_0),
        ("token_embd.weight.lora_b", tb, Q.Q8_0)], alpha=0.0)
    ad = lora.load_gguf(path)
    ex = ad["blk.0.ffn_up_exps.weight"]
    assert ex.dtype == "q8_0/float32"
    np.testing.assert_array_equal(ex.lora_weights()[0], dequantize(quantize(ea, Q.Q8_0), Q.Q8_0))
    emb = ad["token_embd.weight"]      # both blocked along the rank here: float32, exactly
    assert emb.dtype == "float32"
    np.testing.assert_array_equal(emb.lora_weights()[1], dequantize(quantize(ta, Q.Q8_0), Q.Q8_0))
    np.testing.assert_array_equal(emb.lora_weights()[0],
                                  dequantize(quantize(tb, Q.Q8_0), Q.Q8_0).T)


def test_gguf_bad_q8_0_tensors_are_refused_naming_them(tmp_path):
    rng = np.random.default_rng(19)
    a = rng.standard_normal((4, 64)).astype(np.float32)
    b = rng.standard_normal((24, 4)).astype(np.float32)
    good = [("blk.0.attn_q.weight.lora_a", a, Q.Q8_0), ("blk.0.attn_q.weight.lora_b", b, None)]
    path = af.write_gguf(tmp_path / "nan.gguf", good)
    af.poison_q8_0_scale(path, "blk.0.attn_q.weight.lora_a", np.nan)
    for dtype in (None, "q8_0", "float32"):
        assert_format_error(lambda: lora.load_gguf(path, dtype=dtype), path,
                            "blk.0.attn_q.weight.lora_a")
    # ne[0] not a multiple of 32: the byte length cannot be whole blocks
    short = af.write_gguf(tmp_path / "ne.gguf", good)
    af.patch_gguf_ne(short, "blk.0.attn_q.weight.lora_a", [48, 4])
    assert_format_error(lambda: lora.load_gguf(short), short, "blk.0.attn_q.weight.lora_a")
    # a dimension of 0
    empty = af.write_gguf(tmp_path / "zero.gguf", good)
    af.patch_gguf_ne(empty, "blk.0.attn_q.weight.lora_a", [64, 0])
    assert_format_error(lambda: lora.load_gguf(empty), empty, "blk.0.attn_q.weight.lora_a")


def test_peft_file_quantized_on_load(tmp_path):
    """dtype="q8_0" quantizes a PEFT file by llama.cpp's rule: lora_A [r, in] along its rows,
    lora_B [out, r] along its columns (a short last block where out is not a multiple of 32)."""
    rng = np.random.default_rng(20)
    tensors = {}
    tensors.update(af.linear_pair(rng, "model.layers.0.self_attn.q_proj", 45, 70, 8))
    tensors.update(af.linear_pair(rng, "model.layers.0.mlp.up_proj", 64, 33, 8))
    path = af.write_peft(tmp_path / "peft", tensors, af.peft_config(r=8, lora_alpha=16, target_modules=["q_proj", "up_proj"]))
    ad = lora.load_peft(path, dtype="q8_0")
    assert ad.dtype == "q8_0"
    for mod in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"):
        key = f"base_model.model.{mod}"
        a = np.asarray(tensors[f"{key}.lora_A.weight"], np.float32)
        b = np.asarray(tensors[f"{key}.lora_B.weight"], np.float32)
        got_a, got_b = ad[mod].lora_weights()
        np.testing.assert_array_equal(got_a, _dequant_reference(a))
        np.testing.assert_array_equal(got_b, _dequant_reference(b.T).T)


def test_inspect_shows_the_stored_formats_subprocess(tmp_path):
    import subprocess
    import sys

    rng = np.random.default_rng(21)
    path = af.write_gguf(tmp_path / "r16.gguf", [
        ("blk.0.attn_q.weight.lora_a", rng.standard_normal((16, 64)).astype(np.float32), Q.Q8_0),
        ("blk.0.attn_q.weight.lora_b", rng.standard_normal((32, 16)).astype(np.float16), None)])
    run = subprocess.run([sys.executable, "-m", "lora", "inspect", str(path)],
                         capture_output=True, text=True, check=True)
    assert "q8_0/float16" in run.stdout
    run = subprocess.run([sys.executable, "-m", "lora", "inspect", "--dtype", "q8_0", str(path)],
                         capture_output=True, text=True, check=True)
    assert "dtype q8_0" in run.stdout


def test_requantizing_dequantized_values_is_exact_and_renamed_keeps_the_values():
    """Q8_0 of its own dequantized values gives the same blocks (the largest |q| of a block is
    127, so d comes back exactly); renaming a GGUF adapter to Hugging Face names keeps A's blocks,
    and moves B's rows into float32 when B is q8_0 (its rows would change blocks)."""
    rng = np.random.default_rng(22)
    a = rng.standard_normal((8, 96)).astype(np.float32)
    stored = _formats.Q8_0.store(a, "a")
    np.testing.assert_array_equal(_formats.Q8_0.store(_formats.Q8_0.load(stored, 96), "a"), stored)
    d = lora.LoraDelta(rng.standard_normal((8, 64)), rng.standard_normal((64, 8)), dtype="q8_0")
    ad = lora.LoraAdapter({"blk.0.attn_q.weight": d}, name="t", alpha=0.0, scale=d.scale)
    hf = ad.renamed("hf", n_head=4, n_head_kv=4)["model.layers.0.self_attn.q_proj"]
    assert hf.dtypes == ("q8_0", "float32")
    np.testing.assert_array_equal(hf._stored_bits()[0], d._stored_bits()[0])
    perm = np.argsort(lora.loaders.adapter.llama_rope_permutation(64, 4))
    np.testing.assert_array_equal(hf.lora_weights()[1], d.lora_weights()[1][perm])
