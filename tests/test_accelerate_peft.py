"""`lora.accelerate_peft` under a real PeftModel: a tiny Llama built from a config (random weights,
no hub), several PEFT adapters, and every PEFT API item checked against PEFT's own logits in the
same process (PEFT's forward is the oracle; ours must agree within float32 rounding)."""

import gc
import tracemalloc

import pytest

import lora

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

pytestmark = pytest.mark.model   # builds transformers / PEFT models: the README stage runs these

VOCAB = 128


def tiny_llama(dtype=torch.float32, hidden=64, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def peft_model(dtype=torch.float32, seed=0):
    """Three adapters of different ranks: 'a' plain, 'b' rsLoRA, 'c' on embed_tokens and
    lm_head; all with random (non-zero) B so every term matters."""
    base = tiny_llama(seed=seed)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                            task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj", "o_proj",
                                                            "up_proj"]), adapter_name="a")
    model.add_adapter("b", LoraConfig(r=8, lora_alpha=16, use_rslora=True, init_lora_weights=False,
                                      target_modules=["q_proj", "k_proj", "down_proj"]))
    model.add_adapter("c", LoraConfig(r=6, lora_alpha=3, init_lora_weights=False,
                                      target_modules=["embed_tokens", "lm_head", "gate_proj"]))
    if dtype != torch.float32:
        # a half-precision base with the float32 adapters PEFT keeps by default
        # (autocast_adapter_dtype=True): the same values, only the base rounded
        for name, p in model.named_parameters():
            if "lora_" not in name:
                p.data = p.data.to(dtype)
    return model.eval()


def ids(batch=3, t=10, seed=1):
    return torch.randint(0, VOCAB, (batch, t), generator=torch.Generator().manual_seed(seed))


def close(got, ref, what=""):
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= 2e-5 * max(scale, 1.0), f"{what}: max |ours - PEFT| = {err:.3e} (|PEFT| {scale:.3g})"


def both(model, fn, check=True):
    """fn() under PEFT's forward, then under accelerate_peft (restored afterwards)."""
    with torch.no_grad():
        ref = fn()
        with lora.accelerate_peft(model) as acc:
            got = fn()
            status = (acc.accelerated, acc.skipped)
    if check:
        close(got, ref)
    return ref, got, status


@pytest.fixture(scope="module")
def model():
    return peft_model()


def logits(model, x, **kw):
    return model(x, **kw).logits


def test_active_adapters_and_set_adapter(model):
    x = ids()
    for active in (["a"], ["b"], ["c"], ["a", "b", "c"], ["c", "a"]):
        model.base_model.set_adapter(active)
        _, _, (accel, skipped) = both(model, lambda: logits(model, x))
        assert not skipped and len(accel) >= 10
    model.set_adapter("a")


def test_every_lora_layer_is_served(model):
    with torch.no_grad(), lora.accelerate_peft(model) as acc:
        model(ids())
        names = {n for n, m in model.named_modules()
                 if type(m) in (peft.tuners.lora.layer.Linear, peft.tuners.lora.layer.Embedding)}
        assert set(acc.accelerated) == names and not acc.skipped


def test_mixed_batch_adapter_names(model):
    x = ids(batch=5)
    names = ["a", "__base__", "c", "b", "a"]
    model.base_model.set_adapter(["a", "b", "c"])
    both(model, lambda: logits(model, x, adapter_names=names))
    model.set_adapter("a")


def test_generate_greedy_tokens_identical(model):
    x = ids(batch=2, t=6)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(input_ids=x, **kw)
        ref_mixed = model.generate(input_ids=x, adapter_names=["b", "c"], **kw)
        with lora.accelerate_peft(model):
            got = model.generate(input_ids=x, **kw)
            got_mixed = model.generate(input_ids=x, adapter_names=["b", "c"], **kw)
    assert torch.equal(ref, got) and torch.equal(ref_mixed, got_mixed)


def test_disable_adapter_and_merge(model):
    x = ids()
    model.set_adapter("a")

    def disabled():
        with model.disable_adapter():
            return logits(model, x)

    both(model, disabled)

    def merged():
        model.merge_adapter()
        out = logits(model, x)
        model.unmerge_adapter()
        return out

    both(model, merged)


def test_scales_are_read_at_every_call(model):
    from peft.helpers import rescale_adapter_scale

    x = ids()
    model.set_adapter("a")
    layers = [m for m in model.modules() if isinstance(m, peft.tuners.lora.layer.LoraLayer)]
    with torch.no_grad(), lora.accelerate_peft(model):
        first = logits(model, x)
        for m in layers:
            m.set_scale("a", 0.25)
        quarter = logits(model, x)
        for m in layers:
            m.scale_layer(3.0)
        tripled = logits(model, x)
        for m in layers:
            m.unscale_layer(None)
        with rescale_adapter_scale(model, 0.5):
            halved = logits(model, x)
        for m in layers:
            m.set_scale("a", 1.0)
    with torch.no_grad():
        ref_first = logits(model, x)
        for m in layers:
            m.set_scale("a", 0.25)
        close(quarter, logits(model, x), "set_scale")
        for m in layers:
            m.scale_layer(3.0)
        close(tripled, logits(model, x), "scale_layer")
        for m in layers:
            m.unscale_layer(None)
        with rescale_adapter_scale(model, 0.5):
            close(halved, logits(model, x), "rescale_adapter_scale")
        for m in layers:
            m.set_scale("a", 1.0)
    close(first, ref_first)


def test_weight_changes_are_seen_at_the_next_call():
    model = peft_model(seed=3)
    model.set_adapter("b")
    x = ids()
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad(), lora.accelerate_peft(model) as acc:
        logits(model, x)
        q.lora_B["b"].weight.mul_(2.0)               # in place, through the parameter
        after_inplace = logits(model, x)
        q.lora_A["b"].weight.data.add_(0.5)          # through .data (no version bump)
        after_data = logits(model, x)
        q.lora_B["b"].weight.data = torch.randn_like(q.lora_B["b"].weight) * 0.1  # new storage
        after_new = logits(model, x)
        assert not acc.skipped
    with torch.no_grad():
        close(after_new, logits(model, x), "new storage")
        q.lora_B["b"].weight.data = q.lora_B["b"].weight.data.clone()
    assert not torch.equal(after_inplace, after_data)


def test_added_loaded_and_deleted_adapters(tmp_path):
    model = peft_model(seed=4)
    x = ids()
    saved = tmp_path / "saved"
    model.save_pretrained(str(saved), selected_adapters=["b"])
    with torch.no_grad(), lora.accelerate_peft(model) as acc:
        model.add_adapter("new", LoraConfig(r=3, lora_alpha=5, init_lora_weights=False,
                                            target_modules=["k_proj", "lm_head"]))
        model.set_adapter("new")
        got_new = logits(model, x)
        model.load_adapter(str(saved / "b"), adapter_name="loaded")
        model.set_adapter("loaded")
        got_loaded = logits(model, x)
        model.delete_adapter("new")
        model.set_adapter("a")
        got_after_delete = logits(model, x)
        assert "base_model.model.model.layers.0.self_attn.k_proj" in acc.accelerated
    with torch.no_grad():
        model.set_adapter("loaded")
        close(got_loaded, logits(model, x), "load_adapter")
        model.set_adapter("a")
        close(got_after_delete, logits(model, x), "delete_adapter")
    assert got_new.shape == got_loaded.shape


