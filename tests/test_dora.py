"""`lora.DoraDelta` (PEFT's DoRA) against a float64 NumPy reference of PEFT's formula, on every ISA
path x storage dtype x activation dtype x op; stacks mixing DoRA and plain members, banks and
adapter sets with DoRA beside plain entries (each row bit-identical to its entry alone); the
refusals; and files PEFT itself saves, against PEFT's own layers in the same process.

PEFT's rule (tuners/lora/dora.py, DoraLinearLayer / DoraEmbeddingLayer): for a Linear layer
``y = g * (W x + s B A x) + bias`` with ``g = m / ||W + s B A||`` per output row; for an
embedding ``y = g * (E[ids] + s B[ids] A)`` with ``g`` per column, the norm over the vocab.
"""

import numpy as np
import pytest

import lora
from conftest import (DTYPES, assert_accurate, assert_same_bits, can_run_two_threads,
                      num_threads, weights32, weights64)

OUT_DTYPES = ["float32", "float16", "bfloat16"]


def _np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(name)


def _rng(seed=0):
    return np.random.default_rng(seed)


def make_dora(rng, rank, rows, cols, dtype="float32", *, base_dtype="float32", alpha=0.0,
              scale=1.0, embedding=False, transposed=False, base=None):
    """(DoraDelta, the base as given) with random A, B, W and a magnitude away from the norm."""
    a = rng.standard_normal((rank, cols)) * 0.5
    b = rng.standard_normal((rows, rank)) * 0.5
    if base is None:
        base = rng.standard_normal((rows, cols)).astype(_np_dtype(base_dtype))
        if transposed:
            base = np.ascontiguousarray(base.T).T
    n = cols if embedding else rows
    m = rng.uniform(0.5, 2.0, n)
    d = lora.DoraDelta(a, b, m, base, alpha=alpha, scale=scale, dtype=dtype, embedding=embedding)
    return d, base


def factor64(d, base, s=None):
    """PEFT's g = m / ||W + s B A|| in float64 from the stored values (per row; per column for an
    embedding)."""
    s = d.effective_scale if s is None else s
    a, b = weights64(d)
    v = np.asarray(base).astype(np.float64) + s * b @ a
    return d.magnitude.astype(np.float64) / np.linalg.norm(v, axis=0 if d.embedding else 1)


def factor32(d, base):
    """The same in float32 NumPy (the accuracy rule's numpy32)."""
    a, b = weights32(d)
    v = np.asarray(base).astype(np.float32) + np.float32(d.effective_scale) * (b @ a)
    return d.magnitude / np.linalg.norm(v, axis=0 if d.embedding else 1)


def ref_linear(entries, x, out):
    """(float64, numpy32) of PEFT's multi-adapter rule: members in order, a plain one adds
    s B A x, a DoRA one scales the running bias-free sum by its g after adding its own term.
    ``entries``: (delta, base or None) pairs."""
    ref, np32 = out.astype(np.float64), out.astype(np.float32).copy()
    x64, x32 = x.astype(np.float64), x.astype(np.float32)
    for d, base in entries:
        a64, b64 = weights64(d)
        a32, b32 = weights32(d)
        s = d.effective_scale
        ref = ref + s * (x64 @ a64.T) @ b64.T
        np32 = np32 + np.float32(s) * (x32 @ a32.T) @ b32.T
        if base is not None:
            ref = ref * factor64(d, base)
            np32 = np32 * factor32(d, base)
    return ref, np32


def ref_rows(d, base, ids, out):
    a64, b64 = weights64(d)
    a32, b32 = weights32(d)
    s = d.effective_scale
    ref = (out.astype(np.float64) + s * b64[ids] @ a64) * factor64(d, base)
    np32 = (out.astype(np.float32) + np.float32(s) * b32[ids] @ a32) * factor32(d, base)
    return ref, np32


def _ours(out):
    return np.asarray(out).astype(np.float32)


# ------------------------------------------------------------------ every op x dtype x ISA


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("rank, rows, cols", [(1, 1, 7), (7, 33, 17), (16, 31, 32),
                                              (17, 130, 15)])
