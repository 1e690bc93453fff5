"""`load_peft` / `load_gguf` / `LoraAdapter` against the upstream tools' own outputs, and against
files written here (valid variants and every kind of broken file).

Tolerances.  Every comparison is with float32 results that PEFT (torch) or llama.cpp (ggml)
computed, and we compute in float32 too, in a possibly different order.  A float32 sum of n terms
is off by at most gamma_n * sum|terms| (Higham, gamma_n = n u / (1 - n u), u = 2**-24) whatever the
order, so two such results differ by at most twice that: ``_bound`` computes it element-wise from
the actual operands.  Each test also checks that the adapter's contribution is far larger than the
bound, so a wrong scale, a wrong transpose or a missing delta cannot pass.
"""

import json
import math
import os
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

import lora
import lora.loaders.adapter
from lora import LoraAdapter, LoraFormatError, LoraScale, LoraShapeError, load_gguf, load_peft

import _adapter_files as af
from conftest import assert_format_error

FIXTURES = Path(__file__).parent / "fixtures"
PEFT_DIR = FIXTURES / "peft_r8_alpha16"
PEFT_REF = FIXTURES / "peft_r8_alpha16_reference.npz"
PEFT_ALORA_DIR = FIXTURES / "peft_r8_alpha16_alora"      # the same adapter as aLoRA, no embedding
ALORA_TOKENS = (17, 42, 5)
GGUF_LORA = FIXTURES / "gguf" / "lora_r8_alpha16_f32.gguf"
GGUF_BASE = FIXTURES / "gguf" / "base_f32.gguf"
GGUF_MERGED = FIXTURES / "gguf" / "merged_r8_alpha16_f32_s1.gguf"
GGUF_REF = FIXTURES / "llamacpp_r8_alpha16_f32_reference.npz"
_BASE = json.loads((FIXTURES / "base_config.json").read_text())
N_HEAD, N_HEAD_KV = _BASE["num_attention_heads"], _BASE["num_key_value_heads"]

U32 = 2.0 ** -24        # unit roundoff of float32


def _gamma(n):
    return n * U32 / (1 - n * U32)


def _bound(magnitude, n_terms):
    """Largest difference between two float32 evaluations (any order) of a sum of ``n_terms``
    terms whose absolute values add up to ``magnitude`` (float64, element-wise)."""
    return 2 * _gamma(n_terms) * magnitude


def _assert_close(got, want, bound, *, signal, margin=1e3):
    """``|got - want| <= bound`` element-wise, and ``signal`` (the adapter's contribution) at least
    ``margin`` times the bound, so that a wrong scale, transpose or delta cannot pass."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    assert np.abs(signal).max() > margin * bound.max(), "the delta is too small to be tested"


def _meta(npz_path):
    with np.load(npz_path) as z:
        return json.loads(str(z["meta_json"]))


PEFT_MODULES = sorted(_meta(PEFT_REF)["modules"])
GGUF_TENSORS = sorted(_meta(GGUF_REF)["tensors"])


@pytest.fixture(scope="module")
def peft_ref():
    with np.load(PEFT_REF) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def gguf_ref():
    with np.load(GGUF_REF) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def peft_adapter():
    return load_peft(PEFT_DIR)


def _require_storage(dtype):
    """Skip when the core cannot store ``dtype`` yet (half-precision storage lands after float32)."""
    try:
        lora.LoraDelta(np.ones((1, 2), np.float32), np.ones((3, 1), np.float32), dtype=dtype)
    except NotImplementedError as exc:
        pytest.skip(f"LoraDelta has no {dtype} storage in this build yet: {exc}")


def _gguf_base_weights(path):
    reader = GGUFReader(str(path))
    return {t.name: np.array(t.data) for t in reader.tensors}


# ------------------------------------------------------------------------------------------
# PEFT fixture: our deltas against PEFT's own forward pass and merge_and_unload
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", PEFT_MODULES)
def test_peft_forward_delta_matches_peft(peft_adapter, peft_ref, module):
    delta = peft_adapter[module]
    x, base_out, peft_out = (peft_ref[f"{module}/{k}"] for k in ("x", "base_out", "peft_out"))
    A = peft_ref[f"{module}/lora_A"].astype(np.float64)
    B = peft_ref[f"{module}/lora_B"].astype(np.float64)
    s = float(peft_ref[f"{module}/scale"])
    out = base_out.copy()
    if x.dtype.kind == "i":          # embedding: PEFT adds s * A[:, t] @ B.T to token t's row
        assert delta.add_rows_to(x, out) is out
        magnitude = np.abs(base_out) + s * np.abs(A[:, x].T) @ np.abs(B.T)
        n_terms = A.shape[0] + 2
    else:                            # linear: PEFT adds s * (x @ A.T) @ B.T
        assert delta.add_batch_to(x, out) is out
        magnitude = np.abs(base_out) + s * (np.abs(x) @ np.abs(A.T)) @ np.abs(B.T)
        n_terms = A.shape[1] + A.shape[0] + 2
    _assert_close(out, peft_out, _bound(magnitude, n_terms), signal=peft_out - base_out)


@pytest.mark.parametrize("module", PEFT_MODULES)
def test_peft_merge_matches_merge_and_unload(peft_adapter, peft_ref, module):
    delta = peft_adapter[module]
    base, merged = peft_ref[f"{module}/base_weight"], peft_ref[f"{module}/merged_weight"]
    A = peft_ref[f"{module}/lora_A"].astype(np.float64)
    B = peft_ref[f"{module}/lora_B"].astype(np.float64)
    s = float(peft_ref[f"{module}/scale"])
    w = base.copy()
    assert delta.merge_into(w) is w
    # PEFT's delta weight: B @ A for Linear, (B @ A).T for Embedding; either way r terms.
    prod = np.abs(B) @ np.abs(A)
    magnitude = np.abs(base) + s * (prod.T if "embed" in module else prod)
    _assert_close(w, merged, _bound(magnitude, A.shape[0] + 2), signal=merged - base)


def test_peft_adapter_metadata(peft_adapter, peft_ref):
    meta = _meta(PEFT_REF)["modules"]
    assert isinstance(peft_adapter, LoraAdapter)
    assert peft_adapter.name == "peft_r8_alpha16"
    assert peft_adapter.alpha == 16.0
    assert peft_adapter.dtype == "float32"
    assert sorted(peft_adapter) == PEFT_MODULES and len(peft_adapter) == len(PEFT_MODULES)
    total = 0
    for module, delta in peft_adapter.items():
        rows, cols = meta[module]["base_weight_shape"]     # embedding: [vocab, dim]
        assert (delta.rows, delta.cols, delta.rank) == (rows, cols, 8)
        assert delta.alpha == 16.0 and delta.dtype == "float32"
        assert delta.effective_scale == pytest.approx(meta[module]["scale"], rel=1e-12)
        assert delta.scale is peft_adapter.scale
        total += 8 * (rows + cols) * 4
    assert peft_adapter.resident_bytes == total
    peft_adapter.check_base({m: peft_ref[f"{m}/base_weight"].shape for m in PEFT_MODULES})


def test_peft_safetensors_path_loads_the_same_adapter(peft_adapter):
    other = load_peft(PEFT_DIR / "adapter_model.safetensors")
    assert other.name == "peft_r8_alpha16"
    assert list(other) == list(peft_adapter)
    for module in other:
        np.testing.assert_array_equal(other[module].delta_weight(), peft_adapter[module].delta_weight())


def test_shared_scale_rescales_every_delta():
    adapter = load_peft(PEFT_DIR, scale=1.0)
    before = {m: d.delta_weight() for m, d in adapter.items()}
    adapter.scale.set(0.25)
    for module, delta in adapter.items():
        assert delta.scale is adapter.scale
        assert delta.effective_scale == pytest.approx(0.5, rel=1e-12)     # 0.25 * 16 / 8
        # effective scales 2.0 -> 0.5: powers of two, so the rescaled result is exact
        np.testing.assert_array_equal(delta.delta_weight(), 0.25 * before[module])
    shared = LoraScale(3.0)
    again = load_peft(PEFT_DIR, scale=shared)
    assert again.scale is shared and all(d.scale is shared for d in again.values())


def test_scale_zero_leaves_merge_target_bit_identical(peft_ref):
    adapter = load_peft(PEFT_DIR, scale=0.0)
    module = "model.layers.0.self_attn.q_proj"
    w = peft_ref[f"{module}/base_weight"].copy()
    adapter[module].merge_into(w)
    np.testing.assert_array_equal(w, peft_ref[f"{module}/base_weight"])


def test_adapter_is_a_read_only_mapping(peft_adapter):
    with pytest.raises(TypeError):
        peft_adapter["lm_head"] = peft_adapter["lm_head"]
    with pytest.raises(TypeError):
        del peft_adapter["lm_head"]
    with pytest.raises(AttributeError):
        peft_adapter.name = "other"
    with pytest.raises(AttributeError):
        peft_adapter.scale = LoraScale(2.0)
    with pytest.raises(KeyError):
        peft_adapter["model.layers.9.self_attn.q_proj"]
    assert "lm_head" in peft_adapter and "nothing" not in peft_adapter
    assert "peft_r8_alpha16" in repr(peft_adapter)


# ------------------------------------------------------------------------------------------
# GGUF fixture: our merge against llama-export-lora's
# ------------------------------------------------------------------------------------------


def _gguf_product(gguf_ref, tensor):
    """|B| @ |A| (float64) for the stored pair, and the rank: the magnitude of s * B @ A."""
    a = np.abs(gguf_ref[f"{tensor}/lora_a"].astype(np.float64))
    b = np.abs(gguf_ref[f"{tensor}/lora_b"].astype(np.float64))
    if tensor == "token_embd.weight":   # flipped: merged - base = s * lora_a @ lora_b.T
        return a @ b.T, a.shape[1]
    return b @ a, a.shape[0]            # merged - base = s * lora_b @ lora_a


def _check_gguf_merge(delta, gguf_ref, tensor, base, want, s):
    prod, rank = _gguf_product(gguf_ref, tensor)
    w = base.copy()
    assert delta.merge_into(w) is w
    _assert_close(w, want, _bound(np.abs(base) + s * prod, rank + 2), signal=want - base)


@pytest.mark.parametrize("user_scale", [1.0, 0.5])
@pytest.mark.parametrize("tensor", GGUF_TENSORS)
def test_gguf_merge_matches_llama_export_lora(gguf_ref, tensor, user_scale):
    suffix = "" if user_scale == 1.0 else "_scaled0.5"
    s = float(gguf_ref[f"{tensor}/scale{suffix}"])
    delta = load_gguf(GGUF_LORA, scale=user_scale)[tensor]
    assert delta.effective_scale == pytest.approx(s, rel=1e-12)
    _check_gguf_merge(delta, gguf_ref, tensor, gguf_ref[f"{tensor}/base_weight"],
                      gguf_ref[f"{tensor}/merged_weight{suffix}"], s)


def test_gguf_scale_set_matches_scaled_export(gguf_ref):
    """Setting the shared scale after loading is llama-export-lora's --lora-scaled."""
    adapter = load_gguf(GGUF_LORA)
    adapter.scale.set(0.5)
    for tensor in GGUF_TENSORS:
        _check_gguf_merge(adapter[tensor], gguf_ref, tensor, gguf_ref[f"{tensor}/base_weight"],
                          gguf_ref[f"{tensor}/merged_weight_scaled0.5"],
                          float(gguf_ref[f"{tensor}/scale_scaled0.5"]))