def test_hotswap_adapter(tmp_path):
    from peft.utils.hotswap import hotswap_adapter

    donor = peft_model(seed=5)
    donor.save_pretrained(str(tmp_path / "donor"), selected_adapters=["a"])
    model = peft_model(seed=6)
    model.set_adapter("a")
    x = ids()
    with torch.no_grad(), lora.accelerate_peft(model):
        before = logits(model, x)
        hotswap_adapter(model, str(tmp_path / "donor" / "a"), adapter_name="a")
        after = logits(model, x)
    with torch.no_grad():
        close(after, logits(model, x), "hotswap")
    assert not torch.allclose(before, after)


def test_alora(model):
    base = tiny_llama(seed=7)
    m = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                        task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"],
                                        alora_invocation_tokens=[5, 9]), adapter_name="al")
    m.add_adapter("plain", LoraConfig(r=4, init_lora_weights=False, target_modules=["q_proj"]))
    m.eval()
    x = ids(batch=3, t=12)
    x[0, 3:5] = torch.tensor([5, 9])   # invoked early
    x[1, 9:11] = torch.tensor([5, 9])  # invoked late
    x[2] = torch.where(x[2] == 5, 6, x[2])  # never invoked
    m.set_adapter("al")
    _, got, (accel, _) = both(m, lambda: logits(m, x))
    assert accel
    with torch.no_grad(), m.disable_adapter():
        plain = logits(m, x)
    # the adapter acts only from its invocation on: row 2 never, row 1 late, row 0 early
    assert torch.allclose(got[2], plain[2]) and torch.allclose(got[1, :9], plain[1, :9])
    assert not torch.allclose(got[1, 10:], plain[1, 10:]) and not torch.allclose(got[0], plain[0])
    both(m, lambda: logits(m, x, adapter_names=["al", "plain", "al"]))


def test_training_falls_back_and_gradients_flow():
    model = peft_model(seed=8)
    model.base_model.set_adapter(["a", "b", "c"])  # every LoRA layer has an active adapter
    model.train()
    x = ids()
    with lora.accelerate_peft(model) as acc:
        out = logits(model, x).sum()
        out.backward()
        grads = [p.grad for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
        assert grads and all(g is not None for g in grads)
        assert not acc.accelerated and acc.skipped
        assert any("autograd" in why or "dropout" in why for why in acc.skipped.values())
    model.eval()


def test_restore_gives_peft_back_bit_for_bit(model):
    x = ids()
    model.set_adapter("b")
    with torch.no_grad():
        ref = logits(model, x)
        acc = lora.accelerate_peft(model)
        with pytest.raises(ValueError, match="already accelerated"):
            lora.accelerate_peft(model)
        logits(model, x)
        acc.restore()
        acc.restore()  # twice: a no-op
        assert torch.equal(logits(model, x), ref)
        assert all("forward" not in m.__dict__ for m in model.modules())
    lora.accelerate_peft(model).restore()  # accelerating again after a restore is fine
    model.set_adapter("a")


def test_refused_models():
    with pytest.raises(ValueError, match="no PEFT LoRA"):
        lora.accelerate_peft(tiny_llama())
    with pytest.raises(TypeError):
        lora.accelerate_peft("model")


def test_dora_layers_are_served():
    base = tiny_llama(seed=9)
    m = get_peft_model(base, LoraConfig(r=4, use_dora=True, init_lora_weights=False,
                                        target_modules=["q_proj"])).eval()
    x = ids()
    _, _, (accel, skipped) = both(m, lambda: logits(m, x))   # within float32 rounding of PEFT
    assert len(accel) == 2 and all(n.endswith("q_proj") for n in accel) and not skipped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_model_error_no_larger_than_peft(dtype):
    """The LoRA term in float32, rounded once: the half model's logits are no further from the
    float32 model's than PEFT's own (within 1.5x)."""
    ref32 = peft_model(seed=10)
    half = peft_model(dtype=dtype, seed=10)
    x = ids(batch=4, t=12)
    for active in (["a"], ["a", "b", "c"]):
        ref32.base_model.set_adapter(active)
        half.base_model.set_adapter(active)
        with torch.no_grad():
            exact = logits(ref32, x).double()
        peft_half, ours_half, (accel, skipped) = both(half, lambda: logits(half, x), check=False)
        assert accel and not skipped
        e_peft = (peft_half.double() - exact).norm().item()
        e_ours = (ours_half.double() - exact).norm().item()
        assert e_ours <= 1.5 * e_peft, (active, e_ours, e_peft)


def test_memory_added_is_small():
    """Views of PEFT's tensors, not copies: what accelerate_peft allocates (Python objects and
    the small C handles, which cffi allocates through Python's allocator) is <= 5% of the
    adapters' own bytes."""
    big = get_peft_model(tiny_llama(hidden=256, layers=4, seed=12),
                         LoraConfig(r=64, init_lora_weights=False,
                                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                    "gate_proj", "up_proj", "down_proj"])).eval()
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in big.named_parameters()
                        if "lora_" in n)
    x = ids()
    with torch.no_grad():
        logits(big, x)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        acc = lora.accelerate_peft(big)
        logits(big, x)
        logits(big, x)
        gc.collect()
        added = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        acc.restore()
    assert added <= 0.05 * adapter_bytes, (added, adapter_bytes)


def test_copies_and_pickles_of_an_accelerated_model_get_peft_forward(tmp_path):
    import copy
    import pickle

    model = peft_model(seed=13)
    x = ids()
    with torch.no_grad():
        ref = logits(model, x)
        with lora.accelerate_peft(model):
            logits(model, x)
            twin = copy.deepcopy(model)
            blob = pickle.dumps(model)
            torch.save(model, tmp_path / "m.pt")
            close(logits(twin, x), ref, "deepcopy")
            close(logits(pickle.loads(blob), x), ref, "pickle")
            # the copy has PEFT's own forward: its weights, not the original's
            for p in twin.parameters():
                p.data.zero_()
            assert not torch.equal(logits(model, x), logits(twin, x))
        close(logits(model, x), ref, "restored")


def test_a_scaling_not_finite_in_float32_falls_back_to_peft():
    model = peft_model(seed=14)
    model.set_adapter("a")
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    q.scaling["a"] = 1e39
    x = ids()
    with torch.no_grad(), lora.accelerate_peft(model) as acc:
        logits(model, x)
        assert "not finite in float32" in acc.skipped[
            "base_model.model.model.layers.0.self_attn.q_proj"]