def test_linear_ops_match_peft_formula(isa, dtype, out_dtype, rank, rows, cols):
    rng = _rng(rank * 100 + rows)
    d, base = make_dora(rng, rank, rows, cols, dtype, alpha=2 * rank, scale=0.8)
    x = rng.standard_normal((9, cols)).astype(np.float32)
    out0 = (x @ base.T).astype(_np_dtype(out_dtype))
    out = out0.copy()
    d.add_batch_to(x, out)
    ref, np32 = ref_linear([(d, base)], x, out0.astype(np.float32))
    if out_dtype == "float32":
        assert_accurate(_ours(out), ref, np32, f"{isa} {dtype} add_batch_to")
    else:  # one rounding: the float32 result rounded once
        wide = out0.astype(np.float32)
        d.add_batch_to(x, wide)
        assert_same_bits(out, wide.astype(out.dtype), "half out rounded once")
        assert_accurate(wide, ref, np32, f"{isa} {dtype} add_batch_to (float32 of half out)")
    for b in (0, 4, 8):  # decode = its row of the batch
        o = out0[b].copy()
        d.add_to(x[b], o)
        assert_same_bits(o, out[b], f"add_to row {b}")


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("rank, vocab, dim", [(1, 7, 1), (7, 50, 33), (16, 129, 31)])
def test_embedding_rows_match_peft_formula(isa, dtype, out_dtype, rank, vocab, dim):
    rng = _rng(rank + vocab)
    d, table = make_dora(rng, rank, vocab, dim, dtype, alpha=rank, embedding=True)
    ids = np.array([0, vocab - 1, 3 % vocab, 0, vocab // 2])
    out0 = table[ids].astype(_np_dtype(out_dtype))
    out = out0.copy()
    d.add_rows_to(ids, out)
    ref, np32 = ref_rows(d, table, ids, out0.astype(np.float32))
    if out_dtype == "float32":
        assert_accurate(_ours(out), ref, np32, f"{isa} {dtype} add_rows_to")
    else:
        wide = out0.astype(np.float32)
        d.add_rows_to(ids, wide)
        assert_same_bits(out, wide.astype(out.dtype), "half out rounded once")
    row = out0[1].copy()
    d.add_row_to(int(ids[1]), row)
    assert_same_bits(row, out[1], "add_row_to")


@pytest.mark.parametrize("base_dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_statistics_from_every_base_dtype_and_layout(base_dtype, transposed):
    rng = _rng(3)
    d, base = make_dora(rng, 9, 41, 23, base_dtype=base_dtype, alpha=4, transposed=transposed)
    a, b = weights64(d)
    v = np.asarray(base).astype(np.float64) + d.effective_scale * b @ a
    want = np.linalg.norm(v, axis=1)
    np.testing.assert_allclose(d.norm, want, rtol=2e-7)
    np.testing.assert_allclose(factor64(d, base), factor64(d, base))
    # the same values in the other layout give the same statistics, bit for bit
    other = np.ascontiguousarray(base) if transposed else np.ascontiguousarray(base.T).T
    d2 = lora.DoraDelta(*d.lora_weights(), d.magnitude, other, alpha=4)
    assert_same_bits(d2.norm, d.norm, "layouts")
    # an embedding's norm is per column: the same on the transposed problem
    e = lora.DoraDelta(*d.lora_weights(), rng.uniform(1, 2, 23), base, alpha=4, embedding=True)
    np.testing.assert_allclose(e.norm, np.linalg.norm(v, axis=0), rtol=2e-7)


def test_batch_and_thread_invariance(isa):
    rng = _rng(5)
    d, base = make_dora(rng, 16, 300, 200, alpha=8)
    x = rng.standard_normal((37, 200)).astype(np.float32)
    out0 = rng.standard_normal((37, 300)).astype(np.float32)
    with num_threads(1):
        one = d.add_batch_to(x, out0.copy())
    for n in ([2] if can_run_two_threads() else []):
        with num_threads(n):
            assert_same_bits(d.add_batch_to(x, out0.copy()), one, f"{n} threads")
    for b in range(0, 37, 6):
        assert_same_bits(d.add_batch_to(x[b:b + 5], out0[b:b + 5].copy()), one[b:b + 5],
                         f"batch slice {b}")


def test_scale_change_recomputes_the_factor_and_zero_is_not_no_adapter():
    rng = _rng(6)
    d, base = make_dora(rng, 4, 20, 12, alpha=4)
    x = rng.standard_normal(12).astype(np.float32)
    out0 = (base @ x).astype(np.float32)
    for v in (1.0, 0.25, -2.0, 0.0, 1.0):
        d.scale.set(v)
        got = d.add_to(x, out0.copy())
        ref, np32 = ref_linear([(d, base)], x[None], out0[None])
        assert_accurate(got[None], ref, np32, f"scale {v}")
    d.scale.set(0.0)
    want = factor64(d, base, 0.0) * out0
    np.testing.assert_allclose(d.add_to(x, out0.copy()), want, rtol=1e-6)
    assert not np.array_equal(d.add_to(x, out0.copy()), out0)   # scale 0 still rescales


def test_set_base_rereads_the_base():
    rng = _rng(7)
    d, base = make_dora(rng, 3, 10, 8, alpha=3)
    x = rng.standard_normal(8).astype(np.float32)
    before = d.norm
    base *= 2.0                       # changed in place: seen only after set_base
    assert_same_bits(d.norm, before, "before set_base")
    d.set_base(base)
    ref, np32 = ref_linear([(d, base)], x[None], (base @ x)[None])
    assert_accurate(d.add_to(x, (base @ x).astype(np.float32))[None], ref, np32, "after set_base")


def test_properties_and_kind():
    rng = _rng(8)
    d, base = make_dora(rng, 5, 12, 9, dtype="bfloat16", alpha=10, scale=0.5)
    assert not isinstance(d, lora.LoraDelta)
    assert (d.rank, d.rows, d.cols, d.base_shape, d.dtype) == (5, 12, 9, (12, 9), "bfloat16")
    assert d.effective_scale == 0.5 * 10 / 5
    assert d.magnitude.dtype == np.float32 and d.magnitude.shape == (12,)
    plain = 5 * (12 + 9) * 2
    stats = 12 * 8 + 12 * 5 * 8 + 5 * 5 * 8 + 12 * 4
    assert d.resident_bytes == plain + stats
    np.testing.assert_allclose(d.delta_weight(), d.effective_scale * np.matmul(
        *reversed([w.astype(np.float64) for w in d.lora_weights()])), rtol=1e-6)


# ------------------------------------------------------------------ stacks, banks, sets


def _linear_set(rng, rows=40, cols=24):
    base = rng.standard_normal((rows, cols)).astype(np.float32)
    d1, _ = make_dora(rng, 4, rows, cols, alpha=8, base=base)
    d2, _ = make_dora(rng, 7, rows, cols, "float16", alpha=7, scale=0.5, base=base)
    p1 = lora.LoraDelta(rng.standard_normal((3, cols)), rng.standard_normal((rows, 3)), alpha=3)
    p2 = lora.LoraDelta(rng.standard_normal((5, cols)), rng.standard_normal((rows, 5)),
                        dtype="bfloat16")
    return base, d1, d2, p1, p2


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_stack_mixing_dora_and_plain_is_peft_multi_adapter_rule(isa, out_dtype):
    rng = _rng(9)
    base, d1, d2, p1, p2 = _linear_set(rng)
    order = [p1, d1, p2, d2]
    st = lora.LoraStack(order)
    x = rng.standard_normal((6, 24)).astype(np.float32)
    out0 = (x @ base.T).astype(_np_dtype(out_dtype))
    got = st.add_batch_to(x, out0.copy())
    # = the members applied one after another to a float32 out, rounded once
    wide = out0.astype(np.float32)
    for m in order:
        m.add_batch_to(x, wide)
    assert_same_bits(got, wide.astype(got.dtype), "stack = members in order, one rounding")
    ref, np32 = ref_linear([(p1, None), (d1, base), (p2, None), (d2, base)], x,
                           out0.astype(np.float32))
    assert_accurate(wide, ref, np32, "stack vs PEFT's rule")
    assert_same_bits(st.add_to(x[2], out0[2].copy()), got[2], "stack decode")


def _alone(entry, x, out, mul=1.0):
    """entry applied alone to one position with its scales multiplied by mul (as LoraScale
    values), restored afterwards."""
    deltas = list(entry) if isinstance(entry, lora.LoraStack) else [entry]
    scales = {id(d.scale): d.scale for d in deltas}
    old = {k: s.value for k, s in scales.items()}
    try:
        for k, s in scales.items():
            s.set(old[k] * mul)
        return entry.add_to(x, out)
    finally:
        for k, s in scales.items():
            s.set(old[k])


def test_bank_rows_are_their_entry_alone(isa):
    rng = _rng(10)
    base, d1, d2, p1, p2 = _linear_set(rng)
    bank = lora.LoraBank([p1, d1, lora.LoraStack([d2, p2, d1]), None, p2])
    ids = np.array([0, 1, 2, 3, 4, -1, 1, 2, 1, 0, 2, 1], np.int64)
    x = rng.standard_normal((12, 24)).astype(np.float32)
    out0 = (x @ base.T).astype(np.float32)
    got = bank.add_batch_to(x, out0.copy(), ids)
    for b, e in enumerate(ids):
        want = out0[b].copy()
        if e >= 0 and bank[e] is not None:
            _alone(bank[e], x[b], want)
        assert_same_bits(got[b], want, f"row {b} (entry {e})")
    # per-position scales: each DoRA position's factor from its own scale, 0 included
    scales = np.array([0.5, 2.0, 0.0, 1.0, 3.0, 1.0, 0.0, -1.5, 0.25, 1.0, 1.0, 1.0])
    got = bank.add_batch_to(x, out0.copy(), ids, scales=scales)
    for b, e in enumerate(ids):
        want = out0[b].copy()
        if e >= 0 and bank[e] is not None and (scales[b] != 0 or e in (1, 2)):
            _alone(bank[e], x[b], want, scales[b])
        assert_same_bits(got[b], want, f"row {b} (entry {e}, scale {scales[b]})")
    assert not np.array_equal(got[6], out0[6])   # a DoRA entry at multiplier 0 still rescales


def test_bank_of_embeddings(isa):
    rng = _rng(11)
    table = rng.standard_normal((60, 20)).astype(np.float32)
    e1, _ = make_dora(rng, 4, 60, 20, alpha=4, embedding=True, base=table)
    p = lora.LoraDelta(rng.standard_normal((3, 20)), rng.standard_normal((60, 3)))
    bank = lora.LoraBank([e1, p, lora.LoraStack([p, e1])])
    tok = np.array([5, 0, 59, 7, 7, 3])
    ids = np.array([0, 1, 2, -1, 0, 2], np.int64)
    got = bank.add_rows_to(tok, table[tok].copy(), ids)
    for i, e in enumerate(ids):
        want = table[tok[i]].copy()
        if e >= 0:
            bank[e].add_row_to(int(tok[i]), want)
        assert_same_bits(got[i], want, f"row {i}")


def test_adapter_set_with_dora_beside_plain(isa):
    rng = _rng(12)
    base, d1, d2, p1, p2 = _linear_set(rng)
    sc = lora.LoraScale(1.0)
    dora_ad = lora.LoraAdapter({"q": lora.DoraDelta(*d1.lora_weights(), d1.magnitude, base,
                                                    alpha=8, scale=sc)},
                               name="dora", alpha=8, scale=sc)
    plain_ad = lora.LoraAdapter({"q": p1}, name="plain", alpha=3, scale=p1.scale)
    aset = lora.AdapterSet({"dora": dora_ad, "plain": plain_ad})
    slots = aset.slots(["plain", "dora", None, "dora"])
    x = rng.standard_normal((4, 24)).astype(np.float32)
    out0 = (x @ base.T).astype(np.float32)
    for scales in (None, np.array([1.0, 0.5, 1.0, 2.0])):
        got = aset.bank("q").add_batch_to(x, out0.copy(), slots, scales=scales)
        for b, s in enumerate(slots):
            want = out0[b].copy()
            if s >= 0:
                entry = aset[aset.names[s]]["q"]
                _alone(entry, x[b], want, 1.0 if scales is None else scales[b])
            assert_same_bits(got[b], want, f"row {b}")


def test_wrong_op_for_the_kind_is_refused():
    rng = _rng(13)
    d, _ = make_dora(rng, 2, 8, 6)
    e, _ = make_dora(rng, 2, 8, 6, embedding=True)
    with pytest.raises(TypeError, match="embedding=True"):
        d.add_rows_to([1], np.zeros((1, 6), np.float32))
    with pytest.raises(TypeError, match="embedding"):
        e.add_to(np.zeros(6, np.float32), np.zeros(8, np.float32))
    with pytest.raises(TypeError, match="Linear"):
        lora.LoraBank([d]).add_rows_to([1], np.zeros((1, 6), np.float32), [0])


# ------------------------------------------------------------------ merges


@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("embedding", [False, True])
def test_merge_is_peft_rule_and_unmerge_undoes_it(w_dtype, embedding):
    rng = _rng(14)
    w0 = rng.standard_normal((30, 18)).astype(_np_dtype(w_dtype))
    d, _ = make_dora(rng, 4, 30, 18, alpha=4, embedding=embedding, base=w0)
    for w in (w0.copy(), np.ascontiguousarray(w0.T).T):   # also a fan_in_fan_out view
        got = d.merge_into(w)
        assert got is w
        a, b = weights64(d)
        v = w0.astype(np.float64) + d.effective_scale * b @ a
        g = factor64(d, w0).astype(np.float32).astype(np.float64)
        want = v * (g[None, :] if embedding else g[:, None])
        tol = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[w_dtype]
        np.testing.assert_allclose(w.astype(np.float64), want, rtol=tol, atol=tol)
        d.unmerge_from(w)
        np.testing.assert_allclose(w.astype(np.float64), w0.astype(np.float64),
                                   rtol=4 * tol, atol=4 * tol)
    with pytest.raises(ValueError, match="without a merge_into"):
        d.unmerge_from(w0.copy())


# ------------------------------------------------------------------ bad inputs


def test_bad_inputs_are_refused_before_any_write():
    rng = _rng(15)
    a, b = rng.standard_normal((3, 6)), rng.standard_normal((8, 3))
    w = rng.standard_normal((8, 6)).astype(np.float32)
    with pytest.raises(ValueError, match="magnitude must have 8 values"):
        lora.DoraDelta(a, b, np.ones(6), w)
    with pytest.raises(ValueError, match="magnitude must have 6 values"):
        lora.DoraDelta(a, b, np.ones(8), w, embedding=True)
    with pytest.raises(lora.LoraShapeError, match=r"\[8 x 6\].*got shape \(6, 8\)"):
        lora.DoraDelta(a, b, np.ones(8), w.T.copy())
    with pytest.raises(ValueError, match="not a finite float32"):
        lora.DoraDelta(a, b, np.full(8, np.nan), w)
    with pytest.raises(ValueError, match=r"not a finite float32 \(1e\+39\) at index 0"):
        lora.DoraDelta(a, b, np.full(8, 1e39), w)  # finite in float64, inf in float32
    # a zero-norm row: W's row 5 and B's row 5 are 0, so |W_5 + s (B A)_5| = 0
    w[5] = 0.0
    b[5] = 0.0
    d = lora.DoraDelta(a, b, np.ones(8), w)
    x = rng.standard_normal((3, 6)).astype(np.float32)
    out = rng.standard_normal((3, 8)).astype(np.float32)
    before = out.copy()
    for call in (lambda: d.add_batch_to(x, out), lambda: d.add_to(x[0], out[0]),
                 lambda: lora.LoraBank([None, d]).add_batch_to(x, out, [1, -1, 1]),
                 lambda: d.merge_into(w.copy())):
        with pytest.raises(ValueError, match="row 5.*norm 0"):
            call()
        assert_same_bits(out, before, "out untouched")


# ------------------------------------------------------------------ PEFT's own files


def _peft_dora_model(tmp_path, dtype="float32", fan_in_fan_out=False):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    if fan_in_fan_out:
        cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2,
                                      n_positions=32)
        base = transformers.GPT2LMHeadModel(cfg).eval()
        targets = ["c_attn", "c_proj"]
    else:
        cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32,
                                       attention_bias=True)
        base = transformers.LlamaForCausalLM(cfg).eval()
        targets = ["q_proj", "v_proj", "down_proj", "embed_tokens"]
    base = base.to(getattr(torch, dtype))
    state = {k: v.clone() for k, v in base.state_dict().items()}
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, use_dora=True, init_lora_weights=False, target_modules=targets,
        fan_in_fan_out=fan_in_fan_out))
    with torch.no_grad():    # a trained magnitude differs from the base's norm
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(torch.rand_like(p) + 0.5)
    model.eval()
    path = tmp_path / "dora"
    model.save_pretrained(path)
    return torch, model, state, path