def test_gguf_adapter_metadata():
    adapter = load_gguf(GGUF_LORA)
    meta = _meta(GGUF_REF)["tensors"]
    assert adapter.name == "Peft_R8_Alpha16"           # general.name
    assert adapter.alpha == 16.0 and adapter.dtype == "float32"
    assert sorted(adapter) == GGUF_TENSORS
    for tensor, delta in adapter.items():
        n_in, n_out = meta[tensor]["base_ne"]
        assert (delta.rows, delta.cols, delta.rank) == (n_out, n_in, meta[tensor]["rank"])
        assert delta.alpha == 16.0


def test_gguf_against_the_real_base_and_merged_files(gguf_ref):
    """check_base with the base model's own shapes, and a merge of the base GGUF's tensors that
    reproduces the ones llama-export-lora wrote into its merged GGUF."""
    adapter = load_gguf(GGUF_LORA)
    base = _gguf_base_weights(GGUF_BASE)
    merged = _gguf_base_weights(GGUF_MERGED)
    adapter.check_base({name: w.shape for name, w in base.items()})
    for tensor, delta in adapter.items():
        _check_gguf_merge(delta, gguf_ref, tensor, base[tensor], merged[tensor],
                          float(gguf_ref[f"{tensor}/scale"]))


def test_gguf_renamed_to_hf_is_the_peft_adapter(peft_adapter, gguf_ref):
    """The same adapter through both loaders: renaming the GGUF one to Hugging Face names undoes
    the converter's attn_q/attn_k row permutation and gives the PEFT adapter's factors -- bit for
    bit, as both files are F32 -- which also pins the two embedding transposes to each other."""
    gg = load_gguf(GGUF_LORA, scale=0.5)
    hf = gg.renamed("hf", n_head=N_HEAD, n_head_kv=N_HEAD_KV)
    assert isinstance(hf, LoraAdapter) and hf.scale is gg.scale
    assert (hf.name, hf.alpha, hf.invocation_tokens) == (gg.name, gg.alpha, None)
    assert sorted(hf) == sorted(peft_adapter)
    peft_adapter.scale.set(0.5)
    try:
        for tensor in GGUF_TENSORS:
            module = str(gguf_ref[f"{tensor}/hf_module"])
            got, want = hf[module], peft_adapter[module]
            assert got.scale is gg.scale and got.effective_scale == want.effective_scale
            for x, y in zip(got.lora_weights(), want.lora_weights()):
                np.testing.assert_array_equal(x, y, err_msg=f"{tensor} -> {module}")
            perm = gguf_ref.get(f"{tensor}/hf_row_perm")     # the converter's own row order
            if perm is not None:
                heads = N_HEAD if "attn_q" in tensor else N_HEAD_KV
                np.testing.assert_array_equal(
                    lora.loaders.adapter.llama_rope_permutation(len(perm), heads), perm)
                np.testing.assert_array_equal(gg[tensor].lora_weights()[1],
                                              want.lora_weights()[1][perm])
    finally:
        peft_adapter.scale.set(1.0)


def test_renamed_back_to_gguf_gives_the_gguf_bits():
    gg = load_gguf(GGUF_LORA)
    back = gg.renamed("hf", n_head=N_HEAD, n_head_kv=N_HEAD_KV).renamed(
        "gguf", n_head=N_HEAD, n_head_kv=N_HEAD_KV)
    assert list(back) == list(gg) and back.scale is gg.scale
    for name, delta in gg.items():
        assert (back[name].dtype, back[name].alpha, back[name].effective_scale) == \
            (delta.dtype, delta.alpha, delta.effective_scale)
        for x, y in zip(back[name].lora_weights(), delta.lora_weights()):
            np.testing.assert_array_equal(x, y)
    gg.scale.set(0.25)                                   # shared: the renamed deltas follow
    assert back["output.weight"].effective_scale == gg["output.weight"].effective_scale == 0.5


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_renamed_keeps_half_precision_bits_rslora_and_alora(tmp_path, dtype):
    _require_storage(dtype)
    rng = np.random.default_rng(60)
    tensors = af.linear_pair(rng, "model.layers.3.self_attn.q_proj", 24, 16, 4)
    tensors.update(af.linear_pair(rng, "model.layers.3.self_attn.k_proj", 8, 16, 4))
    cfg = af.peft_config(use_rslora=True, alora_invocation_tokens=[9, 8])
    adapter = load_peft(af.write_peft(tmp_path / "p", tensors, cfg), dtype=dtype)
    gg = adapter.renamed("gguf", n_head=3, n_head_kv=1)
    assert list(gg) == ["blk.3.attn_k.weight", "blk.3.attn_q.weight"]      # file order
    assert gg.invocation_tokens == (9, 8) and gg.dtype == dtype
    for (name, d), (module, src) in zip(gg.items(), adapter.items()):
        assert d.rslora and d.effective_scale == src.effective_scale
        perm = lora.loaders.adapter.llama_rope_permutation(src.rows, 3 if "attn_q" in name else 1)
        (a, b), (sa, sb) = d.lora_weights(), src.lora_weights()
        np.testing.assert_array_equal(a.view(np.uint16), sa.view(np.uint16))   # A: never permuted
        np.testing.assert_array_equal(b.view(np.uint16), sb[perm].view(np.uint16))


def test_renamed_keeps_peft_alpha_zero_rule(tmp_path):
    """PEFT's lora_alpha = 0 is a zero delta; the renamed delta stays zero (it does not become
    llama.cpp's "no alpha", factor 1), while a GGUF file's missing alpha stays factor 1."""
    rng = np.random.default_rng(61)
    tensors = af.linear_pair(rng, "model.layers.0.mlp.up_proj", 24, 16, 4)
    with pytest.warns(UserWarning, match="alpha is 0"):
        adapter = load_peft(af.write_peft(tmp_path / "z", tensors,
                                          af.peft_config(lora_alpha=0, target_modules=["up_proj"])))
    adapter.scale.set(0.0)             # nothing to tell the rules apart by, but the loader's record
    gg = adapter.renamed("gguf", n_head=1, n_head_kv=1)
    gg.scale.set(3.0)
    assert gg["blk.0.ffn_up.weight"].effective_scale == 0.0
    assert adapter.renamed("gguf", n_head=1, n_head_kv=1).renamed(
        "hf", n_head=1, n_head_kv=1)["model.layers.0.mlp.up_proj"].effective_scale == 0.0
    path = af.write_gguf(tmp_path / "a.gguf", af.gguf_linear(rng, "blk.0.ffn_up.weight", 24, 16, 4),
                         alpha=None)
    hf = load_gguf(path, scale=3.0).renamed("hf", n_head=1, n_head_kv=1)
    assert hf["model.layers.0.mlp.up_proj"].effective_scale == 3.0