def q_proj(model, layer=0):
    return model.base_model.model.model.layers[layer].self_attn.q_proj


def test_a_replaced_base_layer_is_used_at_the_next_call():
    model = peft_model(seed=11)
    model.set_adapter("a")
    q = q_proj(model)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    old = q.base_layer
    with torch.no_grad(), lora.accelerate_peft(model) as acc:
        q(x)
        q(x)  # the short path is in use
        torch.manual_seed(12)
        q.base_layer = torch.nn.Linear(64, 64, bias=False)
        got = q(x)
        assert "base_model.model.model.layers.0.self_attn.q_proj" in acc.accelerated
    with torch.no_grad():
        close(got, q(x), "after replacing base_layer")
        assert not torch.allclose(old(x), q.base_layer(x))


def test_hooks_on_lora_submodules_fall_back_while_registered():
    model = peft_model(seed=13)
    model.set_adapter("a")
    q = q_proj(model)
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    x = ids()
    calls = []

    def zero_b(module, args, output):  # an activation-patching hook: zero lora_B's output
        calls.append(module)
        return torch.zeros_like(output)

    with torch.no_grad():
        plain = logits(model, x)
        handle = q.lora_B["a"].register_forward_hook(zero_b)
        ref = logits(model, x)
        handle.remove()
        assert not torch.allclose(ref, plain)
        with lora.accelerate_peft(model) as acc:
            logits(model, x)
            logits(model, x)  # the short path is in use
            assert name in acc.accelerated
            calls.clear()
            handle = q.lora_B["a"].register_forward_hook(zero_b)
            got = logits(model, x)
            assert len(calls) == 1 and "lora_B['a']" in acc.skipped[name]
            close(got, ref, "with the hook")
            handle.remove()
            close(logits(model, x), plain, "hook removed")
            assert name in acc.accelerated
            for part in ("lora_A", "lora_dropout"):  # pre-hooks on the other submodules
                seen = []
                handle = getattr(q, part)["a"].register_forward_pre_hook(
                    lambda mod, args: seen.append(mod))
                logits(model, x)
                handle.remove()
                assert len(seen) == 1 and part in acc.skipped[name]
            seen = []
            handle = torch.nn.modules.module.register_module_forward_hook(
                lambda mod, args, out: seen.append(mod))
            logits(model, x)
            handle.remove()
            assert q.lora_A["a"] in seen and "global" in acc.skipped[name]
            logits(model, x)
            assert not acc.skipped


def test_a_1d_input_after_a_batched_call():
    model = peft_model(seed=14)
    model.set_adapter("a")
    q = q_proj(model)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 5, 64, generator=g), torch.randn(64, generator=g),
          torch.randn(3, 64, generator=g), torch.randn(64, generator=g),
          torch.randn(2, 5, 64, generator=g), torch.randn(2, 5, 64, generator=g)]
    with torch.no_grad():
        ref = [q(x) for x in xs]
        with lora.accelerate_peft(model) as acc:
            got = [q(x) for x in xs]
            assert "base_model.model.model.layers.0.self_attn.q_proj" in acc.accelerated
    for r, o in zip(ref, got):
        assert r.shape == o.shape
        close(o, r, f"input {tuple(r.shape)}")


def test_a_trainable_base_embedding_falls_back_under_autograd():
    model = peft_model(seed=15)
    model.set_adapter("c")  # on embed_tokens, lm_head and gate_proj
    embed = model.base_model.model.model.embed_tokens
    for n, p in model.named_parameters():  # frozen LoRA, a trainable base embedding
        p.requires_grad_(False)
    embed.base_layer.weight.requires_grad_(True)
    x = ids()
    ref = logits(model, x)
    ref.sum().backward()
    ref_grad = embed.base_layer.weight.grad.clone()
    embed.base_layer.weight.grad = None
    with lora.accelerate_peft(model) as acc:
        got = logits(model, x)
        got.sum().backward()
        assert "autograd" in acc.skipped["base_model.model.model.embed_tokens"]
    close(got.detach(), ref.detach())
    assert torch.allclose(embed.base_layer.weight.grad, ref_grad, rtol=1e-5, atol=1e-6)
    embed.base_layer.weight.requires_grad_(False)
    with torch.no_grad(), lora.accelerate_peft(model) as acc:
        logits(model, x)
        assert "base_model.model.model.embed_tokens" in acc.accelerated


class _OddBase(torch.nn.Module):
    """A base layer whose output is not what the short path takes: `kind` "strided" (a
    row-strided view: rows of a wider tensor) or "bf16"."""

    def __init__(self, inner, kind):
        super().__init__()
        self.inner, self.kind = inner, kind

    def forward(self, x):
        y = self.inner(x)
        if self.kind == "strided":
            return torch.cat([y, y], dim=-1)[..., :y.shape[-1]]
        if self.kind == "neg":  # a lazily negated view of the same values
            return torch._neg_view(-y)
        if self.kind == "columns":  # a last axis that is not contiguous
            return y.transpose(-1, -2).contiguous().transpose(-1, -2)
        return y.to(torch.bfloat16)