def _dora_layers(model):
    from peft.tuners.lora import LoraLayer
    return {name.replace("base_model.model.", ""): m for name, m in model.named_modules()
            if isinstance(m, LoraLayer)}


@pytest.mark.model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peft_files_match_peft_layers(tmp_path, dtype):
    torch, model, state, path = _peft_dora_model(tmp_path, dtype)
    for base in (state, model.state_dict()):   # the model's names, or PEFT's base_layer ones
        adapter = lora.load_peft(path, base=base)
        layers = _dora_layers(model)
        assert set(adapter) == set(layers) and len(adapter) == 4
        for name, layer in layers.items():
            d = adapter[name]
            assert isinstance(d, lora.DoraDelta)
            w = layer.get_base_layer().weight
            if d.embedding:
                tok = torch.tensor([0, 5, 95, 5])
                with torch.no_grad():
                    want = layer(tok).float().numpy()
                    out = w[tok].float().numpy().copy()
                d.add_rows_to(tok.numpy(), out)
            else:
                x = torch.randn(5, d.cols, dtype=w.dtype)
                bias = layer.get_base_layer().bias
                with torch.no_grad():
                    want = layer(x).float().numpy()
                    out = (x.float() @ w.float().T).numpy()   # W x without the bias
                d.add_batch_to(x.float().numpy(), out)
                if bias is not None:
                    out += bias.float().numpy()
            tol = 2e-5 if dtype == "float32" else 3e-2
            np.testing.assert_allclose(out, want, rtol=tol, atol=tol * np.abs(want).max(),
                                       err_msg=name)


