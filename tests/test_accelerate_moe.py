"""`lora.accelerate_peft` on mixture-of-experts models: PEFT LoRA on the experts' 3-D weights
(``target_parameters``, PEFT's nested ``ParamWrapper``) beside attention LoRA, on tiny
transformers MoE models built from configs.  PEFT's own forward in the same process is the
oracle; every test that expects acceleration asserts the experts modules were served."""

import warnings

import pytest

import lora

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("transformers.integrations.moe")
from peft import LoraConfig, get_peft_model  # noqa: E402

pytestmark = pytest.mark.model   # builds transformers / PEFT models: the README stage runs these

VOCAB = 64
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def moe_base(kind, seed=0, implementation=None):
    """A 2-layer MoE model of `kind` with 6 experts, top-2 (hidden 32, moe_intermediate 24)."""
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=24,
                                          num_experts=6, num_experts_per_tok=2)
    elif kind == "gpt_oss":
        cfg = transformers.GptOssConfig(**common, intermediate_size=24, num_local_experts=6,
                                        num_experts_per_tok=2, layer_types=["full_attention"] * 2,
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": 10000.0})
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=24, num_local_experts=6,
                                         num_experts_per_tok=2)
    else:
        cfg = transformers.OlmoeConfig(**common, intermediate_size=24, num_experts=6,
                                       num_experts_per_tok=2)
    if implementation is not None:
        cfg._experts_implementation = implementation
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def moe_model(kind, seed=0, implementation=None):
    """Adapters 'a' (experts + q/v, rank 4, down_proj of layer 1 at rank 2) and 'b' (experts
    only, rsLoRA rank 3), both with random B."""
    base = moe_base(kind, seed, implementation)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # PEFT's notes on target_parameters / rank_pattern
        model = get_peft_model(base, LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
            target_parameters=EXPERT_TARGETS, rank_pattern={"layers.1.mlp.experts.down_proj": 2},
            init_lora_weights=False), adapter_name="a")
        model.add_adapter("b", LoraConfig(r=3, lora_alpha=5, use_rslora=True,
                                          target_parameters=EXPERT_TARGETS,
                                          init_lora_weights=False))
    return model.eval()


def experts_names(model):
    return {n for n, m in model.named_modules()
            if type(m) is peft.tuners.lora.layer.ParamWrapper
            and type(m.base_layer) is peft.tuners.lora.layer.ParamWrapper}


def ids(batch=3, t=7, seed=1):
    return torch.randint(0, VOCAB, (batch, t), generator=torch.Generator().manual_seed(seed))


def close(got, ref, what=""):
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= 2e-5 * max(scale, 1.0), f"{what}: max |ours - PEFT| = {err:.3e} (|PEFT| {scale:.3g})"


def logits(model, x, **kw):
    return model(x, **kw).logits


def served(acc, model):
    names = experts_names(model)
    assert names and names <= set(acc.accelerated), (acc.accelerated, acc.skipped)
    assert not acc.skipped


@pytest.mark.parametrize("kind, implementation", [
    ("qwen3_moe", None), ("qwen3_moe", "eager"), ("qwen3_moe", "batched_mm"),
    ("gpt_oss", None), ("mixtral", None), ("olmoe", None)])