def test_the_short_path_checks_x_and_the_base_result_at_every_call():
    """The short path binds its C call once (deltas, scales, shape, codes) and checks only x and
    the base layer's fresh result: each call's bits are the full path's (the first call) for
    the same x, and an x or result it cannot take goes to the checked path, correctly."""
    model = peft_model(seed=15)
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    q = q_proj(model)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 64, generator=g)
    odd = [x.transpose(0, 1).contiguous().transpose(0, 1),  # not contiguous
           torch._neg_view(-x),                                # the neg bit
           x[:, :0]]                                           # no positions
    for active in ("a", ["a", "b"]):  # one adapter (the pointer call) and a stack of two
        model.base_model.set_adapter(active)
        with torch.no_grad():
            ref = q(x)
            ref_odd = [q(v) for v in odd]
            with lora.accelerate_peft(model) as acc:
                first = q(x)
                assert acc._layers[id(q)].plan is not None
                again = q(x)
                assert torch.equal(first, again), "the short path's bits are the full path's"
                close(again, ref, f"{active}")
                for v, r in zip(odd, ref_odd):
                    got = q(v)
                    assert got.shape == r.shape
                    if r.numel():
                        close(got, r, f"{active}: x {tuple(v.shape)} strides {v.stride()}")
                assert torch.equal(q(x), first)
                for kind in ("strided", "bf16"):
                    inner = q.base_layer
                    q.base_layer = _OddBase(inner, kind)
                    try:
                        got = q(x)
                    finally:
                        q.base_layer = inner
                    if kind == "bf16":
                        assert got.dtype == torch.bfloat16
                        assert (got.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
                    else:
                        assert not got.is_contiguous()
                        close(got, ref, f"{active}: a {kind} base result")
                assert name in acc.accelerated


def test_the_short_path_bumps_the_version_counter_under_grad_mode():
    """Grad mode on with every weight frozen: the kernels serve the call and tell autograd that
    the base result was written in place (its version counter), as torch's own add_ would."""
    model = peft_model(seed=16)
    model.base_model.set_adapter("a")
    model.requires_grad_(False)  # after set_adapter, which makes the active adapter trainable
    q = q_proj(model)
    x = torch.randn(3, 64)
    with lora.accelerate_peft(model) as acc:
        for _ in range(3):  # the full path, then the short one
            out = q(x)
            assert out._version == 1
        assert acc._layers[id(q)].plan is not None
        assert "base_model.model.model.layers.0.self_attn.q_proj" in acc.accelerated


def _record_plan_runs(monkeypatch):
    """The answers of the short path's C entry (lora._edge.plan_run), as "output" (served in C),
    "none" (declined before the base call) or "tail" (base result handed to the Python tail)."""
    from lora.peft_accel import lora_plan

    seen, real = [], lora_plan._plan_run

    def recording(plan, x):
        got = real(plan, x)
        seen.append("none" if got is None else "tail" if type(got) is tuple else "output")
        return got

    monkeypatch.setattr(lora_plan, "_plan_run", recording)
    return seen


class _CountingBase(torch.nn.Module):
    """A base layer that counts its calls (`kind` "same": returns its input, a square layer's
    output sharing x's memory; "raise": raises after the first `ok` calls)."""

    def __init__(self, inner, kind=None, ok=0):
        super().__init__()
        self.inner, self.kind, self.ok, self.calls = inner, kind, ok, 0

    def forward(self, x):
        self.calls += 1
        if self.kind == "same":
            return x
        if self.kind == "raise" and self.calls > self.ok:
            raise RuntimeError("the base layer failed")
        return self.inner(x)


@pytest.mark.parametrize("active", ["a", ("a", "b")])
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 64), (2, 5, 64)])
def test_the_short_path_runs_in_c_with_the_full_paths_bits(monkeypatch, active, shape):
    """After the first call the layer's short path is taken in C (lora._edge.plan_run) for a
    decode step, 2-D and 3-D batches, one adapter and a stack of two: the base layer runs once a
    call, and the bits are those of the full path (before the plan, and again without it)."""
    model = peft_model(seed=19)
    model.base_model.set_adapter(list(active) if isinstance(active, tuple) else active)
    q = q_proj(model)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    counting = q.base_layer = _CountingBase(q.base_layer)
    with torch.inference_mode():
        ref = q(x)
        with lora.accelerate_peft(model) as acc:
            seen = _record_plan_runs(monkeypatch)
            first = q(x)  # the full path: it leaves the plan behind
            plan = acc._layers[id(q)].plan
            assert plan is not None and plan.c is not None
            counting.calls = 0
            got = [q(x) for _ in range(3)]
            assert seen == ["output"] * 3 and counting.calls == 3
            acc._layers[id(q)].plan = None  # the full path again
            full = q(x)
    for g in got:
        assert torch.equal(g, first) and torch.equal(g, full)
    close(first, ref, f"{active} {shape}")


def test_the_short_path_in_c_declines_before_the_base_call_when_state_moves(monkeypatch):
    """What PEFT's forward depends on, changed between two calls: the C path declines before
    the base layer runs (once per call), and the Python path gives PEFT's values."""
    model = peft_model(seed=20)
    model.base_model.set_adapter("a")
    q = q_proj(model)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(6))
    counting = q.base_layer = _CountingBase(q.base_layer)
    lora_b = q.lora_B["a"]

    def hook_on_lora_a():
        return q.lora_A["a"].register_forward_hook(lambda *a: None)

    def new_b():  # the same values on new memory
        lora_b.weight.data = lora_b.weight.data.clone()

    def scaling():
        q.scaling["a"] = 0.5 * q.scaling["a"]

    changes = {"another active adapter": lambda: model.base_model.set_adapter("b"),
               "a hook on lora_A": hook_on_lora_a, "lora_B on new memory": new_b,
               "the scaling": scaling,
               "a global forward hook": lambda: torch.nn.modules.module.register_module_forward_hook(
                   lambda *a: None)}
    for what, change in changes.items():
        model.base_model.set_adapter("a")
        with torch.no_grad(), lora.accelerate_peft(model) as acc:
            q(x)
            seen = _record_plan_runs(monkeypatch)
            assert q(x) is not None and seen == ["output"], what
            handle = change()
            try:
                with torch.no_grad():
                    counting.calls = 0
                    got = q(x)
                assert seen[1:] == ["none"] and counting.calls == 1, what
                acc.restore()
                with torch.no_grad():
                    ref = q(x)
            finally:
                if handle is not None:
                    handle.remove()
        close(got, ref, what)
        monkeypatch.undo()
    with torch.no_grad(), lora.accelerate_peft(model):
        q(x)
        seen = _record_plan_runs(monkeypatch)
        q(x.t().contiguous().t())  # an x the C path does not take
        with torch.enable_grad():
            q(x)  # grad mode, with LoRA weights that require grad: PEFT's forward
    assert seen == ["none", "none"]


def test_the_short_path_sees_changes_that_keep_the_objects(monkeypatch):
    """Changes that keep every object and data pointer the plan holds: PEFT's set_adapter
    given the same list again after it changed in place, a rank cut by slicing `.data` (same
    memory, another shape), a view with other strides, and a dropout's p raised in training
    mode.  The short path (in C) notices each: PEFT's values."""
    for what in ("same list", "rank cut", "strides", "dropout p"):
        model = peft_model(seed=23)
        names = ["a"]
        model.base_model.set_adapter(names)
        q = q_proj(model)
        x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(8))
        with torch.no_grad(), lora.accelerate_peft(model) as acc:
            q(x)
            plan = acc._layers[id(q)].plan
            assert plan is not None
            seen = _record_plan_runs(monkeypatch)
            q(x)
            assert seen == ["output"], what
            a, b = q.lora_A["a"].weight, q.lora_B["a"].weight
            if what == "same list":
                names.append("b")
                model.base_model.set_adapter(names)
                model.requires_grad_(False)
            elif what == "rank cut":
                a.data, b.data = a.data[:2], b.data[:, :2]
            elif what == "strides":  # the same memory read as A^T's layout
                a.data = torch.as_strided(a.data, a.shape, (1, a.shape[0]))
            else:
                q.lora_dropout["a"] = torch.nn.Dropout(0.0)
                q(x)  # a plan over the new dropout module, p = 0
                q.lora_dropout["a"].p = 0.9
                model.train()
            torch.manual_seed(0)
            got = q(x)
            acc.restore()
            torch.manual_seed(0)
            ref = q(x)
            model.eval()
        monkeypatch.undo()
        close(got, ref, what)