@pytest.mark.model
def test_peft_fan_in_fan_out_file(tmp_path):
    torch, model, state, path = _peft_dora_model(tmp_path, fan_in_fan_out=True)
    adapter = lora.load_peft(path, base=state)
    for name, layer in _dora_layers(model).items():
        d = adapter[name]
        w = layer.get_base_layer().weight     # Conv1D: [in, out]
        x = torch.randn(3, d.cols)
        with torch.no_grad():
            want = layer(x).numpy()
            out = (x @ w).numpy()
        d.add_batch_to(x.numpy(), out)
        out += layer.get_base_layer().bias.detach().numpy()
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5 * np.abs(want).max(),
                                   err_msg=name)


@pytest.mark.model
def test_peft_file_refusals(tmp_path):
    torch, model, state, path = _peft_dora_model(tmp_path)
    with pytest.raises(lora.LoraFormatError, match="pass base="):
        lora.load_peft(path)
    missing = {k: v for k, v in state.items() if "v_proj" not in k}
    with pytest.raises(lora.LoraFormatError, match="self_attn.v_proj"):
        lora.load_peft(path, base=missing)
    wrong = dict(state)
    key = "model.layers.0.self_attn.q_proj.weight"
    wrong[key] = state[key][:, :-1]
    with pytest.raises(lora.LoraFormatError, match=r"q_proj.*\[32 x 32\]"):
        lora.load_peft(path, base=wrong)