def test_renamed_refuses_names_outside_the_map_and_bad_heads(peft_adapter, tmp_path):
    with pytest.raises(LoraFormatError, match=r"target '(lm_head|model\.[^']*)' has no Hugging"):
        peft_adapter.renamed("hf", n_head=N_HEAD, n_head_kv=N_HEAD_KV)     # already HF names
    gg = load_gguf(GGUF_LORA)
    with pytest.raises(LoraFormatError, match=rf"target '{list(gg)[0]}' has no GGUF name"):
        gg.renamed("gguf", n_head=N_HEAD, n_head_kv=N_HEAD_KV)                # already GGUF
    rng = np.random.default_rng(62)
    path = af.write_gguf(tmp_path / "qkv.gguf",
                         af.gguf_linear(rng, "blk.0.attn_qkv.weight", 24, 16, 4))
    with pytest.raises(LoraFormatError, match=r"'blk\.0\.attn_qkv\.weight'"):
        load_gguf(path).renamed("hf", n_head=2, n_head_kv=2)
    with pytest.raises(ValueError, match=r"attn_q.*n_head = 3.*multiple of 2 \* heads = 6"):
        gg.renamed("hf", n_head=3, n_head_kv=N_HEAD_KV)                    # q rows: 64
    with pytest.raises(ValueError, match=r"attn_k.*n_head_kv = 3"):
        gg.renamed("hf", n_head=N_HEAD, n_head_kv=3)                       # k rows: 32
    with pytest.raises(ValueError, match="to must be"):
        gg.renamed("llama", n_head=N_HEAD, n_head_kv=N_HEAD_KV)
    with pytest.raises(ValueError):
        gg.renamed("hf", n_head=0, n_head_kv=N_HEAD_KV)
    with pytest.raises(TypeError):
        gg.renamed("hf", n_head=4.0, n_head_kv=N_HEAD_KV)


# ------------------------------------------------------------------------------------------
# check_base
# ------------------------------------------------------------------------------------------


def test_check_base_reports_wrong_and_missing_targets(peft_adapter, peft_ref):
    shapes = {m: peft_ref[f"{m}/base_weight"].shape for m in PEFT_MODULES}
    shapes["model.layers.7.unrelated"] = (1, 1)                 # ignored: not a target
    peft_adapter.check_base(shapes)

    wrong = dict(shapes, **{"model.layers.0.self_attn.k_proj": (64, 64)})
    with pytest.raises(LoraShapeError) as exc:
        peft_adapter.check_base(wrong)
    msg = str(exc.value)
    assert "model.layers.0.self_attn.k_proj" in msg and "[32 x 64]" in msg and "[64 x 64]" in msg
    assert (exc.value.rows, exc.value.cols, exc.value.rank) == (32, 64, 8)

    missing = {k: v for k, v in shapes.items() if k != "lm_head"}
    with pytest.raises(LoraShapeError, match=r"'lm_head' \[96 x 64\] is missing"):
        peft_adapter.check_base(missing)

    # an [in, out] (fan_in_fan_out-style) shape is not accepted: shapes are (n_out, n_in)
    transposed = dict(shapes, **{"model.layers.0.mlp.down_proj": (160, 64)})
    with pytest.raises(LoraShapeError, match="down_proj"):
        peft_adapter.check_base(transposed)


# ------------------------------------------------------------------------------------------
# PEFT files written here: key spellings and config rules
# ------------------------------------------------------------------------------------------


def _peft_small(tmp_path, rng, *, dtype=np.float32, prefix=True, infix=None, config=None):
    tensors = {}
    tensors.update(af.linear_pair(rng, "model.layers.0.self_attn.q_proj", 24, 16, 4, dtype=dtype,
                                  prefix=prefix, infix=infix))
    tensors.update(af.linear_pair(rng, "model.layers.1.self_attn.k_proj", 8, 16, 4, dtype=dtype,
                                  prefix=prefix, infix=infix))
    tensors.update(af.embedding_pair(rng, "model.embed_tokens", 40, 16, 4, dtype=dtype,
                                     prefix=prefix, infix=infix))
    path = af.write_peft(tmp_path / "small", tensors, config or af.peft_config())
    return path, tensors


def _peft_pair(tensors, module, *, prefix=True, infix=None):
    """(B, A) in float64 in our layout: B [rows, r], A [r, cols]; embedding rows = vocab."""
    base = (af.PREFIX if prefix else "") + module
    mid = f".{infix}" if infix else ""
    if f"{base}.lora_A{mid}.weight" in tensors:
        return (tensors[f"{base}.lora_B{mid}.weight"].astype(np.float64),
                tensors[f"{base}.lora_A{mid}.weight"].astype(np.float64))
    A = tensors[f"{base}.lora_embedding_A{mid}"].astype(np.float64)   # [r, vocab]
    B = tensors[f"{base}.lora_embedding_B{mid}"].astype(np.float64)   # [dim, r]
    return A.T, B.T


def _peft_expected(tensors, module, scale, **kw):
    """s * B @ A in float64, our layout ([out, in]; embedding [vocab, dim])."""
    B, A = _peft_pair(tensors, module, **kw)
    return scale * B @ A


def _check_delta_weight(delta, tensors, module, scale, *, storage_u=0.0, **kw):
    """delta_weight() against s * B @ A: float32 rounding of r products, plus (when the file's
    values were rounded into a narrower storage dtype with unit roundoff ``storage_u``) up to
    2 * storage_u relative error per product."""
    B, A = _peft_pair(tensors, module, **kw)
    magnitude = abs(scale) * np.abs(B) @ np.abs(A)
    bound = _bound(magnitude, A.shape[0] + 1) + 2.0 * storage_u * magnitude
    _assert_close(delta.delta_weight(), scale * B @ A, bound, signal=scale * B @ A,
                  margin=10 if storage_u else 1e3)


@pytest.mark.parametrize("prefix, infix", [(True, None), (False, None), (True, "default"),
                                           (False, "my_adapter")])
def test_peft_key_spellings(tmp_path, prefix, infix):
    rng = np.random.default_rng(1)
    path, tensors = _peft_small(tmp_path, rng, prefix=prefix, infix=infix)
    adapter = load_peft(path)
    assert sorted(adapter) == ["model.embed_tokens", "model.layers.0.self_attn.q_proj",
                               "model.layers.1.self_attn.k_proj"]
    assert adapter.name == "small"
    for module, delta in adapter.items():
        _check_delta_weight(delta, tensors, module, 2.0, prefix=prefix, infix=infix)
    emb = adapter["model.embed_tokens"]
    assert (emb.rows, emb.cols, emb.rank) == (40, 16, 4)
    out = np.zeros((3, 16), np.float32)
    emb.add_rows_to(np.array([0, 39, 7]), out)
    B, A = _peft_pair(tensors, "model.embed_tokens", prefix=prefix, infix=infix)
    want = 2.0 * B[[0, 39, 7]] @ A          # PEFT: s * lora_embedding_A[:, t] @ lora_embedding_B.T
    _assert_close(out, want, _bound(2.0 * np.abs(B[[0, 39, 7]]) @ np.abs(A), 5), signal=want)


def test_peft_rslora(tmp_path):
    rng = np.random.default_rng(2)
    path, tensors = _peft_small(tmp_path, rng, config=af.peft_config(use_rslora=True, lora_alpha=6))
    adapter = load_peft(path, scale=0.5)
    for module, delta in adapter.items():
        assert delta.effective_scale == pytest.approx(0.5 * 6 / math.sqrt(4), rel=1e-12)
        _check_delta_weight(delta, tensors, module, 0.5 * 6 / 2.0)