def test_the_short_path_in_c_hands_a_base_result_it_does_not_take_to_the_python_tail(monkeypatch):
    """A base result the C path does not write (a last axis that is not contiguous) and a call
    C refuses (a base layer returning its input: x and out share memory) go to the Python tail,
    with the base layer run once: PEFT's values, x untouched.  A row-strided result (rows of a
    wider tensor) is written in place in C."""
    model = peft_model(seed=21)
    model.base_model.set_adapter("a")
    q = q_proj(model)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(7))
    inner = q.base_layer
    for kind in ("columns", "same", "strided"):
        base = _OddBase(inner, kind) if kind != "same" else _CountingBase(inner, "same")
        counting = q.base_layer = _CountingBase(base)
        try:
            with torch.no_grad():
                ref = q(x.clone())
                with lora.accelerate_peft(model):
                    q(x)
                    seen = _record_plan_runs(monkeypatch)
                    counting.calls = 0
                    kept = x.clone()
                    got = q(x)
            assert seen == (["output"] if kind == "strided" else ["tail"]), kind
            assert counting.calls == 1, kind
            assert torch.equal(x, kept), f"{kind}: x was written"
            close(got, ref, kind)
        finally:
            q.base_layer = inner
            monkeypatch.undo()


def test_an_error_of_the_base_layer_propagates_from_the_short_path_in_c():
    model = peft_model(seed=22)
    model.base_model.set_adapter("a")
    q = q_proj(model)
    x = torch.randn(2, 64)
    q.base_layer = _CountingBase(q.base_layer, "raise", ok=1)
    with torch.no_grad(), lora.accelerate_peft(model) as acc:
        q(x)
        assert acc._layers[id(q)].plan is not None
        with pytest.raises(RuntimeError, match="the base layer failed"):
            q(x)
        assert q.base_layer.calls == 2


def test_a_forward_kept_by_a_wrapper_gives_peft_back_after_restore():
    """Something that wrapped the patched forward (and so keeps it) calls PEFT's own forward once
    the acceleration is restored, and no longer holds the served layer."""
    model = peft_model(seed=17)
    model.base_model.set_adapter("a")
    q = q_proj(model)
    x = torch.randn(2, 64)
    with torch.no_grad():
        ref = q(x)
        acc = lora.accelerate_peft(model)
        kept = q.forward
        q(x)
        assert kept.layer is not None
        acc.restore()
        assert kept.layer is None
        assert torch.equal(kept(x), ref)


@pytest.mark.parametrize("kind", ["neg", "columns"])
def test_a_base_result_the_kernels_cannot_write_in_place_is_copied_once(kind):
    """A base layer returning a lazily negated view, or a tensor whose last axis is not
    contiguous: the layer adds the LoRA term into a contiguous copy (PEFT's result + lora is a
    new tensor too), on the full path and on the short one, with PEFT's values, and is served."""
    model = peft_model(seed=17)
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    model.base_model.set_adapter("a")
    q = q_proj(model)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    inner = q.base_layer
    q.base_layer = _OddBase(inner, kind)
    with torch.no_grad():
        ref = q(x)
        with lora.accelerate_peft(model) as acc:
            for _ in range(3):  # the full path, then the short one
                got = q(x)
                close(got, ref, kind)
                assert not got.is_neg() and got.is_contiguous()
            assert name in acc.accelerated


def test_a_hook_on_the_base_layer_keeps_the_base_output():
    """A forward hook on base_layer sees the base layer's output, and that tensor stays the base
    output after the layer returns (the term goes into a copy, as PEFT's result + lora does), on
    the full path and on the short one; the layer is still served."""
    model = peft_model(seed=18)
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    model.base_model.set_adapter("a")
    q = q_proj(model)
    seen = []
    handle = q.base_layer.register_forward_hook(lambda mod, inp, out: seen.append(out))
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4))
    try:
        with torch.no_grad():
            base = q.base_layer(x).clone()
            ref = q(x)
            with lora.accelerate_peft(model) as acc:
                for _ in range(3):
                    got = q(x)
                    close(got, ref, "with a hook on base_layer")
                    assert torch.equal(seen[-1], base) and seen[-1] is not got
                assert name in acc.accelerated
    finally:
        handle.remove()


class _Bypass(torch.nn.Linear):
    def forward(self, x):
        return x


def test_a_base_layer_returning_its_input():
    """A base layer that returns x itself (a square bypass): the term goes into a copy, x is left
    alone, the values are PEFT's."""
    model = peft_model(seed=19)
    model.base_model.set_adapter("a")
    q = q_proj(model)
    inner = q.base_layer
    q.base_layer = _Bypass(inner.in_features, inner.out_features)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    keep = x.clone()
    try:
        with torch.no_grad():
            ref = q(x)
            with lora.accelerate_peft(model) as acc:
                for _ in range(3):
                    close(q(x), ref, "bypass")
                    assert torch.equal(x, keep)
                assert "base_model.model.model.layers.0.self_attn.q_proj" in acc.accelerated
    finally:
        q.base_layer = inner


class _DoublingLinear(torch.nn.Linear):
    """A factor class of the user's own: twice what a Linear gives."""

    def forward(self, x):
        return 2 * super().forward(x)


def _changed_part(q, what):
    """Change one module PEFT's forward calls for adapter 'a' of layer `q`, keeping every object
    and parameter the short path holds (the same module objects, the same weights)."""
    lin = q.lora_B["a"]
    if what == "a bias set on lora_B":
        lin.bias = torch.nn.Parameter(torch.linspace(-1, 1, lin.out_features))
    elif what == "a bias set on lora_A":
        q.lora_A["a"].bias = torch.nn.Parameter(torch.full((q.lora_A["a"].out_features,), 0.25))
    elif what == "a forward set on lora_B":
        lin.forward = lambda t: 3 * torch.nn.functional.linear(t, lin.weight)
    elif what == "a forward set on the dropout":
        q.lora_dropout["a"].forward = lambda t: 0.5 * t
    elif what == "lora_A's class changed":
        q.lora_A["a"].__class__ = _DoublingLinear
    elif what == "a bias buffer on lora_B":
        del lin.bias
        lin.register_buffer("bias", torch.linspace(-1, 1, lin.out_features))
    elif what == "a bias attribute on lora_A":
        mod = q.lora_A["a"]
        del mod.bias
        mod.bias = torch.full((mod.out_features,), 0.25)
    elif what == "lora_A's weight a buffer":
        mod = q.lora_A["a"]
        w = mod.weight.detach().clone()
        del mod.weight
        mod.register_buffer("weight", 2 * w)
    elif what == "lora_B replaced by a subclass":
        new = _DoublingLinear(lin.in_features, lin.out_features, bias=False)
        new.weight = lin.weight
        q.lora_B["a"] = new
    else:
        raise AssertionError(what)


PART_CHANGES = ("a bias set on lora_B", "a bias set on lora_A", "a bias buffer on lora_B",
                "a bias attribute on lora_A", "lora_A's weight a buffer",
                "a forward set on lora_B", "a forward set on the dropout",
                "lora_A's class changed", "lora_B replaced by a subclass")


