"""Routed-expert adapters from files: PEFT ``target_parameters`` (nested ``ParamWrapper`` levels,
PEFT's expert layout of lora_A / lora_B, both stored expert orientations) and llama.cpp's 3-D
GGUF expert pairs, into `LoraExperts`; the refusals (ambiguous levels without a model, an expert
count the model disagrees with, a 3-D pair of the wrong ne); ``inspect``.  The PEFT side is
also checked on files PEFT itself saves, from Qwen3-MoE and GPT-OSS models built from configs
(``model`` marker)."""

import warnings

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

import _adapter_files as af
import lora
from conftest import assert_format_error
from lora import load_gguf, load_peft

MOD = "model.layers.0.mlp.experts"
H, INTER, E, R = 16, 12, 4, 2





def _expect(tensors, depth, n_experts, rank, module=MOD):
    """(a [E, r, in], b [E, out, r]) of one PEFT level by PEFT's get_delta_weight rule."""
    base = af.PREFIX + module + ".base_layer" * depth
    A, B = tensors[f"{base}.lora_A.weight"], tensors[f"{base}.lora_B.weight"]
    a = np.stack([A[e * rank:(e + 1) * rank] for e in range(n_experts)])
    b = np.stack([B[:, e::n_experts] for e in range(n_experts)])
    return a, b


def _assert_experts(ex, a, b):
    assert isinstance(ex, lora.LoraExperts)
    got_a, got_b = ex.lora_weights()
    np.testing.assert_array_equal(got_a, a)
    np.testing.assert_array_equal(got_b, b)


def _gate_up_down(rng, down_rank=R):
    """Qwen3-MoE's two levels: outer down_proj [H x I], inner gate_up_proj [2I x H]."""
    return af.param_levels(rng, MOD, [(H, INTER, down_rank, E), (2 * INTER, H, R, E)])


def _cfg(targets, **kw):
    return af.peft_config(r=R, lora_alpha=4, target_modules=["q_proj"], target_parameters=targets,
                          **kw)