def test_peft_rank_and_alpha_patterns_first_match_in_file_order(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {}
    tensors.update(af.linear_pair(rng, "model.layers.0.self_attn.q_proj", 8, 16, 2))
    tensors.update(af.linear_pair(rng, "model.layers.1.self_attn.q_proj", 8, 16, 4))
    tensors.update(af.linear_pair(rng, "model.layers.1.self_attn.k_proj", 8, 16, 4))
    tensors.update(af.linear_pair(rng, "model.layers.1.self_attn.qq_proj", 8, 16, 4))
    cfg = af.peft_config(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "qq_proj"],
        # "layers.0.self_attn.q_proj" precedes the wider "q_proj": layer 0 gets rank 2
        rank_pattern={"model.layers.0.self_attn.q_proj": 2, "q_proj": 4},
        # the first matching key wins even when a later one is more specific; "q_proj" must match
        # a whole path component, so it does not touch "qq_proj"; a regex key works as in PEFT
        alpha_pattern={"q_proj": 32, "model.layers.0.self_attn.q_proj": 1,
                       "layers\\.\\d\\.self_attn\\.k_.*": 2},
    )
    adapter = load_peft(af.write_peft(tmp_path / "pat", tensors, cfg))
    got = {m: (d.rank, d.alpha, d.effective_scale) for m, d in adapter.items()}
    assert got == {
        "model.layers.0.self_attn.q_proj": (2, 32.0, pytest.approx(16.0)),
        "model.layers.1.self_attn.q_proj": (4, 32.0, pytest.approx(8.0)),
        "model.layers.1.self_attn.k_proj": (4, 2.0, pytest.approx(0.5)),
        "model.layers.1.self_attn.qq_proj": (4, 8.0, pytest.approx(2.0)),
    }
    assert adapter.alpha == 8.0         # the file's default, not a per-module one


@pytest.mark.parametrize("which", ["rank_pattern", "alpha_pattern"])
def test_peft_pattern_key_matching_no_module_warns(tmp_path, which):
    """PEFT warns about a rank_pattern / alpha_pattern key that matches no module (a typo such as
    "q_porj") and ignores it; so does the loader, naming the key."""
    rng = np.random.default_rng(14)
    tensors = af.linear_pair(rng, "model.layers.0.self_attn.q_proj", 8, 16, 4)
    cfg = af.peft_config(**{which: {"q_porj": 64, "q_proj": 4}})
    path = af.write_peft(tmp_path / "typo", tensors, cfg)
    with pytest.warns(UserWarning, match=rf"{which} key 'q_porj' matches no module") as caught:
        adapter = load_peft(path)
    assert len(caught) == 1 and str(path / "adapter_config.json") in str(caught[0].message)
    assert "'q_proj'" not in str(caught[0].message)
    assert adapter["model.layers.0.self_attn.q_proj"].rank == 4


def test_peft_rank_pattern_mismatch_is_refused(tmp_path):
    rng = np.random.default_rng(4)
    tensors = af.linear_pair(rng, "model.layers.0.self_attn.q_proj", 8, 16, 4)
    path = af.write_peft(tmp_path / "rk", tensors, af.peft_config(rank_pattern={"q_proj": 2}))
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                         af.PREFIX + "model.layers.0.self_attn.q_proj.lora_A.weight", "rank_pattern")


def test_peft_fan_in_fan_out_uses_a_and_b_as_stored(tmp_path):
    """GPT-2 Conv1D: the base is stored [in, out]; the delta is merged through its transposed view
    and PEFT's merged Conv1D weight is W + s * (B @ A).T."""
    rng = np.random.default_rng(5)
    tensors = af.linear_pair(rng, "transformer.h.0.attn.c_attn", 48, 16, 4)
    cfg = af.peft_config(fan_in_fan_out=True, target_modules=["c_attn"])
    adapter = load_peft(af.write_peft(tmp_path / "gpt2", tensors, cfg))
    delta = adapter["transformer.h.0.attn.c_attn"]
    assert (delta.rows, delta.cols) == (48, 16)
    adapter.check_base({"transformer.h.0.attn.c_attn": (48, 16)})      # (n_out, n_in)
    conv_w = rng.standard_normal((16, 48)).astype(np.float32)            # Conv1D [in, out]
    want = conv_w + 2.0 * (tensors[af.PREFIX + "transformer.h.0.attn.c_attn.lora_B.weight"]
                           @ tensors[af.PREFIX + "transformer.h.0.attn.c_attn.lora_A.weight"]).T
    B, A = _peft_pair(tensors, "transformer.h.0.attn.c_attn")
    w = conv_w.copy()
    delta.merge_into(w.T)
    _assert_close(w, want, _bound(np.abs(conv_w) + 2.0 * (np.abs(B) @ np.abs(A)).T, 6),
                  signal=want - conv_w)


def test_peft_lora_alpha_zero_gives_a_zero_delta(tmp_path):
    rng = np.random.default_rng(6)
    path, _ = _peft_small(tmp_path, rng, config=af.peft_config(lora_alpha=0))
    with pytest.warns(UserWarning, match="alpha is 0 for 3 module"):
        adapter = load_peft(path)
    for delta in adapter.values():
        assert delta.alpha == 0.0 and delta.effective_scale == 0.0
        w = rng.standard_normal((delta.rows, delta.cols)).astype(np.float32)
        before = w.copy()
        delta.merge_into(w)
        np.testing.assert_array_equal(w, before)
        assert not delta.delta_weight().any()


def test_peft_alpha_pattern_zero_for_one_module(tmp_path):
    rng = np.random.default_rng(7)
    path, tensors = _peft_small(tmp_path, rng, config=af.peft_config(alpha_pattern={"k_proj": 0}))
    with pytest.warns(UserWarning, match=r"1 module\(s\) \(model.layers.1.self_attn.k_proj\)"):
        adapter = load_peft(path)
    assert adapter["model.layers.1.self_attn.k_proj"].effective_scale == 0.0
    assert adapter["model.layers.0.self_attn.q_proj"].effective_scale == 2.0


def test_peft_defaults_follow_loraconfig(tmp_path):
    """A config without r / lora_alpha gets PEFT's LoraConfig defaults (8 and 8)."""
    rng = np.random.default_rng(8)
    tensors = af.linear_pair(rng, "model.layers.0.self_attn.q_proj", 8, 16, 8)
    cfg = {"peft_type": "LORA", "target_modules": ["q_proj"]}
    adapter = load_peft(af.write_peft(tmp_path / "dflt", tensors, cfg))
    delta = adapter["model.layers.0.self_attn.q_proj"]
    assert adapter.alpha == 8.0 and delta.rank == 8 and delta.effective_scale == 1.0


@pytest.mark.parametrize("dtype, name", [(np.float16, "float16"), (ml_dtypes.bfloat16, "bfloat16")])
def test_peft_half_precision_storage_is_kept(tmp_path, dtype, name):
    _require_storage(name)
    rng = np.random.default_rng(9)
    path, tensors = _peft_small(tmp_path, rng, dtype=dtype)
    adapter = load_peft(path)
    assert adapter.dtype == name
    for module, delta in adapter.items():
        assert delta.dtype == name
        assert delta.resident_bytes == delta.rank * (delta.rows + delta.cols) * 2
        _check_delta_weight(delta, tensors, module, 2.0)   # stored exactly: only f32 rounding


def test_peft_dtype_argument_converts(tmp_path):
    rng = np.random.default_rng(10)
    path, tensors = _peft_small(tmp_path, rng, dtype=np.float16)
    adapter = load_peft(path, dtype="float32")
    assert adapter.dtype == "float32"
    for module, delta in adapter.items():
        _check_delta_weight(delta, tensors, module, 2.0)
    with pytest.raises(ValueError, match="dtype must be"):
        load_peft(path, dtype="int8")
    for bad in (float("nan"), 1e39):      # 1e39: a finite double, inf in float32
        with pytest.raises(ValueError):
            load_peft(path, scale=bad)
    with pytest.raises(ValueError, match="finite in float32"):
        load_gguf(GGUF_LORA, scale=-1e39)


def test_peft_float32_to_float16_storage(tmp_path):
    _require_storage("float16")
    rng = np.random.default_rng(11)
    path, tensors = _peft_small(tmp_path, rng)
    adapter = load_peft(path, dtype=np.float16)
    assert adapter.dtype == "float16"
    for module, delta in adapter.items():
        _check_delta_weight(delta, tensors, module, 2.0, storage_u=2.0 ** -11)


def test_peft_f64_becomes_float32_and_mixed_pair_is_float32(tmp_path):
    rng = np.random.default_rng(12)
    tensors = af.linear_pair(rng, "model.layers.0.self_attn.q_proj", 8, 16, 4, dtype=np.float64)
    mixed = af.linear_pair(rng, "model.layers.0.self_attn.k_proj", 8, 16, 4, dtype=np.float16)
    key_b = af.PREFIX + "model.layers.0.self_attn.k_proj.lora_B.weight"
    mixed[key_b] = mixed[key_b].astype(np.float32)
    tensors.update(mixed)
    adapter = load_peft(af.write_peft(tmp_path / "f64", tensors, af.peft_config()))
    assert adapter["model.layers.0.self_attn.q_proj"].dtype == "float32"
    assert adapter["model.layers.0.self_attn.k_proj"].dtype == "float32"
    # F64 -> float32 rounds each value once (u = 2**-24)
    _check_delta_weight(adapter["model.layers.0.self_attn.q_proj"], tensors,
                        "model.layers.0.self_attn.q_proj", 2.0, storage_u=U32)