def test_logits_equal_peft(kind, implementation):
    """Gated, transposed + biased (GPT-OSS's own gate) experts, every implementation this
    forward computes, one and two active adapters: PEFT's logits within float32 rounding."""
    model = moe_model(kind, implementation=implementation)
    x = ids()
    for active in (["a"], ["b", "a"]):
        model.base_model.set_adapter(active)
        with torch.no_grad():
            ref = logits(model, x)
            with lora.accelerate_peft(model) as acc:
                got = logits(model, x)
                served(acc, model)
        close(got, ref, f"{kind} {active}")
    with torch.no_grad(), model.disable_adapter():
        base = logits(model, x)
    assert (ref - base).abs().max() > 1e-2   # the experts' LoRA term matters


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_mixed_batch_each_sequence_as_alone(kind):
    """PEFT refuses adapter_names on its experts wrapper; accelerated, each sequence gets the
    logits PEFT gives it alone with its adapter (in the forward and in greedy generate)."""
    model = moe_model(kind, seed=2)
    names = ["a", "__base__", "b", "a"]
    x = ids(batch=4, seed=3)
    with torch.no_grad():
        alone = []
        for row, name in enumerate(names):
            if name == "__base__":
                with model.disable_adapter():
                    alone.append(logits(model, x[row:row + 1]))
            else:
                model.set_adapter(name)
                alone.append(logits(model, x[row:row + 1]))
        model.set_adapter("a")
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        model.set_adapter("b")
        tokens_b = model.generate(input_ids=x[2:3], **kw)
        model.set_adapter("a")
        with lora.accelerate_peft(model) as acc:
            got = logits(model, x, adapter_names=names)
            served(acc, model)
            mixed_tokens = model.generate(input_ids=x[1:3], adapter_names=["a", "b"], **kw)
            tokens_a = model.generate(input_ids=x[1:2], **kw)
            with pytest.raises(ValueError, match="adapter_names has 3 names"):
                model.base_model.model.model.layers[0].mlp.experts(
                    torch.zeros(4, 32), torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2),
                    adapter_names=["a", "b", "a"])
    for row in range(len(names)):
        close(got[row:row + 1], alone[row], f"sequence {row} ({names[row]})")
    assert torch.equal(mixed_tokens[0], tokens_a[0]) and torch.equal(mixed_tokens[1], tokens_b[0])
    with torch.no_grad(), pytest.raises(ValueError, match="mixed"):  # last: PEFT's hooks stay
        logits(model, x, adapter_names=names)


def test_peft_api_keeps_its_meaning(tmp_path):
    """disable_adapter, scale changes, merge/unmerge, weight changes (in place; .data with
    refresh(); hotswap), a late load_adapter, extra_bytes, and restore() bit for bit."""
    from peft.utils.hotswap import hotswap_adapter

    model = moe_model("qwen3_moe", seed=4)
    donor = moe_model("qwen3_moe", seed=5)
    donor.save_pretrained(str(tmp_path / "donor"), selected_adapters=["a"])
    model.set_adapter("a")
    x = ids(seed=6)
    experts = model.base_model.model.model.layers[0].mlp.experts   # outer level: down_proj
    wrappers = [m for m in model.modules() if type(m) is peft.tuners.lora.layer.ParamWrapper]

    def peft_and_ours(fn):
        ref = fn()
        with lora.accelerate_peft(model) as acc:
            got = fn()
            served(acc, model)
        close(got, ref, fn.__name__)
        return acc

    def disabled():
        with model.disable_adapter():
            return logits(model, x)

    def scaled():
        for m in wrappers:
            m.set_scale("a", 0.25)
        out = logits(model, x)
        for m in wrappers:
            m.set_scale("a", 1.0)
        return out

    def merged():
        model.merge_adapter()
        out = logits(model, x)
        model.unmerge_adapter()
        return out

    with torch.no_grad():
        ref = logits(model, x)
        for fn in (disabled, scaled, merged):
            peft_and_ours(fn)
        b = experts.lora_B["a"].weight
        b.mul_(2.0)
        ref_doubled = logits(model, x)
        b.mul_(0.5)
        acc = lora.accelerate_peft(model)
        first = logits(model, x)
        lora_b_bytes = sum(m.lora_B[a].weight.numel() * 4 for m in wrappers for a in ("a",))
        assert acc.extra_bytes == lora_b_bytes
        b.mul_(2.0)                                   # in place: the version counter moves
        doubled = logits(model, x)
        close(doubled, ref_doubled, "in place")
        b.data.mul_(0.5)                              # raw .data write: needs refresh()
        acc.refresh()
        assert torch.equal(logits(model, x), first) and not torch.equal(doubled, first)
        hotswap_adapter(model, str(tmp_path / "donor" / "a"), adapter_name="a")
        swapped = logits(model, x)
        model.load_adapter(str(tmp_path / "donor" / "a"), adapter_name="late")
        model.set_adapter("late")
        late = logits(model, x)
        served(acc, model)
        acc.restore()
        close(late, logits(model, x), "late load_adapter")
        model.set_adapter("a")
        close(swapped, logits(model, x), "hotswap")
        assert not torch.allclose(swapped, ref)
        # restore() gives PEFT's forward back: exactly the forwards that were there
        assert all("forward" not in m.__dict__ for m in model.modules())
        assert not hasattr(peft.utils.hotswap.hotswap_adapter_from_state_dict, "__wrapped__")