@pytest.mark.parametrize("what", PART_CHANGES)
def test_factors_and_dropouts_peft_did_not_make_go_to_peft(monkeypatch, what):
    """The kernels compute lora_B(lora_A(dropout(x))) for PEFT's own modules: bias-free
    torch Linear factors and a Dropout / Identity.  A bias given to a factor by hand, a forward
    set on an instance, or a factor of another class makes PEFT compute something else: the
    short path (in C) and the full path notice it, the call goes to PEFT's forward and gives
    its values, and the layer says why."""
    model = peft_model(seed=31)
    model.base_model.set_adapter("a")
    q = q_proj(model)
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), lora.accelerate_peft(model) as acc:
        plain = q(x)
        plan = acc._layers[id(q)].plan
        assert plan is not None and name in acc.accelerated
        seen = _record_plan_runs(monkeypatch)
        assert torch.equal(q(x), plain)
        _changed_part(q, what)
        got = q(x)
        assert seen == ["output", "none"], what
        assert name in acc.skipped, what
        again = q(x)  # the full path keeps sending it to PEFT
        acc.restore()
        ref = q(x)
    assert not torch.allclose(ref, plain), what
    close(got, ref, what)
    close(again, ref, what)


def test_a_dora_magnitude_module_with_its_own_forward_goes_to_peft():
    model = get_peft_model(tiny_llama(seed=32), LoraConfig(
        r=4, lora_alpha=8, use_dora=True, init_lora_weights=False,
        target_modules=["q_proj"])).eval()
    q = q_proj(model)
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(10))
    mag = q.lora_magnitude_vector["default"]
    real = mag.forward
    with torch.no_grad(), lora.accelerate_peft(model) as acc:
        plain = q(x)
        q(x)
        assert name in acc.accelerated
        mag.forward = lambda *a, **k: 2 * real(*a, **k)
        got = q(x)
        assert "lora_magnitude_vector" in acc.skipped[name]
        acc.restore()
        ref = q(x)
    assert not torch.allclose(ref, plain)
    close(got, ref, "a DoRA magnitude forward")


class _PeftOnlyBase(torch.nn.Module):
    """A base layer whose output the kernels do not add into but PEFT's ``result + term`` takes:
    `kind` "broadcast" (one row for the batch), "bigger" (two copies, a leading axis the term
    broadcasts over), "float64", or "grad" (a shift that requires grad and is not a parameter,
    applied with grad enabled).  Counts its calls."""

    def __init__(self, inner, kind):
        super().__init__()
        self.inner, self.kind, self.calls = inner, kind, 0
        self.shift = torch.linspace(-1, 1, inner.out_features).requires_grad_(True)

    def forward(self, x):
        self.calls += 1
        y = self.inner(x)
        if self.kind == "broadcast":
            return y.mean(0, keepdim=True)
        if self.kind == "bigger":
            return torch.stack([y, 2 * y])
        if self.kind == "float64":
            return y.double()
        with torch.enable_grad():
            return y + self.shift


@pytest.mark.parametrize("kind", ["broadcast", "bigger", "float64", "grad"])
@pytest.mark.parametrize("active", ["a", ("a", "b")])
def test_a_base_result_peft_adds_to_out_of_place_gets_peft_values(monkeypatch, kind, active):
    """PEFT adds the term out of place, so a base output that broadcasts with the term, of a
    dtype the kernels do not write, or that requires grad, still works under PEFT: the layer
    gives PEFT's values (shape, dtype, requires_grad), on the full path and the short path in
    C, with the base layer called once a call."""
    model = peft_model(seed=33)
    model.base_model.set_adapter(list(active) if isinstance(active, tuple) else active)
    q = q_proj(model)
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(11))
    inner = q.base_layer
    base = q.base_layer = _PeftOnlyBase(inner, kind)
    with torch.no_grad():
        ref = q(x)
        with lora.accelerate_peft(model) as acc:
            seen = _record_plan_runs(monkeypatch)
            got = []
            name = "base_model.model.model.layers.0.self_attn.q_proj"
            for step in range(2):
                if step:  # a plan made over the plain base, then this base again
                    q.base_layer = inner
                    q(x)
                    assert name in acc.accelerated
                    q.base_layer = base
                    plan = acc._layers[id(q)].plan
                    assert plan is not None and plan.c is not None
                base.calls = 0
                got.append(q(x))
                assert base.calls == 1, (kind, step)
                assert name in acc.skipped, (kind, step)
                assert acc._layers[id(q)].plan is None, (kind, step)  # dropped: the next
            assert seen == ["tail"], kind  # the call in C handed to the Python tail
    for step, g in enumerate(got):
        assert g.shape == ref.shape and g.dtype == ref.dtype, (kind, step)
        assert g.requires_grad == ref.requires_grad, (kind, step)
        close(g.detach(), ref.detach(), f"{kind} {active} call {step}")


def test_a_base_result_that_requires_grad_under_grad_mode_gets_peft_gradients():
    """Under grad mode, with the adapters and the base weights frozen, a base output that
    requires grad (through a tensor outside the base's parameters) keeps its graph: the
    gradients reaching that tensor are PEFT's."""
    model = peft_model(seed=34)
    model.base_model.set_adapter("a")
    model.requires_grad_(False)
    q = q_proj(model)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(12))
    base = q.base_layer = _PeftOnlyBase(q.base_layer, "grad")
    (q(x) ** 2).sum().backward()
    ref_out, ref_grad = q(x).detach(), base.shift.grad.clone()
    with lora.accelerate_peft(model) as acc:
        for step in range(2):
            base.shift.grad = None
            out = q(x)
            assert out.requires_grad
            (out ** 2).sum().backward()
            close(out.detach(), ref_out, f"call {step}")
            close(base.shift.grad, ref_grad, f"gradient, call {step}")
            # PEFT's sum on the base output, not PEFT's forward (which would call the base again)
            assert "the base layer's output" in acc.skipped[
                "base_model.model.model.layers.0.self_attn.q_proj"]