def test_adapter_dtype_mixed(tmp_path):
    _require_storage("float16")
    rng = np.random.default_rng(13)
    tensors = af.linear_pair(rng, "model.layers.0.self_attn.q_proj", 8, 16, 4, dtype=np.float16)
    tensors.update(af.linear_pair(rng, "model.layers.0.self_attn.k_proj", 8, 16, 4))
    adapter = load_peft(af.write_peft(tmp_path / "mix", tensors, af.peft_config()))
    assert adapter.dtype == "mixed"


# ------------------------------------------------------------------------------------------
# GGUF files written here
# ------------------------------------------------------------------------------------------


def test_gguf_missing_alpha_means_factor_one_and_name_falls_back_to_stem(tmp_path):
    rng = np.random.default_rng(20)
    tensors = af.gguf_linear(rng, "blk.0.attn_q.weight", 24, 16, 4)
    path = af.write_gguf(tmp_path / "no_alpha.gguf", tensors, alpha=None)
    adapter = load_gguf(path, scale=0.75)
    assert adapter.alpha == 0.0 and adapter.name == "no_alpha"
    delta = adapter["blk.0.attn_q.weight"]
    assert delta.effective_scale == 0.75                      # llama.cpp: no alpha -> factor 1
    a, b = tensors[0][1].astype(np.float64), tensors[1][1].astype(np.float64)
    _assert_close(delta.delta_weight(), 0.75 * b @ a, _bound(0.75 * np.abs(b) @ np.abs(a), 5),
                  signal=b @ a)


def test_gguf_token_embd_layout(tmp_path):
    rng = np.random.default_rng(21)
    tensors = af.gguf_token_embd(rng, 40, 16, 4)
    adapter = load_gguf(af.write_gguf(tmp_path / "emb.gguf", tensors, alpha=8.0, name="emb"))
    delta = adapter["token_embd.weight"]
    assert (delta.rows, delta.cols, delta.rank) == (40, 16, 4)
    lora_a, lora_b = tensors[0][1].astype(np.float64), tensors[1][1].astype(np.float64)
    out = np.zeros((2, 16), np.float32)
    delta.add_rows_to(np.array([5, 39]), out)
    # llama.cpp: the delta of token t is s * lora_b @ lora_a[t]
    want = np.stack([2.0 * lora_b @ lora_a[5], 2.0 * lora_b @ lora_a[39]])
    magnitude = np.stack([2.0 * np.abs(lora_b) @ np.abs(lora_a[t]) for t in (5, 39)])
    _assert_close(out, want, _bound(magnitude, 6), signal=want)


@pytest.mark.parametrize("qtype, storage", [(Q.F16, "float16"), (Q.BF16, "bfloat16"),
                                            (Q.Q8_0, "q8_0/float32"), (None, "float32")])
def test_gguf_storage_types(tmp_path, qtype, storage):
    if storage != "float32":
        _require_storage(storage)
    rng = np.random.default_rng(22)
    a = rng.standard_normal((4, 64)).astype(np.float32)      # Q8_0 blocks run along ne[0] = 64
    b = rng.standard_normal((32, 4)).astype(np.float32)
    if qtype is None:           # F64 on disk
        tensors = [("blk.0.attn_k.weight.lora_a", a.astype(np.float64), None),
                   ("blk.0.attn_k.weight.lora_b", b.astype(np.float64), None)]
        stored_a, stored_b = a, b
    elif qtype == Q.F16:
        tensors = [("blk.0.attn_k.weight.lora_a", a.astype(np.float16), None),
                   ("blk.0.attn_k.weight.lora_b", b.astype(np.float16), None)]
        stored_a, stored_b = a.astype(np.float16), b.astype(np.float16)
    else:
        # lora_b ne [4, 32]: for Q8_0 its rows (ne[0] = 4) are not whole blocks, so keep it F32;
        # a Q8_0 lora_a is kept as its blocks (q8_0), the F32 lora_b as float32
        tensors = [("blk.0.attn_k.weight.lora_a", a, qtype),
                   ("blk.0.attn_k.weight.lora_b", b, qtype if qtype == Q.BF16 else None)]
        stored_a = dequantize(quantize(a, qtype), qtype)
        stored_b = dequantize(quantize(b, qtype), qtype) if qtype == Q.BF16 else b
    adapter = load_gguf(af.write_gguf(tmp_path / "t.gguf", tensors, alpha=4.0))
    delta = adapter["blk.0.attn_k.weight"]
    assert delta.dtype == storage and adapter.dtype == storage
    # what the file holds is stored exactly, so only the float32 product rounds (s = 4 / 4 = 1)
    sb, sa = np.asarray(stored_b, np.float64), np.asarray(stored_a, np.float64)
    _assert_close(delta.delta_weight(), sb @ sa, _bound(np.abs(sb) @ np.abs(sa), 6), signal=sb @ sa)


def test_gguf_norm_tensors_are_skipped_with_a_warning(tmp_path):
    rng = np.random.default_rng(23)
    tensors = af.gguf_linear(rng, "blk.0.attn_q.weight", 24, 16, 4)
    tensors.append(("blk.0.attn_norm.weight", np.ones(16, np.float32), None))
    path = af.write_gguf(tmp_path / "norm.gguf", tensors)
    with pytest.warns(UserWarning, match="blk.0.attn_norm.weight"):
        adapter = load_gguf(path)
    assert list(adapter) == ["blk.0.attn_q.weight"]


# ------------------------------------------------------------------------------------------
# activated LoRA (aLoRA)
# ------------------------------------------------------------------------------------------


def _assert_same_deltas(got, want):
    assert list(got) == list(want)
    for name, delta in got.items():
        assert delta.effective_scale == want[name].effective_scale
        for x, y in zip(delta.lora_weights(), want[name].lora_weights()):
            np.testing.assert_array_equal(x, y)


def test_peft_alora_fixture_loads_with_its_invocation_tokens(peft_adapter):
    adapter = load_peft(PEFT_ALORA_DIR)
    assert adapter.invocation_tokens == ALORA_TOKENS and peft_adapter.invocation_tokens is None
    assert "invocation_tokens=[17, 42, 5]" in repr(adapter)
    _assert_same_deltas(adapter, {m: d for m, d in peft_adapter.items() if m != "model.embed_tokens"})
    seq = [1, 17, 42, 5, 9, 17, 42, 5, 3, 17, 42]        # last whole occurrence starts at 5
    np.testing.assert_array_equal(adapter.alora_mask(seq), np.arange(len(seq)) >= 5)
    assert peft_adapter.alora_mask(seq).all()                # plain LoRA applies everywhere
    assert not adapter.alora_mask([17, 42, 3, 5]).any()      # no whole occurrence: nowhere


def _gguf_fixture_with(path, extra_kv):
    """The llama.cpp fixture rewritten by GGUFWriter with extra metadata (tensors unchanged)."""
    reader = GGUFReader(str(GGUF_LORA))
    tensors = [(t.name, np.array(t.data), None) for t in reader.tensors]
    name = reader.fields["general.name"].contents()
    return af.write_gguf(path, tensors, name=name, extra_kv=extra_kv)


def test_gguf_alora_reads_llama_cpp_invocation_tokens(tmp_path):
    """adapter.alora.invocation_tokens, an array of UINT32 as llama.cpp's converter writes it."""
    path = _gguf_fixture_with(tmp_path / "alora.gguf", {
        "adapter.alora.invocation_tokens": (list(ALORA_TOKENS), GGUFValueType.UINT32)})
    adapter = load_gguf(path)
    assert adapter.invocation_tokens == ALORA_TOKENS
    _assert_same_deltas(adapter, load_gguf(GGUF_LORA))
    np.testing.assert_array_equal(adapter.alora_mask([0, 17, 42, 5, 17, 42, 5, 9]),
                                  [False] * 4 + [True] * 4)


@pytest.mark.parametrize("tokens", [[], None])
def test_empty_invocation_tokens_mean_plain_lora(peft_dir, tokens):
    """PEFT tests the list's truth: an empty (or null) alora_invocation_tokens is plain LoRA."""
    adapter = load_peft(peft_dir(_q_pair(), af.peft_config(alora_invocation_tokens=tokens)))
    assert adapter.invocation_tokens is None and adapter.alora_mask([1, 2]).all()


@pytest.mark.parametrize("tokens", [[1, -2], [1, 2.0], ["a"], [True], "17 42", {"a": 1}, 17,
                                    [3, 2**70], [2**63]])
def test_peft_refuses_invocation_tokens_that_are_not_token_ids(peft_dir, tokens):
    path = peft_dir(_q_pair(), af.peft_config(alora_invocation_tokens=tokens))
    _assert_format_error(lambda: load_peft(path), path / "adapter_config.json",
                         "alora_invocation_tokens")


def test_invocation_tokens_past_int64_are_refused_by_the_constructor():
    with pytest.raises(ValueError, match="invocation_tokens.*<= 9223372036854775807"):
        _alora([5, 2**70])
    assert _alora([2**63 - 1]).invocation_tokens == (2**63 - 1,)