def test_unknown_implementations_and_classes_fall_back_with_a_reason():
    from transformers.integrations import moe

    model = moe_model("qwen3_moe", seed=7)
    x = ids()
    mine = "lora_kernels_test_impl"

    def custom(self, *args):  # an implementation lora-kernels does not know
        return moe.batched_mm_experts_forward(self, *args)

    moe.ALL_EXPERTS_FUNCTIONS[mine] = custom
    try:
        model.base_model.model.config._experts_implementation_internal = mine
        with torch.no_grad():
            ref = logits(model, x)
            with lora.accelerate_peft(model) as acc:
                got = logits(model, x)
                skipped = acc.skipped
        close(got, ref, "fallback")
        assert experts_names(model) == set(skipped)
        assert all(mine in why for why in skipped.values())
    finally:
        del moe.ALL_EXPERTS_FUNCTIONS[mine]

    class Stack(torch.nn.Module):   # 3-D weights outside transformers' experts interface
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3, 8, 5))

        def forward(self, x):
            return torch.einsum("eoi,ti->teo", self.weight, x)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = Stack()
            self.head = torch.nn.Linear(5, 5)

        def forward(self, x):
            return self.stack(self.head(x))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = get_peft_model(Net(), LoraConfig(r=2, target_modules=["head"],
                                               target_parameters=["stack.weight"],
                                               init_lora_weights=False)).eval()
    xs = torch.randn(4, 5)
    with torch.no_grad():
        ref = net(xs)
        with lora.accelerate_peft(net) as acc:
            close(net(xs), ref, "custom stack")
            assert acc.accelerated == ["base_model.model.head"]
            assert "not an experts module" in acc.skipped["base_model.model.stack"]


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_bfloat16_error_no_larger_than_peft(kind):
    """PEFT folds the LoRA into bfloat16 expert weights; the term in float32, rounded once,
    keeps the mean logit error against the float32 model within 1.5x of PEFT's."""
    ref32 = moe_model(kind, seed=8)
    half = moe_model(kind, seed=8).to(torch.bfloat16)
    x = ids(batch=4, t=12, seed=9)
    for active in (["a"], ["a", "b"]):
        ref32.base_model.set_adapter(active)
        half.base_model.set_adapter(active)
        with torch.no_grad():
            exact = logits(ref32, x).double()
            peft_half = logits(half, x).double()
            with lora.accelerate_peft(half) as acc:
                ours_half = logits(half, x).double()
                served(acc, half)
        e_peft = (peft_half - exact).abs().mean().item()
        e_ours = (ours_half - exact).abs().mean().item()
        assert e_ours <= 1.5 * e_peft, (active, e_ours, e_peft)


def test_hooks_on_the_experts_module_fall_back():
    """PEFT's forward calls the experts module (running its hooks); ours does not, so a hooked
    experts module is left to PEFT, and served again once the hook is gone."""
    model = moe_model("qwen3_moe", seed=11)
    x = ids()
    inner = model.base_model.model.model.layers[0].mlp.experts.get_base_layer()
    seen = []
    handle = inner.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    with torch.no_grad(), lora.accelerate_peft(model) as acc:
        logits(model, x)
        assert "forward hooks" in acc.skipped["base_model.model.model.layers.0.mlp.experts"]
        assert seen
        handle.remove()
        logits(model, x)
        served(acc, model)