def test_peft_param_levels_resolved_by_their_shapes(tmp_path):
    rng = np.random.default_rng(0)
    tensors = _gate_up_down(rng)
    tensors.update(af.linear_pair(rng, "model.layers.0.self_attn.q_proj", H, H, R))
    for i, targets in enumerate((["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                 ["mlp.experts.down_proj", "experts.gate_up_proj"])):
        path = af.write_peft(tmp_path / f"a{i}", tensors, _cfg(targets))
        ad = load_peft(path)
        assert list(ad) == [f"{MOD}.gate_up_proj", f"{MOD}.down_proj",
                            "model.layers.0.self_attn.q_proj"]          # file order
        _assert_experts(ad[f"{MOD}.gate_up_proj"], *_expect(tensors, 1, E, R))
        _assert_experts(ad[f"{MOD}.down_proj"], *_expect(tensors, 0, E, R))
        gu = ad[f"{MOD}.gate_up_proj"]
        assert gu.expert_shape == (E, 2 * INTER, H) and gu.effective_scale == 2.0
        assert isinstance(ad["model.layers.0.self_attn.q_proj"], lora.LoraDelta)


def test_peft_rank_pattern_keyed_by_module_and_parameter(tmp_path):
    rng = np.random.default_rng(1)
    tensors = _gate_up_down(rng, down_rank=1)
    cfg = _cfg(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
               rank_pattern={"layers.0.mlp.experts.down_proj": 1},
               alpha_pattern={"experts.gate_up_proj": 8})
    path = af.write_peft(tmp_path / "rp", tensors, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # no "matches no module" warning
        ad = load_peft(path)
    down, gu = ad[f"{MOD}.down_proj"], ad[f"{MOD}.gate_up_proj"]
    assert (down.rank, down.n_experts, down.effective_scale) == (1, E, 4.0)
    assert (gu.rank, gu.alpha, gu.effective_scale) == (R, 8.0, 4.0)
    _assert_experts(down, *_expect(tensors, 0, E, 1))


def test_peft_ambiguous_levels_need_the_model(tmp_path):
    """up_proj [I x H] and down_proj [H x I] mirror each other: the file does not say which
    level is which; base= (the model's parameters in registration order) does."""
    rng = np.random.default_rng(2)
    tensors = af.param_levels(rng, MOD, [(INTER, H, R, E), (H, INTER, R, E)])
    path = af.write_peft(tmp_path / "amb", tensors,
                         _cfg(["mlp.experts.up_proj", "mlp.experts.down_proj"]))
    assert_format_error(lambda: load_peft(path), path / "adapter_model.safetensors", MOD, "base=",
                  "does not say which")
    # the model registers down_proj first, then up_proj: down is the innermost level
    shapes = {f"{MOD}.down_proj": (E, H, INTER), f"{MOD}.up_proj": (E, INTER, H)}
    ad = load_peft(path, base=shapes)
    _assert_experts(ad[f"{MOD}.down_proj"], *_expect(tensors, 1, E, R))
    _assert_experts(ad[f"{MOD}.up_proj"], *_expect(tensors, 0, E, R))
    # PEFT's own state-dict names, arrays as values; the other registration order
    peft_names = {f"base_model.model.{MOD}.base_layer.base_layer.up_proj": np.zeros((E, H, INTER)),
                  f"base_model.model.{MOD}.base_layer.base_layer.down_proj": np.zeros((E, INTER, H))}
    ad = load_peft(path, base=peft_names)                # stored [E, in, out]: transposed experts
    _assert_experts(ad[f"{MOD}.up_proj"], *_expect(tensors, 1, E, R))
    assert ad[f"{MOD}.up_proj"].expert_shape == (E, H, INTER)


def test_peft_expert_count_disagreeing_with_the_model_is_refused(tmp_path):
    rng = np.random.default_rng(3)
    path = af.write_peft(tmp_path / "count", _gate_up_down(rng),
                         _cfg(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    shapes = {f"{MOD}.gate_up_proj": (8, 2 * INTER, H), f"{MOD}.down_proj": (8, H, INTER)}
    assert_format_error(lambda: load_peft(path, base=shapes), path / "adapter_model.safetensors",
                  f"{MOD}.down_proj", f"{E} experts", "(8, 16, 12) (8 experts)")
    with pytest.raises(TypeError, match="base must be a mapping"):
        load_peft(path, base=[1, 2])


def test_peft_2d_parameter_and_refusals(tmp_path):
    rng = np.random.default_rng(4)
    tensors = af.param_levels(rng, "lm_head", [(10, H, R, 1)])
    ad = load_peft(af.write_peft(tmp_path / "p2", tensors, _cfg(["lm_head.weight"])))
    d = ad["lm_head.weight"]
    assert isinstance(d, lora.LoraDelta) and (d.rows, d.cols, d.rank) == (10, H, R)
    # a nested level and no target_parameters naming a parameter of the module
    bad = af.write_peft(tmp_path / "b1", _gate_up_down(rng), _cfg(["mlp.router.weight"]))
    assert_format_error(lambda: load_peft(bad), bad / "adapter_model.safetensors", "base_layer",
                  "names no parameter")
    # two levels, one target parameter
    bad = af.write_peft(tmp_path / "b2", _gate_up_down(rng), _cfg(["mlp.experts.gate_up_proj"]))
    assert_format_error(lambda: load_peft(bad), bad / "adapter_model.safetensors", "2 nested")
    # only the inner level
    inner = {k: v for k, v in _gate_up_down(rng).items() if ".base_layer." in k}
    bad = af.write_peft(tmp_path / "b3", inner, _cfg(["experts.gate_up_proj", "experts.down_proj"]))
    assert_format_error(lambda: load_peft(bad), bad / "adapter_model.safetensors", "none at depth 0")
    # a rank that does not divide lora_A's rows
    odd = af.param_levels(rng, MOD, [(H, INTER, 3, 1)])
    bad = af.write_peft(tmp_path / "b4", odd, _cfg(["mlp.experts.down_proj"]))
    assert_format_error(lambda: load_peft(bad), bad / "adapter_model.safetensors",
                  "not a multiple of its rank 2")
    bad = af.write_peft(tmp_path / "b5", tensors, _cfg("lm_head.weight"))
    assert_format_error(lambda: load_peft(bad), bad / "adapter_config.json", "target_parameters")


# ------------------------------------------------------------------ GGUF


@pytest.mark.parametrize("qtype, storage", [(None, "float32"), (T.F16, "float16"),
                                            (T.BF16, "bfloat16"), (T.Q8_0, "q8_0/float32")])
def test_gguf_expert_pairs(tmp_path, qtype, storage):
    rng = np.random.default_rng(5)
    base = "blk.0.ffn_gate_up_exps.weight"
    tensors = af.gguf_experts(rng, base, 3, 2 * INTER, 32, 4, qtype=qtype)
    if qtype == T.Q8_0:  # lora_b's rows (ne[0] = rank 4) are not whole Q8_0 blocks: F32
        tensors[1] = tensors[1][:2] + (None,)
    if qtype == T.F16:
        tensors = [(n, a.astype(np.float16), None) for n, a, _ in tensors]
    tensors += af.gguf_experts(rng, "blk.0.ffn_down_exps.weight", 3, 32, INTER, 4)
    tensors += af.gguf_linear(rng, "blk.0.attn_q.weight", 32, 32, 4)
    path = af.write_gguf(tmp_path / "moe.gguf", tensors, alpha=8.0)
    ad = load_gguf(path)
    ex = ad[base]
    assert isinstance(ex, lora.LoraExperts) and ex.dtype == storage
    assert ex.expert_shape == (3, 2 * INTER, 32) and ex.rank == 4 and ex.effective_scale == 2.0
    a, b = (t[1] for t in tensors[:2])
    got_a, got_b = (f.astype(np.float32) for f in ex.lora_weights())
    if qtype in (None, T.F16, T.BF16):
        want_a = a.astype(np.float32) if qtype != T.BF16 else lora._dtypes.round_to(a, "bfloat16")
        np.testing.assert_array_equal(got_a, np.asarray(want_a, np.float32))
    else:  # Q8_0: the file's blocks kept, their values ggml's own dequantization
        np.testing.assert_array_equal(got_a, dequantize(quantize(a, T.Q8_0), T.Q8_0))
        np.testing.assert_array_equal(got_b, b)
    assert ad["blk.0.ffn_down_exps.weight"].expert_shape == (3, 32, INTER)
    assert isinstance(ad["blk.0.attn_q.weight"], lora.LoraDelta)


def test_gguf_refuses_3d_pairs_of_the_wrong_ne(tmp_path):
    rng = np.random.default_rng(6)
    base = "blk.1.ffn_up_exps.weight"
    a, b = (t[1] for t in af.gguf_experts(rng, base, 3, 8, 6, 2))
    cases = {
        "rank": ([(f"{base}.lora_a", a, None), (f"{base}.lora_b", b.transpose(0, 2, 1).copy(),
                                                 None)], "ne [6, 2, 3] and lora_b ne [8, 2, 3]"),
        "count": ([(f"{base}.lora_a", a, None), (f"{base}.lora_b", b[:2], None)],
                  "lora_b ne [2, 8, 2]"),
        "2-D": ([(f"{base}.lora_a", a[0], None), (f"{base}.lora_b", b[0], None)],
                "ne [6, 2]; a LoRA factor of the expert tensor"),
        "not experts": ([("blk.1.attn_k.weight.lora_a", a, None),
                         ("blk.1.attn_k.weight.lora_b", b, None)], "has ne [6, 2, 3]"),
    }
    for name, (tensors, needle) in cases.items():
        path = af.write_gguf(tmp_path / f"{name}.gguf", tensors)
        assert_format_error(lambda: load_gguf(path), path, needle)
    # trailing dimensions of 1 past the third are the 3-D factor
    path = af.write_gguf(tmp_path / "pad.gguf", [(f"{base}.lora_a", a[None], None),
                                                 (f"{base}.lora_b", b, None)])
    assert load_gguf(path)[base].expert_shape == (3, 8, 6)


def test_inspect_shows_experts(tmp_path, capsys):
    from lora.__main__ import main

    rng = np.random.default_rng(7)
    tensors = af.gguf_experts(rng, "blk.0.ffn_down_exps.weight", 5, 16, 12, 2)
    tensors += af.gguf_linear(rng, "blk.0.attn_q.weight", 16, 16, 2)
    path = af.write_gguf(tmp_path / "i.gguf", tensors)
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "experts" in text and "(1 of them routed experts)" in text
    line = next(x for x in text.splitlines() if x.startswith("blk.0.ffn_down_exps.weight"))
    assert line.split()[1:3] == ["5", "16"]
    assert f"{5 * 2 * 28 + 2 * 32} parameters" in text


# ------------------------------------------------------------------ files PEFT saves


def _peft_model(kind, tmp_path, **over):
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3MoeConfig

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=24,
                             num_experts=over.get("n_experts", 6), num_experts_per_tok=2)
    else:
        cfg = GptOssConfig(**common, intermediate_size=24,
                           num_local_experts=over.get("n_experts", 6), num_experts_per_tok=2,
                           layer_types=["full_attention"] * 2,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if over.get("bare"):
        return model
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                      rank_pattern={"layers.1.mlp.experts.down_proj": 2}, init_lora_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # PEFT's (false) "rank_pattern keys did not match"
        peft_model = get_peft_model(model, lcfg)
    peft_model.save_pretrained(tmp_path / kind)
    return peft_model


@pytest.mark.model
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_files_peft_saves(tmp_path, kind):
    import torch

    pm = _peft_model(kind, tmp_path)
    ad = load_peft(tmp_path / kind)
    with_base = load_peft(tmp_path / kind, base=pm.base_model.model.state_dict())
    wrappers = [(n, m) for n, m in pm.named_modules() if type(m).__name__ == "ParamWrapper"]
    assert len(wrappers) == 4
    for name, mod in wrappers:
        module = ".".join(p for p in name.split(".")[2:] if p != "base_layer")
        key = f"{module}.{mod.parameter_name}"
        ex = ad[key]
        transposed = getattr(mod.get_base_layer(), "is_transposed", False)
        assert transposed == (kind == "gpt_oss")
        want = mod.get_delta_weight("default").detach().numpy()
        got = ex.delta_weight()
        np.testing.assert_allclose(got.transpose(0, 2, 1) if transposed else got, want,
                                   rtol=1e-5, atol=1e-6, err_msg=key)
        for x, y in zip(ex.lora_weights(), with_base[key].lora_weights()):
            np.testing.assert_array_equal(x, y)
        # merging into the model's own expert weight (a [E, in, out] one through its transposed
        # view) agrees with PEFT's merge
        param = getattr(mod.get_base_layer(), mod.parameter_name)
        ours = param.detach().clone()
        ex.merge_into(ours.transpose(-1, -2) if transposed else ours)
        with torch.no_grad():
            theirs = param.detach() + torch.from_numpy(want)
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6, atol=1e-6)
    assert ad["model.layers.1.mlp.experts.down_proj"].rank == 2
    for name, mod in pm.named_modules():
        if type(mod).__name__ == "Linear" and hasattr(mod, "lora_A"):
            d = ad[name.split(".", 2)[2]]
            np.testing.assert_allclose(d.delta_weight(),
                                       mod.get_delta_weight("default").detach().numpy(),
                                       rtol=1e-5, atol=1e-6)
    # a model with another expert count: the file does not fit it
    other = _peft_model(kind, tmp_path, n_experts=3, bare=True)
    assert_format_error(lambda: load_peft(tmp_path / kind, base=other.state_dict()),
                  tmp_path / kind, "3 experts")