def _alora(tokens):
    return LoraAdapter({}, name="a", alpha=0.0, scale=LoraScale(), invocation_tokens=tokens)


def test_alora_mask_equals_peft_calculate_alora_offsets():
    """Our mask against PEFT's own rule on many random sequences: PEFT's offset o (None: not
    found) switches the adapter on for the last o positions."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from peft import LoraConfig
    from peft.tuners.lora.variants import calculate_alora_offsets

    rng = np.random.default_rng(50)
    for trial in range(600):
        tokens = rng.integers(0, 3, rng.integers(1, 5)).tolist()     # small vocab: many hits
        seq = rng.integers(0, 3, rng.integers(0, 30))
        cfg = {"default": LoraConfig(alora_invocation_tokens=tokens, task_type="CAUSAL_LM")}
        (offset,) = calculate_alora_offsets(cfg, "default", torch.tensor(seq[None], dtype=torch.long))
        n = len(seq)
        want = np.zeros(n, bool) if offset is None else np.arange(n) >= n - offset
        ids = (seq.tolist(), seq.astype(np.int32), torch.tensor(seq))[trial % 3]
        got = _alora(tokens).alora_mask(ids)
        assert got.dtype == np.bool_ and got.shape == (n,)
        np.testing.assert_array_equal(got, want, err_msg=f"tokens {tokens}, sequence {seq.tolist()}")


def test_alora_mask_inputs_and_errors():
    adapter = _alora((7, 7))
    want = [False, False, True, True, True]         # [7, 7] occurs at 1 and 2: the last wins
    for ids in ([3, 7, 7, 7, 1], np.array([3, 7, 7, 7, 1], np.uint16), range(3, 4)):
        if isinstance(ids, range):
            np.testing.assert_array_equal(adapter.alora_mask(ids), [False])
        else:
            np.testing.assert_array_equal(adapter.alora_mask(ids), want)
    assert adapter.alora_mask([]).shape == (0,) and adapter.alora_mask([]).dtype == np.bool_
    with pytest.raises(TypeError):
        adapter.alora_mask([3.0, 7.0])
    with pytest.raises(TypeError):
        adapter.alora_mask([True, False])
    with pytest.raises(ValueError):
        adapter.alora_mask([[7, 7]])
    with pytest.raises(TypeError):
        _alora(["7"])
    with pytest.raises(ValueError):
        _alora([-1])
    assert _alora(np.array([1, 2])).invocation_tokens == (1, 2) and _alora(()).invocation_tokens is None


# ------------------------------------------------------------------------------------------
# broken files: every refusal names the file and the tensor (or config/metadata key)
# ------------------------------------------------------------------------------------------


_assert_format_error = assert_format_error


Q_KEY = af.PREFIX + "model.layers.0.self_attn.q_proj"


@pytest.fixture
def peft_dir(tmp_path):
    def make(tensors, config=None, name="bad"):
        return af.write_peft(tmp_path / name, tensors, af.peft_config() if config is None else config)
    return make


def _q_pair(rows=24, cols=16, rank=4, **kw):
    return af.linear_pair(np.random.default_rng(30), "model.layers.0.self_attn.q_proj", rows, cols,
                          rank, **kw)


def test_peft_refuses_a_base_model_file(peft_dir):
    path = peft_dir({"model.layers.0.self_attn.q_proj.weight": np.ones((4, 4), np.float32)})
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                         "model.layers.0.self_attn.q_proj.weight", "unknown key")


def test_peft_without_config_says_a_base_model_file_is_not_an_adapter(tmp_path):
    """A base model's model.safetensors (no adapter_config.json beside it, no LoRA tensors) is
    "not a LoRA adapter", not a PEFT adapter with a missing config."""
    path = af.write_peft(tmp_path / "base", {"model.norm.weight": np.ones(4, np.float32)})
    weights = path / "adapter_model.safetensors"
    msg = _assert_format_error(lambda: load_peft(weights), weights, "not a LoRA adapter",
                               "model.norm.weight")
    assert "missing" not in msg


def test_peft_refuses_a_file_with_no_lora_tensors(peft_dir):
    path = peft_dir({"model.embed_tokens.base_layer.weight": np.ones((4, 4), np.float32)})
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors", "no lora_A")


def test_peft_refuses_a_gguf_file():
    _assert_format_error(lambda: load_peft(GGUF_LORA), GGUF_LORA, "load_gguf")


@pytest.mark.parametrize("peft_type", ["LOHA", "IA3", None])
def test_peft_refuses_other_tuners(peft_dir, peft_type):
    path = peft_dir(_q_pair(), af.peft_config(peft_type=peft_type))
    _assert_format_error(lambda: load_peft(path), path / "adapter_config.json", "peft_type")


def test_peft_refuses_missing_and_broken_config(tmp_path):
    path = af.write_peft(tmp_path / "nocfg", _q_pair(), None)
    _assert_format_error(lambda: load_peft(path), path / "adapter_config.json", "missing")
    (path / "adapter_config.json").write_text("{not json")
    _assert_format_error(lambda: load_peft(path), path / "adapter_config.json", "JSON")
    (path / "adapter_config.json").write_text(json.dumps(af.peft_config(r=0)))
    _assert_format_error(lambda: load_peft(path), path / "adapter_config.json", "'r'")
    (path / "adapter_config.json").write_text(json.dumps(af.peft_config(lora_alpha="16")))
    _assert_format_error(lambda: load_peft(path), path / "adapter_config.json", "'lora_alpha'")


def test_peft_missing_path_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_peft(tmp_path / "nowhere" / "adapter_model.safetensors")


def test_peft_refuses_a_truncated_file(peft_dir):
    path = peft_dir(_q_pair())
    af.truncate(path / "adapter_model.safetensors", -3)
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors", "not a readable")


def test_peft_refuses_a_header_declaring_a_huge_tensor(tmp_path):
    path = tmp_path / "huge"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(af.peft_config()))
    header = {Q_KEY + ".lora_A.weight": {"dtype": "F32", "shape": [1 << 20, 1 << 20],
                                         "data_offsets": [0, 1 << 42]},
              Q_KEY + ".lora_B.weight": {"dtype": "F32", "shape": [24, 4],
                                         "data_offsets": [1 << 42, (1 << 42) + 384]}}
    af.write_safetensors_header(path / "adapter_model.safetensors", header, 400)
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors")


def test_peft_refuses_a_pair_missing_one_half(peft_dir):
    tensors = _q_pair()
    del tensors[Q_KEY + ".lora_B.weight"]
    path = peft_dir(tensors)
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                         Q_KEY + ".lora_A.weight", "lora_B")
    emb = af.embedding_pair(np.random.default_rng(0), "model.embed_tokens", 40, 16, 4)
    del emb[af.PREFIX + "model.embed_tokens.lora_embedding_A"]
    path = peft_dir(emb, name="bad_emb")
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                         "model.embed_tokens.lora_embedding_B", "lora_embedding_A")


def test_peft_refuses_mismatched_shapes(peft_dir):
    tensors = _q_pair()
    tensors[Q_KEY + ".lora_B.weight"] = np.ones((24, 3), np.float32)
    path = peft_dir(tensors)
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                         Q_KEY + ".lora_A.weight", "do not pair")


def test_peft_refuses_a_rank_that_disagrees_with_r(peft_dir):
    path = peft_dir(_q_pair(rank=4), af.peft_config(r=16))
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                         Q_KEY + ".lora_A.weight", "rank 4", "r = 16")


@pytest.mark.parametrize("dtype, label", [(np.int8, "I8"), (np.int32, "I32")])
def test_peft_refuses_an_unsupported_dtype(peft_dir, dtype, label):
    tensors = _q_pair()
    tensors[Q_KEY + ".lora_B.weight"] = np.ones((24, 4), dtype)
    path = peft_dir(tensors)
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                         Q_KEY + ".lora_B.weight", label)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_peft_refuses_non_finite_values(peft_dir, dtype, bad):
    tensors = _q_pair(dtype=dtype)
    tensors[Q_KEY + ".lora_A.weight"][2, 3] = bad
    path = peft_dir(tensors)
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                         Q_KEY + ".lora_A.weight", "non-finite")


def test_peft_refuses_f64_values_beyond_float32(peft_dir):
    tensors = _q_pair(dtype=np.float64)
    tensors[Q_KEY + ".lora_B.weight"][0, 0] = 1e300
    path = peft_dir(tensors)
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                         Q_KEY + ".lora_B.weight", "overflow")


def test_peft_refuses_values_that_overflow_the_requested_storage(peft_dir):
    _require_storage("float16")
    tensors = _q_pair()
    tensors[Q_KEY + ".lora_B.weight"][0, 0] = 1e6
    path = peft_dir(tensors)
    _assert_format_error(lambda: load_peft(path, dtype="float16"), path / "adapter_model.safetensors",
                         Q_KEY + ".lora_A.weight", Q_KEY + ".lora_B.weight", "float16")


def test_peft_dora_needs_its_base_and_its_flag(peft_dir):
    tensors = _q_pair()
    path = peft_dir(tensors, af.peft_config(use_dora=True))
    _assert_format_error(lambda: load_peft(path), path / "adapter_config.json", "use_dora", "DoRA",
                         "base=")
    tensors[Q_KEY + ".lora_magnitude_vector"] = np.ones(24, np.float32)
    path = peft_dir(tensors, name="dora2")            # magnitude vector, config flag absent
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                         Q_KEY + ".lora_magnitude_vector", "DoRA")


@pytest.mark.parametrize("key, value", [
    ("lora_bias", True), ("modules_to_save", ["lm_head"]), ("bias", "all"),
])
def test_peft_refuses_non_lora_options(peft_dir, key, value):
    path = peft_dir(_q_pair(), af.peft_config(**{key: value}))
    _assert_format_error(lambda: load_peft(path), path / "adapter_config.json", f"'{key}'")


@pytest.mark.parametrize("key", [
    Q_KEY + ".lora_C.weight",              # not a LoRA half
    Q_KEY + ".lora_B.bias",                # lora_bias without the config saying so
    af.PREFIX + "lm_head.weight",          # a full weight (modules_to_save style)
])
def test_peft_refuses_unknown_keys(peft_dir, key):
    tensors = _q_pair()
    tensors[key] = np.ones((2, 2), np.float32)
    path = peft_dir(tensors)
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors", key,
                         "unknown key")


def test_peft_refuses_conv_lora(peft_dir):
    tensors = {Q_KEY + ".lora_A.weight": np.ones((4, 3, 3, 3), np.float32),
               Q_KEY + ".lora_B.weight": np.ones((8, 4, 1, 1), np.float32)}
    path = peft_dir(tensors)
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                         Q_KEY + ".lora_A.weight", "2-D")


def test_peft_refuses_an_untargeted_module(peft_dir):
    path = peft_dir(_q_pair(), af.peft_config(target_modules=["v_proj"]))
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                         Q_KEY + ".lora_A.weight", "target_modules")


def test_peft_refuses_two_adapters_in_one_file(peft_dir):
    tensors = _q_pair(infix="default")
    tensors.update(af.linear_pair(np.random.default_rng(1), "model.layers.0.self_attn.k_proj",
                                  8, 16, 4, infix="other"))
    path = peft_dir(tensors, af.peft_config())
    msg = _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                               "several adapters")
    assert re.search(r"tensor '[^']*self_attn\.[qk]_proj\.lora_A\.(default|other)\.weight'", msg), msg


def test_peft_refuses_the_same_half_twice(peft_dir):
    tensors = _q_pair()
    tensors.update(_q_pair(prefix=False))
    path = peft_dir(tensors)
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                         "model.layers.0.self_attn.q_proj.lora_A.weight", "duplicates")


def test_peft_refusal_returns_nothing_even_after_good_modules(peft_dir):
    """Validation covers the whole file before any delta is built."""
    tensors = _q_pair()
    tensors.update(af.linear_pair(np.random.default_rng(2), "model.layers.9.self_attn.k_proj",
                                  8, 16, 4))
    tensors[af.PREFIX + "model.layers.9.self_attn.k_proj.lora_B.weight"][0, 0] = np.nan
    path = peft_dir(tensors)
    _assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors",
                         "model.layers.9.self_attn.k_proj.lora_B.weight")


# GGUF -------------------------------------------------------------------------------------


def _gguf_ok(rng=None):
    rng = rng or np.random.default_rng(40)
    return af.gguf_linear(rng, "blk.0.attn_q.weight", 24, 16, 4) + af.gguf_token_embd(rng, 40, 16, 4)


def test_gguf_refuses_a_base_model():
    _assert_format_error(lambda: load_gguf(GGUF_BASE), GGUF_BASE, "general.type", "'model'")


def test_gguf_refuses_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "text.gguf"
    path.write_text("definitely not a GGUF file\n")
    _assert_format_error(lambda: load_gguf(path), path, "GGUF")
    _assert_format_error(lambda: load_gguf(PEFT_DIR / "adapter_model.safetensors"),
                         PEFT_DIR / "adapter_model.safetensors", "GGUF")


@pytest.mark.parametrize("general_type, adapter_type, key", [
    (None, "lora", "general.type"), ("model", "lora", "general.type"),
    ("adapter", None, "adapter.type"), ("adapter", "control_vector", "adapter.type"),
])
def test_gguf_refuses_wrong_types(tmp_path, general_type, adapter_type, key):
    path = af.write_gguf(tmp_path / "t.gguf", _gguf_ok(), general_type=general_type,
                         adapter_type=adapter_type)
    _assert_format_error(lambda: load_gguf(path), path, key, "not a LoRA adapter")


@pytest.mark.parametrize("value", [[5, 6, 7], ([5, 6, 7], GGUFValueType.INT64), "5 6 7", 5.0,
                                   ([5, 1 << 31], GGUFValueType.UINT32)])
def test_gguf_refuses_invocation_tokens_llama_cpp_would_refuse(tmp_path, value):
    """llama.cpp reads adapter.alora.invocation_tokens only as an array of UINT32 (a plain
    ``add_array`` of ints writes INT32) into int32 token ids."""
    path = af.write_gguf(tmp_path / "alora.gguf", _gguf_ok(),
                         extra_kv={"adapter.alora.invocation_tokens": value})
    _assert_format_error(lambda: load_gguf(path), path, "adapter.alora.invocation_tokens")


def test_gguf_refuses_a_non_numeric_alpha(tmp_path):
    path = af.write_gguf(tmp_path / "alpha.gguf", _gguf_ok(), alpha=None,
                         extra_kv={"adapter.lora.alpha": "sixteen"})
    _assert_format_error(lambda: load_gguf(path), path, "adapter.lora.alpha")


def test_gguf_refuses_a_truncated_file(tmp_path):
    path = af.write_gguf(tmp_path / "cut.gguf", _gguf_ok())
    last = GGUFReader(str(path)).tensors[-1].name
    af.truncate(path, -7)
    _assert_format_error(lambda: load_gguf(path), path, last, "truncated")
    af.truncate(path, 40)                             # inside the metadata
    _assert_format_error(lambda: load_gguf(path), path, "not a readable GGUF")


def test_gguf_refuses_a_tensor_declared_larger_than_the_file(tmp_path):
    path = af.write_gguf(tmp_path / "huge.gguf", _gguf_ok())
    af.patch_gguf_ne(path, "blk.0.attn_q.weight.lora_a", [16, 1 << 40])
    _assert_format_error(lambda: load_gguf(path), path, "blk.0.attn_q.weight.lora_a")


def test_gguf_refuses_a_metadata_array_longer_than_the_file(tmp_path):
    """The stock reader would loop 2**60 times over this count of one-byte (bool) elements,
    reading zero bytes each time once past the end; the count is refused before any element is
    read."""
    path = af.write_gguf(tmp_path / "arr.gguf", _gguf_ok(), extra_kv={"test.flags": [True, False]})
    af.patch_gguf_array_len(path, "test.flags", 1 << 60)
    _assert_format_error(lambda: load_gguf(path), path, "not a readable GGUF",
                         "declares 1152921504606846976 elements")


def test_gguf_refuses_a_pair_missing_one_half(tmp_path):
    tensors = [t for t in _gguf_ok() if t[0] != "blk.0.attn_q.weight.lora_a"]
    path = af.write_gguf(tmp_path / "half.gguf", tensors)
    _assert_format_error(lambda: load_gguf(path), path, "blk.0.attn_q.weight.lora_b", ".lora_a")


@pytest.mark.parametrize("which", ["linear", "token_embd"])
def test_gguf_refuses_mismatched_shapes(tmp_path, which):
    rng = np.random.default_rng(41)
    if which == "linear":
        # lora_a not transposed (the old finetune layout): ne [r, n_in]
        tensors = [("blk.0.attn_q.weight.lora_a", np.ones((16, 4), np.float32), None),
                   ("blk.0.attn_q.weight.lora_b", np.ones((24, 4), np.float32), None)]
        name = "blk.0.attn_q.weight.lora_a"
    else:
        tensors = [("token_embd.weight.lora_a", rng.standard_normal((40, 4)).astype(np.float32), None),
                   ("token_embd.weight.lora_b", rng.standard_normal((16, 3)).astype(np.float32), None)]
        name = "token_embd.weight.lora_a"
    path = af.write_gguf(tmp_path / "shape.gguf", tensors)
    _assert_format_error(lambda: load_gguf(path), path, name, "do not pair")


@pytest.mark.parametrize("kind", ["I32", "Q4_0"])
def test_gguf_refuses_an_unsupported_type(tmp_path, kind):
    rng = np.random.default_rng(42)
    a = rng.standard_normal((4, 32)).astype(np.float32)
    if kind == "I32":
        bad = ("blk.0.attn_q.weight.lora_a", (a * 10).astype(np.int32), None)
    else:
        bad = ("blk.0.attn_q.weight.lora_a", a, Q.Q4_0)
    good = ("blk.0.attn_q.weight.lora_b", rng.standard_normal((24, 4)).astype(np.float32), None)
    path = af.write_gguf(tmp_path / "type.gguf", [bad, good])
    _assert_format_error(lambda: load_gguf(path), path, "blk.0.attn_q.weight.lora_a", kind)


@pytest.mark.parametrize("kind", ["F32", "F16", "Q8_0", "Q8_0 NaN"])
def test_gguf_refuses_non_finite_values(tmp_path, kind):
    """The LoraFormatError names the tensor, and nothing warns first (a Q8_0 block with an inf
    scale and a 0 among its values: inf * 0 in a dequantization would)."""
    rng = np.random.default_rng(43)
    a = rng.standard_normal((4, 32)).astype(np.float32)
    a[0, :3] = 0.0                                   # zeros in the first Q8_0 block
    b = rng.standard_normal((24, 4)).astype(np.float32)
    if kind == "F32":
        b[3, 1] = np.nan
        tensors = [("blk.0.attn_q.weight.lora_a", a, None), ("blk.0.attn_q.weight.lora_b", b, None)]
    elif kind == "F16":
        b[3, 1] = np.inf
        tensors = [("blk.0.attn_q.weight.lora_a", a.astype(np.float16), None),
                   ("blk.0.attn_q.weight.lora_b", b.astype(np.float16), None)]
    else:
        tensors = [("blk.0.attn_q.weight.lora_a", a, None), ("blk.0.attn_q.weight.lora_b", b, None),
                   ("blk.0.attn_k.weight.lora_a", a, Q.Q8_0),
                   ("blk.0.attn_k.weight.lora_b", b, None)]
    path = af.write_gguf(tmp_path / "nan.gguf", tensors)
    name = "blk.0.attn_q.weight.lora_b"
    if kind.startswith("Q8_0"):
        af.poison_q8_0_scale(path, "blk.0.attn_k.weight.lora_a",
                             np.nan if "NaN" in kind else np.inf)
        name = "blk.0.attn_k.weight.lora_a"
    msg = _assert_format_error(lambda: load_gguf(path), path, name, "non-finite")
    assert "block 0" in msg or not kind.startswith("Q8_0"), msg


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.attn_q.weight.lora_c",
                                  "blk.0.attn_q.lora_a.extra"])
def test_gguf_refuses_unknown_tensors(tmp_path, name):
    tensors = _gguf_ok() + [(name, np.ones((2, 2), np.float32), None)]
    path = af.write_gguf(tmp_path / "unknown.gguf", tensors)
    _assert_format_error(lambda: load_gguf(path), path, name, "unknown tensor")


def test_gguf_base_names_are_what_precedes_the_suffix(tmp_path):
    """A pair ``foo.lora_a`` / ``foo.lora_b`` targets ``foo`` (the file cannot know a model's
    names, as llama.cpp's parser does not); a model's shapes refuse it through check_base."""
    rng = np.random.default_rng(41)
    tensors = _gguf_ok(rng) + af.gguf_linear(rng, "foo", 8, 16, 2)
    path = af.write_gguf(tmp_path / "foo.gguf", tensors)
    adapter = load_gguf(path)
    assert list(adapter) == ["blk.0.attn_q.weight", "token_embd.weight", "foo"]
    assert adapter["foo"].base_shape == (8, 16) and adapter["foo"].rank == 2
    a, _ = adapter["foo"].lora_weights()
    np.testing.assert_array_equal(a, tensors[-2][1])
    shapes = {"blk.0.attn_q.weight": (24, 16), "token_embd.weight": (40, 16)}
    with pytest.raises(lora.LoraShapeError, match="'foo'.*missing from the base shapes"):
        adapter.check_base(shapes)
    adapter.check_base(dict(shapes, foo=(8, 16)))


@pytest.mark.parametrize("lead", [(2,), (1, 2), (3, 1)])
def test_gguf_refuses_a_factor_with_an_extra_dimension(tmp_path, lead):
    tensors = [("blk.0.attn_q.weight.lora_a", np.ones(lead + (4, 16), np.float32), None),
               ("blk.0.attn_q.weight.lora_b", np.ones((24, 4), np.float32), None)]
    path = af.write_gguf(tmp_path / "3d.gguf", tensors)
    ne = str([16, 4] + list(reversed(lead)))
    _assert_format_error(lambda: load_gguf(path), path, "blk.0.attn_q.weight.lora_a", "2-D", ne)


@pytest.mark.parametrize("qtype", [None, Q.F16, Q.BF16, Q.Q8_0])
def test_gguf_factor_with_trailing_unit_dimensions_is_2d(tmp_path, qtype):
    """ne [n, r, 1] (and [n, r, 1, 1]) is the 2-D factor it holds: llama.cpp compares ne[0] and
    ne[1] only.  Same deltas as the plain 2-D file, for every stored type."""
    if qtype in (Q.F16, Q.BF16):
        _require_storage("float16" if qtype == Q.F16 else "bfloat16")
    rng = np.random.default_rng(44)
    a = rng.standard_normal((4, 32)).astype(np.float32)
    b = rng.standard_normal((24, 4)).astype(np.float32)
    qb = None if qtype == Q.Q8_0 else qtype      # lora_b's rows (ne[0] = 4) are not Q8_0 blocks
    flat = af.write_gguf(tmp_path / "flat.gguf", [("blk.0.attn_q.weight.lora_a", a, qtype),
                                                  ("blk.0.attn_q.weight.lora_b", b, qb)])
    padded = af.write_gguf(tmp_path / "padded.gguf", [
        ("blk.0.attn_q.weight.lora_a", a[None], qtype),          # ne [32, 4, 1]
        ("blk.0.attn_q.weight.lora_b", b[None, None], qb)])      # ne [4, 24, 1, 1]
    assert [list(map(int, t.shape)) for t in GGUFReader(str(padded)).tensors] == \
        [[32, 4, 1], [4, 24, 1, 1]]
    want, got = load_gguf(flat)["blk.0.attn_q.weight"], load_gguf(padded)["blk.0.attn_q.weight"]
    assert (got.rows, got.cols, got.rank, got.dtype) == (24, 32, 4, want.dtype)
    for x, y in zip(got.lora_weights(), want.lora_weights()):
        np.testing.assert_array_equal(x, y)


def test_gguf_refuses_an_empty_adapter(tmp_path):
    path = af.write_gguf(tmp_path / "empty.gguf", [])
    _assert_format_error(lambda: load_gguf(path), path, "no .lora_a")


def test_gguf_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "nothing.gguf")


def test_peft_refuses_configs_found_by_the_new_user_trial(tmp_path):
    """A pattern key valid alone but not inside PEFT's `(.*\\.)?(k)$` (an inline flag), and a
    JSON config nested beyond the parser's recursion limit: both LoraFormatErrors."""
    path = af.write_peft(tmp_path / "flag", _q_pair(), af.peft_config(rank_pattern={"(?i)q_proj": 4}))
    _assert_format_error(lambda: load_peft(path), path / "adapter_config.json", "rank_pattern")
    (path / "adapter_config.json").write_text("[" * 200_000 + "]" * 200_000)
    _assert_format_error(lambda: load_peft(path), path / "adapter_config.json", "JSON")


def test_an_alpha_whose_scale_is_not_finite_in_float32_is_a_format_error(tmp_path):
    import json
    import shutil

    src = os.path.join(os.path.dirname(__file__), "fixtures", "peft_r8_alpha16")
    dst = tmp_path / "huge_alpha"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 1e300
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(lora.LoraFormatError, match="not finite in float32") as info:
        lora.load_peft(dst)
    assert str(dst) in str(info.value) and "lora_A" in str(info.value)


def test_fifos_and_devices_are_refused_not_read(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for load in (lora.load_peft, lora.load_gguf):
        with pytest.raises(lora.LoraFormatError, match="not a regular file"):
            load(fifo)
        with pytest.raises(lora.LoraFormatError, match="not a regular file"):
            load("/dev/zero")
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "d" / "adapter_model.safetensors")
    with pytest.raises(lora.LoraFormatError, match="not a regular file"):
        lora.load_peft(tmp_path / "d")


def test_a_directory_of_saved_adapters_names_its_subdirectories(tmp_path):
    import shutil

    src = os.path.join(os.path.dirname(__file__), "fixtures", "peft_r8_alpha16")
    shutil.copytree(src, tmp_path / "second")
    with pytest.raises(lora.LoraFormatError, match="subdirectories: second"):
        lora.load_peft(tmp_path)