def test_mixed_batch_plans_run_in_c_per_composition_and_see_changes(monkeypatch):
    """A mixed batch (adapter_names) seen before runs its own short path in C, one per batch
    composition and number of axes (alternating 2-D and 3-D calls keep both), with the full
    path's bits; a changed scaling, a new adapter under a name the batch named but the layer
    lacked, or lora_B on new memory is noticed: PEFT's values."""
    model = peft_model(seed=35)
    q = q_proj(model)
    names = ["a", "__base__", "b", "zz"]  # q_proj holds a and b; zz is not an adapter here
    g = torch.Generator().manual_seed(13)
    x2, x3 = torch.randn(4, 64, generator=g), torch.randn(4, 3, 64, generator=g)
    with torch.no_grad(), lora.accelerate_peft(model) as acc:
        layer = acc._layers[id(q)]
        first = {2: q(x2, adapter_names=names), 3: q(x3, adapter_names=names)}
        assert set(layer.mixed) == {(tuple(names), 2), (tuple(names), 3)}
        seen = _record_plan_runs(monkeypatch)
        for _ in range(2):
            assert torch.equal(q(x2, adapter_names=names), first[2])
            assert torch.equal(q(x3, adapter_names=names), first[3])
        assert seen == ["output"] * 4
        acc.restore()
        ref = {2: q(x2, adapter_names=names), 3: q(x3, adapter_names=names)}
    close(first[2], ref[2], "2-D")
    close(first[3], ref[3], "3-D")

    def scaling():
        q.scaling["b"] = 3 * q.scaling["b"]

    def new_b():
        q.lora_B["a"].weight.data = 2 * q.lora_B["a"].weight.data

    def zz_added():
        model.add_adapter("zz", LoraConfig(r=2, init_lora_weights=False, target_modules=["q_proj"]))
        model.requires_grad_(False)

    for what, change in {"scaling": scaling, "lora_B on new memory": new_b,
                         "an adapter the batch named appears": zz_added}.items():
        with torch.no_grad(), lora.accelerate_peft(model):
            q(x3, adapter_names=names)
            seen = _record_plan_runs(monkeypatch)
            q(x3, adapter_names=names)
            change()
            got = q(x3, adapter_names=names)
            assert seen == ["output", "none"], what
        with torch.no_grad():
            close(got, q(x3, adapter_names=names), what)
        monkeypatch.undo()


@pytest.mark.parametrize("kind", ["broadcast", "float64", "grad"])
def test_a_mixed_batch_base_result_the_kernels_do_not_take_gets_peft_values(monkeypatch, kind):
    """PEFT's mixed batch adds each adapter's rows into the base output in place: a base output
    of another dtype or one that requires grad gets PEFT's values (shape, dtype,
    requires_grad) on the full path and through a mixed plan, with the base called once a
    call; one PEFT cannot index (a single broadcast row) raises PEFT's error."""
    model = peft_model(seed=36)
    q = q_proj(model)
    names = ["b", "a", "__base__", "a"]
    x = torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(14))
    inner = q.base_layer
    base = q.base_layer = _PeftOnlyBase(inner, kind)
    with torch.no_grad():
        if kind == "broadcast":
            with pytest.raises(Exception) as peft_error:
                q(x, adapter_names=names)
            with lora.accelerate_peft(model):
                with pytest.raises(peft_error.type):
                    q(x, adapter_names=names)
            return
        ref = q(x, adapter_names=names)
        with lora.accelerate_peft(model) as acc:
            seen = _record_plan_runs(monkeypatch)
            got = []
            for step in range(2):
                if step == 1:  # a mixed plan made over the plain base, then this base again
                    q.base_layer = inner
                    q(x, adapter_names=names)
                    q.base_layer = base
                    assert acc._layers[id(q)].mixed
                base.calls = 0
                got.append(q(x, adapter_names=names))
                assert base.calls == 1, (kind, step)
            assert seen == ["tail"], kind
    for step, g in enumerate(got):
        assert g.shape == ref.shape and g.dtype == ref.dtype, (kind, step)
        assert g.requires_grad == ref.requires_grad, (kind, step)
        close(g.detach(), ref.detach(), f"{kind} mixed, call {step}")


def test_a_mixed_batch_adds_into_the_base_output_as_peft_does():
    """PEFT's mixed batch adds each adapter's rows into the base layer's output in place: a
    forward hook on the base layer that keeps that tensor sees the LoRA rows, and the layer
    returns that very tensor, on the full path and through a mixed plan."""
    model = peft_model(seed=37)
    q = q_proj(model)
    names = ["a", "__base__", "b"]
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(15))
    kept = []
    handle = q.base_layer.register_forward_hook(lambda mod, args, out: kept.append(out))
    try:
        with torch.no_grad():
            ref = q(x, adapter_names=names)
            assert kept[-1] is ref
            with lora.accelerate_peft(model) as acc:
                for step in range(2):
                    got = q(x, adapter_names=names)
                    assert kept[-1] is got, step
                    close(got, ref, f"call {step}")
                assert acc._layers[id(q)].mixed
                assert "base_model.model.model.layers.0.self_attn.q_proj" in acc.accelerated
    finally:
        handle.remove()


def test_dora_on_a_1d_input_has_peft_shape():
    """PEFT's DoRA term on a Linear layer is [1, out] (its row factor is a [1, out] view),
    so a 1-D input gives a [1, out] output there: the same shape and values here."""
    for bias in (False, True):
        torch.manual_seed(38)
        net = torch.nn.Sequential(torch.nn.Linear(16, 24, bias=bias))
        model = get_peft_model(net, LoraConfig(r=4, use_dora=True, init_lora_weights=False,
                                               target_modules=["0"])).eval()
        x = torch.randn(16)
        with torch.no_grad():
            ref = model(x)
            with lora.accelerate_peft(model) as acc:
                got = model(x)
                assert acc.accelerated and not acc.skipped
        assert ref.shape == (1, 24) and got.shape == ref.shape, bias
        close(got, ref, f"bias {bias}")


class _EmbeddingBase(torch.nn.Embedding):
    """A base embedding whose output the kernels do not add into (see _PeftOnlyBase)."""

    def __init__(self, inner, kind):
        super().__init__(inner.num_embeddings, inner.embedding_dim)
        self.weight, self.kind, self.calls = inner.weight, kind, 0
        self.shift = torch.linspace(-1, 1, inner.embedding_dim).requires_grad_(True)

    def forward(self, ids):
        self.calls += 1
        y = super().forward(ids)
        if self.kind == "broadcast":
            return y.mean(0, keepdim=True)
        if self.kind == "float64":
            return y.double()
        with torch.enable_grad():
            return y * self.shift


def _embedding_model(seed, **config):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 12))
    return get_peft_model(net, LoraConfig(r=4, init_lora_weights=False, target_modules=["0"],
                                          **config)).eval()


@pytest.mark.parametrize("kind", ["broadcast", "float64", "grad"])
@pytest.mark.parametrize("mixed", [False, True])
def test_an_embedding_base_output_the_kernels_do_not_take_gets_peft_values(kind, mixed):
    model = _embedding_model(39)
    layer = model.base_model.model[0]
    base = layer.base_layer = _EmbeddingBase(layer.base_layer, kind)
    x = ids(3, 5)
    kw = {"adapter_names": ["default", "__base__", "default"]} if mixed else {}
    with torch.no_grad():
        if kind == "broadcast" and mixed:  # PEFT's mixed rows cannot index one row
            with pytest.raises(Exception) as peft_error:
                model(x, **kw)
            with lora.accelerate_peft(model), pytest.raises(peft_error.type):
                model(x, **kw)
            return
        ref = model(x, **kw)
        with lora.accelerate_peft(model) as acc:
            base.calls = 0
            got = model(x, **kw)
            assert base.calls == 1
            assert "the base layer's output" in acc.skipped["base_model.model.0"]
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert got.requires_grad == ref.requires_grad
    close(got.detach(), ref.detach(), f"{kind} mixed={mixed}")


