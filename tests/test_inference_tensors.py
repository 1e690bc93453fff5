"""`accelerate_peft` on models whose weights are inference tensors: built, or given adapters
with ``load_adapter``, inside ``torch.inference_mode()`` (a common serving pattern).  Inference
tensors keep no version counter; every layer kind (plain LoRA Linear and Embedding, DoRA Linear
with a bias and DoRA Embedding, MoE experts) must be served and give PEFT's logits, and a
change of such a tensor must be seen (a new tensor at the next call; an in-place write, which
nothing counts, after ``refresh()``)."""

import warnings

import pytest

import lora
from conftest import close_to_peft as close, peft_each_alone

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

pytestmark = pytest.mark.model   # builds transformers / PEFT models: the README stage runs these

VOCAB = 96


def llama(seed, bias=False):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   attention_bias=bias)
    return transformers.LlamaForCausalLM(cfg).eval()


def qwen3_moe(seed):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=32, intermediate_size=64,
                                      moe_intermediate_size=24, num_experts=6,
                                      num_experts_per_tok=2)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


CONFIGS = {
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "embed_tokens"]),
    "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "o_proj",
                                                                   "embed_tokens"]),
    "moe": dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}


def build(kind, seed):
    """A PEFT model of `kind` (its DoRA magnitudes moved off their initial norms, so that the
    row factors are not 1), all under the caller's mode."""
    base = qwen3_moe(seed) if kind == "moe" else llama(seed, bias=(kind == "dora"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # PEFT's notes on target_parameters
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, **CONFIGS[kind]),
                               adapter_name="first")
    for name, p in model.named_parameters():
        if "lora_magnitude_vector" in name:
            with torch.no_grad():
                p.mul_(torch.rand(p.shape, generator=torch.Generator().manual_seed(seed))
                       + 0.5)
    return model.eval()


def lora_layers(model):
    """The names accelerate_peft serves: PEFT LoRA Linear / Embedding layers and the outermost
    experts wrapper."""
    from peft.tuners.lora.layer import Embedding, Linear, ParamWrapper

    return {n for n, m in model.named_modules()
            if type(m) in (Linear, Embedding)
            or (type(m) is ParamWrapper and type(m.base_layer) is ParamWrapper)}


def ids(batch=3, t=7, seed=1):
    return torch.randint(0, VOCAB, (batch, t), generator=torch.Generator().manual_seed(seed))


def check_served(model, x, what, **kw):
    """Inside inference mode: PEFT's logits, then accelerated (the full path, then the short
    path of the second call), every LoRA layer served."""
    with torch.inference_mode():
        ref = model(x, **kw).logits
        with lora.accelerate_peft(model) as acc:
            for call in ("first call", "second call"):
                got = model(x, **kw).logits
                assert set(acc.accelerated) == lora_layers(model) and not acc.skipped, \
                    (what, call, acc.skipped)
                close(got, ref, f"{what}, {call}")
    return ref


@pytest.mark.parametrize("kind", ["plain", "dora", "moe"])
def test_a_model_built_under_inference_mode_is_served(kind):
    with torch.inference_mode():
        model = build(kind, seed=3)
    assert next(model.parameters()).is_inference()
    x = ids()
    ref = check_served(model, x, kind)
    with torch.inference_mode(), model.disable_adapter():
        assert (model(x).logits - ref).abs().max() > 1e-3   # the adapters matter


@pytest.mark.parametrize("kind", ["plain", "dora"])
def test_adapters_loaded_under_inference_mode_are_served(tmp_path, kind):
    """A base built as usual, adapters saved by PEFT and loaded with from_pretrained /
    load_adapter inside inference mode (their weights are inference tensors): each adapter
    alone, and a mixed batch of both, as PEFT gives them."""
    donor = build(kind, seed=4)
    other = build(kind, seed=5)
    donor.save_pretrained(str(tmp_path / "one"))
    other.save_pretrained(str(tmp_path / "two"))
    with torch.inference_mode():  # PEFT saves an adapter not named "default" in a subdirectory
        model = PeftModel.from_pretrained(llama(4, bias=(kind == "dora")),
                                          str(tmp_path / "one" / "first"),
                                          adapter_name="one").eval()
        model.load_adapter(str(tmp_path / "two" / "first"), adapter_name="two")
    lora_b = next(m for n, m in model.named_modules() if n.endswith("q_proj.lora_B"))
    assert lora_b["two"].weight.is_inference()
    x = ids(seed=6)
    for name in ("one", "two"):
        model.set_adapter(name, inference_mode=True)   # keeps requires_grad off, as it must be
        check_served(model, x, f"{kind} adapter {name}")
    names = ["two", "__base__", "one"]
    with torch.inference_mode():
        alone = peft_each_alone(model, x, names, inference_mode=True)
        with lora.accelerate_peft(model) as acc:
            got = model(x, adapter_names=names).logits
            assert set(acc.accelerated) == lora_layers(model) and not acc.skipped
    close(got, alone, f"{kind} mixed batch")


@pytest.mark.parametrize("kind", ["dora", "moe"])
def test_changes_to_inference_tensors_are_seen(kind):
    """What derived data is kept (DoRA's norm statistics, a MoE lora_B's repacked copy) is
    keyed on the data pointer: a new tensor in place of an inference tensor is seen at the next
    call; an in-place write inside inference mode (no version counter counts it) after
    refresh()."""
    with torch.inference_mode():
        model = build(kind, seed=7)
    x = ids(seed=8)
    if kind == "dora":
        layer = model.base_model.model.model.layers[1].self_attn.o_proj   # no bias: short path
        targets = [layer.lora_magnitude_vector["first"].weight, layer.base_layer.weight,
                   layer.lora_A["first"].weight]
    else:
        layer = model.base_model.model.model.layers[0].mlp.experts
        targets = [layer.lora_B["first"].weight]
    with torch.inference_mode(), lora.accelerate_peft(model) as acc:
        before = model(x).logits
        model(x)
        for t in targets:
            t.data = t * 1.3 + 0.01                        # a new tensor: no refresh needed
            got = model(x).logits
            assert not acc.skipped
            acc.restore()
            close(got, model(x).logits, f"{kind}: a new tensor")
            acc = lora.accelerate_peft(model)
            model(x)
            t.mul_(0.7)                                    # in place: refresh()
            acc.refresh()
            got = model(x).logits
            acc.restore()
            close(got, model(x).logits, f"{kind}: in place, after refresh()")
            acc = lora.accelerate_peft(model)
        assert (got - before).abs().max() > 1e-3
        acc.restore()