def test_pickles_keep_the_statistics_not_the_base():
    import copy
    import pickle

    rng = _rng(16)
    d, base = make_dora(rng, 5, 30, 200, "float16", alpha=5, scale=0.75)
    x = rng.standard_normal((4, 200)).astype(np.float32)
    out0 = (x @ base.T).astype(np.float32)
    blob = pickle.dumps(d)
    assert len(blob) < base.nbytes     # the base is not in it
    again = pickle.loads(blob)
    assert isinstance(again, lora.DoraDelta) and again.scale.value == 0.75
    assert_same_bits(again.add_batch_to(x, out0.copy()), d.add_batch_to(x, out0.copy()),
                     "unpickled")
    assert_same_bits(again.norm, d.norm, "norm")
    deep = copy.deepcopy(d)
    deep.scale.set(2.0)
    assert d.scale.value == 0.75
    shallow = copy.copy(d)
    assert shallow.scale is d.scale
    # in a stack beside a plain delta sharing its LoraScale: shared again after loading
    p = lora.LoraDelta(rng.standard_normal((3, 200)), rng.standard_normal((30, 3)), scale=d.scale)
    st = pickle.loads(pickle.dumps(lora.LoraStack([p, d])))
    assert st[0].scale is st[1].scale and isinstance(st[1], lora.DoraDelta)
    assert_same_bits(st.add_batch_to(x, out0.copy()),
                     lora.LoraStack([p, d]).add_batch_to(x, out0.copy()), "stack unpickled")
    with pytest.raises(ValueError, match="statistics"):   # a corrupt pickle is refused
        fn, args = d._parts()
        fn(args[0], args[1], args[2][:-1], *args[3:])