def test_an_embedding_called_with_a_single_index_and_a_changed_dora_magnitude():
    """A 0-d index (PEFT's embedding returns one row) and a DoRA magnitude module given a
    forward of its own go to PEFT's forward: its values, and the layer says why."""
    model = _embedding_model(40)
    with torch.no_grad():
        ref = model(torch.tensor(5))
        with lora.accelerate_peft(model) as acc:
            got = model(torch.tensor(5))
            assert "single index" in acc.skipped["base_model.model.0"]
    assert got.shape == ref.shape == (12,)
    close(got, ref, "0-d index")
    model = _embedding_model(41, use_dora=True)
    mag = model.base_model.model[0].lora_magnitude_vector["default"]
    real = mag.forward
    x = ids(2, 4)
    with torch.no_grad(), lora.accelerate_peft(model) as acc:
        plain = model(x)
        assert "base_model.model.0" in acc.accelerated
        mag.forward = lambda *a, **k: tuple(2 * t for t in real(*a, **k))  # (scale, term)
        got = model(x)
        assert "lora_magnitude_vector" in acc.skipped["base_model.model.0"]
        acc.restore()
        ref = model(x)
    assert not torch.allclose(ref, plain)
    close(got, ref, "an embedding's DoRA magnitude forward")


def test_skipped_is_as_of_the_last_call_across_plain_and_mixed_calls():
    """A call that goes to PEFT (an adapter with a lora_bias in a mixed batch, a base output
    the kernels do not take) drops the layer's short paths, so the next plain or mixed call
    that is served again says so: `.skipped` is as of the last call."""
    model = peft_model(seed=42)
    model.add_adapter("lb", LoraConfig(r=2, lora_bias=True, init_lora_weights=False,
                                       target_modules=["q_proj"]))
    model.base_model.set_adapter("a")
    model.requires_grad_(False)
    q = q_proj(model)
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(16))
    with torch.no_grad(), lora.accelerate_peft(model) as acc:
        for _ in range(2):
            q(x)
            q(x, adapter_names=["a", "b", "a"])
        assert name in acc.accelerated
        q(x, adapter_names=["lb", "a", "a"])
        assert "lora_bias" in acc.skipped[name]
        q(x)
        assert name in acc.accelerated
        q(x, adapter_names=["a", "b", "a"])
        q.base_layer = _PeftOnlyBase(q.base_layer, "float64")
        q(x)
        assert name in acc.skipped
        q.base_layer = q.base_layer.inner
        q(x, adapter_names=["a", "b", "a"])
        assert name in acc.accelerated


@pytest.mark.parametrize("kind", ["same", "expanded"])
def test_a_mixed_batch_on_a_base_returning_its_input_or_an_expanded_view(kind):
    """A square base layer returning its input: PEFT's mixed rows go into that tensor, so x
    holds them (here too). An expanded (stride 0) output cannot take rows in place: the layer
    returns the rows in a new tensor (PEFT writes every row into the one it shares)."""
    model = peft_model(seed=43)
    q = q_proj(model)
    names = ["a", "__base__", "b"]
    x0 = torch.randn(3, 64, generator=torch.Generator().manual_seed(17))
    inner = q.base_layer
    if kind == "same":
        q.base_layer = _CountingBase(inner, "same")
    else:
        q.base_layer = _PeftOnlyBase(inner, "float64")
        q.base_layer.forward = lambda t: inner(t)[:1].expand(len(t), -1)
    with torch.no_grad():
        x = x0.clone()
        ref = q(x, adapter_names=names)
        ref_x = x.clone()
        with lora.accelerate_peft(model) as acc:
            for _ in range(2):
                x = x0.clone()
                got = q(x, adapter_names=names)
                assert "base_model.model.model.layers.0.self_attn.q_proj" in acc.accelerated
                if kind == "same":
                    assert got is x
                    close(x, ref_x, "x holds the rows")
                    close(got, ref, "same")
                else:
                    plain = inner(x0)[:1].expand(3, -1)
                    expect = torch.stack([plain[0] + lora_term for lora_term in (
                        q.lora_B["a"](q.lora_A["a"](x0[0])) * q.scaling["a"],
                        torch.zeros(plain.shape[1]),
                        q.lora_B["b"](q.lora_A["b"](x0[2])) * q.scaling["b"])])
                    close(got, expect, "expanded")


def test_alora_adds_into_the_base_output_in_place_as_peft_does():
    """PEFT's aLoRA adds its positions into the base layer's output in place: a hook on the
    base layer that keeps its output sees them, and the layer returns that tensor."""
    torch.manual_seed(44)
    net = torch.nn.Sequential(torch.nn.Linear(16, 24))
    model = get_peft_model(net, LoraConfig(r=4, init_lora_weights=False, target_modules=["0"],
                                           alora_invocation_tokens=[3])).eval()
    layer = model.base_model.model[0]
    kept = []
    layer.base_layer.register_forward_hook(lambda mod, args, out: kept.append(out))
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(18))
    with torch.no_grad():
        ref = model(x, alora_offsets=[2, 4])
        assert kept[-1] is ref
        with lora.accelerate_peft(model) as acc:
            got = model(x, alora_offsets=[2, 4])
            assert kept[-1] is got and acc.accelerated
    close(got, ref, "aLoRA in place")


def test_concurrent_forwards_with_the_active_adapters_are_each_right():
    """What docs/peft.md calls safe under threads: concurrent forwards that all use the active
    adapters, and, with mixed batches among the calls, every call under one lock: each thread
    gets the result of its call made alone."""
    import threading

    model = peft_model(seed=21)
    model.base_model.set_adapter(["a", "b"])
    xs = [ids(batch=2, t=6, seed=30 + i) for i in range(4)]
    mixes = [None, ["a", "c"], ["__base__", "b"]]
    with torch.no_grad(), lora.accelerate_peft(model) as acc:
        want = [logits(model, x) for x in xs]
        want_mixed = [logits(model, xs[0], adapter_names=m) for m in mixes]
        lock, wrong, phase = threading.Lock(), [], threading.Barrier(4)

        def worker(k):
            with torch.no_grad():
                for r in range(6):
                    i = (k + r) % len(xs)
                    if (logits(model, xs[i]) - want[i]).abs().max() > 1e-5:
                        wrong.append(("active", i))
            phase.wait()   # no unlocked call may run beside a mixed batch
            with torch.no_grad():
                for r in range(6):
                    j = (k + r) % len(mixes)
                    with lock:   # a mixed batch among the calls: every call under the lock
                        got = logits(model, xs[0], adapter_names=mixes[j])
                    if (got - want_mixed[j]).abs().max() > 1e-5:
                        wrong.append(("mixed", j))

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert acc.accelerated and not acc.skipped
    assert not wrong, wrong