# ------------------------------------------------------------------ accelerate_peft


def _accel_model(dtype="float32", seed=0):
    """A Llama with biases, a DoRA adapter "d" (Linear and Embedding, magnitudes away from the
    norms) and a plain one "p" on the same layers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   attention_bias=True)
    base = transformers.LlamaForCausalLM(cfg).eval()
    targets = ["q_proj", "v_proj", "o_proj", "down_proj", "embed_tokens"]
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, use_dora=True, init_lora_weights=False, target_modules=targets),
        adapter_name="d")
    model.add_adapter("p", peft.LoraConfig(r=3, lora_alpha=6, init_lora_weights=False,
                                           target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(torch.rand_like(p) + 0.5)
            elif dtype != "float32" and "lora_" not in name:
                p.data = p.data.to(getattr(torch, dtype))
    return torch, model.eval()


def _ids(torch, batch=3, t=9, seed=1):
    return torch.randint(0, 96, (batch, t), generator=torch.Generator().manual_seed(seed))


def _close(got, ref, what=""):
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= 1e-5 * max(scale, 1.0), f"{what}: |ours - PEFT| = {err:.3e} (|PEFT| {scale:.3g})"


def _both(torch, model, fn):
    with torch.no_grad():
        ref = fn()
        with lora.accelerate_peft(model) as acc:
            got = fn()
            status = (acc.accelerated, acc.skipped)
    return ref, got, status


@pytest.mark.model
def test_accelerated_dora_layers_match_peft():
    torch, model = _accel_model()
    x = _ids(torch)
    for active in (["d"], ["d", "p"], ["p", "d"]):
        model.base_model.set_adapter(active)
        ref, got, (accel, skipped) = _both(torch, model, lambda: model(x).logits)
        _close(got, ref, f"active {active}")
        assert len(accel) == 9 and not skipped   # 4 Linear x 2 layers + the embedding
    model.base_model.set_adapter("d")
    with torch.no_grad():
        want = model.generate(x, max_new_tokens=6, do_sample=False)
        with lora.accelerate_peft(model):
            assert torch.equal(model.generate(x, max_new_tokens=6, do_sample=False), want)


@pytest.mark.model
def test_accelerated_mixed_batch_of_dora_and_plain_is_each_alone():
    torch, model = _accel_model(seed=1)
    x = _ids(torch, batch=4)
    names = ["d", "p", "__base__", "d"]
    with torch.no_grad():
        with lora.accelerate_peft(model) as acc:
            got = model(x, adapter_names=names).logits
            assert not acc.skipped
        alone = []
        for i, a in enumerate(names):      # PEFT refuses DoRA in adapter_names: each alone
            if a == "__base__":
                with model.disable_adapter():
                    alone.append(model(x[i:i + 1]).logits)
            else:
                model.set_adapter(a)
                alone.append(model(x[i:i + 1]).logits)
    _close(got, torch.cat(alone), "mixed batch")


@pytest.mark.model
def test_accelerated_dora_sees_scale_weight_merge_and_disable_changes():
    torch, model = _accel_model(seed=2)
    model.set_adapter("d")
    x = _ids(torch)
    layer0 = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        acc = lora.accelerate_peft(model)
        states = []

        def step(what, changed=True):
            got = model(x).logits
            assert acc.accelerated and not acc.skipped, what
            acc.restore()
            ref = model(x).logits
            _close(got, ref, what)
            if changed and states:   # the change was seen (else the check above is vacuous)
                assert not torch.allclose(got, states[-1]), what
            states.append(got)
            return lora.accelerate_peft(model)

        acc = step("first")
        for mod in model.modules():
            if hasattr(mod, "set_scale") and hasattr(mod, "lora_A") and "d" in mod.lora_A:
                mod.set_scale("d", 0.3)
        acc = step("set_scale")
        with peft_rescale(model, 2.0):
            acc = step("rescale_adapter_scale")
        layer0.base_layer.weight.mul_(1.25)                        # the base, in place
        acc = step("base weight in place")
        layer0.lora_magnitude_vector["d"].weight.mul_(0.8)         # the magnitude, in place
        acc = step("magnitude in place")
        down = model.base_model.model.model.layers[1].mlp.down_proj  # no bias: the short path
        model(x)
        assert acc._layers[id(down)].plan is not None
        down.lora_magnitude_vector["d"].weight.mul_(1.3)
        acc = step("magnitude in place, short path")
        model(x)
        down.base_layer.weight.add_(0.01)
        acc = step("base weight in place, short path")
        layer0.lora_B["d"].weight.data = torch.randn_like(layer0.lora_B["d"].weight) * 0.1
        acc = step("new storage for lora_B")
        layer0.lora_A["d"].weight.data.add_(0.25)                  # raw .data: needs refresh
        acc.refresh()
        acc = step("raw .data write after refresh")
        model.merge_adapter()
        acc = step("merged", changed=False)
        model.unmerge_adapter()
        acc = step("unmerged", changed=False)
        with model.disable_adapter():
            acc = step("disabled")
        acc.restore()
    with torch.no_grad():                   # restore gives PEFT back bit for bit
        before = model(x).logits
        lora.accelerate_peft(model).restore()
        assert torch.equal(model(x).logits, before)


def peft_rescale(model, factor):
    from peft.helpers import rescale_adapter_scale
    return rescale_adapter_scale(model, factor)


@pytest.mark.model
def test_accelerated_bfloat16_dora_error_no_larger_than_peft():
    torch, exact_model = _accel_model(seed=3)
    _, half = _accel_model("bfloat16", seed=3)
    x = _ids(torch, batch=2, t=8)
    for m in (exact_model, half):
        m.set_adapter("d")
    with torch.no_grad():
        exact = exact_model(x).logits.double()
    peft_half, ours_half, (accel, skipped) = _both(torch, half, lambda: half(x).logits)
    assert accel and not skipped
    e_peft = (peft_half.double() - exact).abs().mean().item()
    e_ours = (ours_half.double() - exact).abs().mean().item()
    assert e_ours <= 1.5 * e_peft, (e_ours, e_peft)


def test_stack_merge_with_a_dora_member_merges_in_order():
    rng = _rng(17)
    base, d1, d2, p1, p2 = _linear_set(rng)
    st = lora.LoraStack([p1, d1, p2])
    w = base.copy()
    st.merge_into(w)
    want = base.copy()
    for m in (p1, d1, p2):
        m.merge_into(want)
    assert_same_bits(w, want, "stack merge = members merged in order")
    st.unmerge_from(w)
    np.testing.assert_allclose(w, base, rtol=1e-5, atol=1e-5)


def test_a_stack_refuses_dora_members_of_both_norm_axes():
    """An embedding DoRA delta (norm per column) and a Linear one (per row) of the same shape
    are two kinds of layer: one stack holds one kind (plain members go with either)."""
    rng = _rng(19)
    lin, base = make_dora(rng, 2, 8, 8)
    emb, _ = make_dora(rng, 2, 8, 8, embedding=True, base=base)
    plain = lora.LoraDelta(rng.standard_normal((2, 8)), rng.standard_normal((8, 2)))
    st = lora.LoraStack([plain, lin])
    with pytest.raises(ValueError, match="normalised per"):
        st.append(emb)
    assert len(st) == 2
    with pytest.raises(ValueError, match="normalised per"):
        lora.LoraStack([emb, plain, lin])
    assert len(lora.LoraStack([emb, plain])) == 2


def test_many_distinct_scales_in_one_call():
    """More distinct per-position scales than the delta keeps factors for: every position still
    gets its own scale's factor (the factors of the call stay alive while it runs)."""
    rng = _rng(18)
    d, base = make_dora(rng, 4, 24, 16, alpha=4)
    n = 40
    x = rng.standard_normal((n, 16)).astype(np.float32)
    out0 = (x @ base.T).astype(np.float32)
    scales = np.linspace(0.1, 4.0, n)
    bank = lora.LoraBank([d])
    got = bank.add_batch_to(x, out0.copy(), np.zeros(n, np.int64), scales=scales)
    for b in range(n):
        assert_same_bits(got[b], _alone(d, x[b], out0[b].copy(), scales[b]), f"row {b}")

