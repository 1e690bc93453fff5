"""``torch.compile`` of a model under ``accelerate_peft``: the LoRA term is the custom op
``lora_kernels::peft_lora_term``, so a compiled Llama runs the kernels inside its graph (no
graph break at the LoRA layers), for plain LoRA, DoRA and mixed ``adapter_names`` batches; the
layers that cannot be traced (MoE experts, aLoRA calls) are one clean graph break each.  PEFT's
own uncompiled forward, in the same process, is the oracle; every test counts the op in the
graphs and its runs, so that a silent fallback cannot pass."""

import copy
import warnings

import pytest

import lora
from conftest import close_to_peft as close, peft_each_alone

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

pytestmark = pytest.mark.model   # builds transformers / PEFT models: the README stage runs these

VOCAB = 96
OP = "lora_kernels.peft_lora_term"


def llama(seed, bias=False, layers=1):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   attention_bias=bias)
    return transformers.LlamaForCausalLM(cfg).eval()


def peft_model(kind, seed=0):
    """Adapter "one" (DoRA when kind is "dora", on a model whose projections have a bias) on
    q/v/o and the embedding, adapter "two" (plain) on q and gate; random B and magnitudes."""
    dora = kind == "dora"
    model = get_peft_model(llama(seed, bias=dora), LoraConfig(
        r=4, lora_alpha=8, use_dora=dora, init_lora_weights=False,
        target_modules=["q_proj", "v_proj", "o_proj", "embed_tokens"]), adapter_name="one")
    model.add_adapter("two", LoraConfig(r=2, lora_alpha=3, init_lora_weights=False,
                                        target_modules=["q_proj", "gate_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(torch.rand(p.shape, generator=torch.Generator().manual_seed(seed)) + 0.5)
    return model.eval()


def ids(batch=3, t=6, seed=1):
    return torch.randint(0, VOCAB, (batch, t), generator=torch.Generator().manual_seed(seed))




def lora_layers(model):
    from peft.tuners.lora.layer import Embedding, Linear

    return {n for n, m in model.named_modules() if type(m) in (Embedding, Linear)}


class Recorder:
    """A torch.compile backend that keeps every graph it is given and compiles it as
    ``backend`` does (aot_eager: AOT autograd and functionalization, no code generation)."""

    def __init__(self, backend="aot_eager"):
        self.graphs = []
        self.backend = torch._dynamo.lookup_backend(backend)

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self.backend(gm, example_inputs)

    def ops(self):
        return sum(str(n.target).startswith(OP) for g in self.graphs for n in g.graph.nodes)


@pytest.fixture
def runs(monkeypatch):
    """The number of op runs (the layer's term_into, which the op's CPU kernel calls)."""
    from lora.peft_accel import lora_layer

    count = [0]
    original = lora_layer.Layer.term_into

    def counted(self, *args):
        count[0] += 1
        return original(self, *args)

    monkeypatch.setattr(lora_layer.Layer, "term_into", counted)
    return count


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def breaks_in_lora(fn, *args, **kwargs):
    """The graph breaks torch.compile makes in lora-kernels' own code for fn(*args, **kwargs)
    (as `torch._dynamo.explain` reports them: reason and the frames of user code)."""
    import os

    root = os.path.dirname(lora.__file__)
    found = torch._dynamo.explain(fn)(*args, **kwargs).break_reasons
    return [b.reason for b in found
            if any(f.filename.startswith(root) for f in (b.user_stack or []))]


@pytest.mark.parametrize("kind", ["plain", "dora"])
def test_a_compiled_model_runs_the_kernels_in_one_graph(kind, runs):
    """fullgraph=True (no graph break anywhere): the op once per LoRA layer in the graph and in
    each run; PEFT's logits for the active adapter, and for a stack of both (DoRA first: it
    rescales the running sum)."""
    model = peft_model(kind)
    ref_model = copy.deepcopy(model)
    x = ids()
    layers = lora_layers(model)
    acc = lora.accelerate_peft(model)
    rec = Recorder()
    compiled = torch.compile(model, backend=rec, fullgraph=True)
    with torch.no_grad():
        close(compiled(x).logits, ref_model(x).logits, f"{kind}: one")
        assert len(rec.graphs) == 1 and rec.ops() == len(layers) == runs[0]
        assert set(acc.accelerated) == layers and not acc.skipped
        runs[0] = 0
        compiled(x)                                         # the same graph again
        assert len(rec.graphs) == 1 and runs[0] == len(layers)
        if kind == "plain":   # the op takes the layers' short path after its first run
            assert all(layer.plan is not None for layer in acc._layers.values()
                       if layer.linear and layer.module.active_adapters[0] in layer.views)
        for m in (model, ref_model):
            m.base_model.set_adapter(["one", "two"])
        close(compiled(x).logits, ref_model(x).logits, f"{kind}: one + two")
        assert set(acc.accelerated) == layers and not acc.skipped
    assert all(str(n.target).startswith(OP) or "lora_kernels" not in str(n.target)
               for g in rec.graphs for n in g.graph.nodes)


@pytest.mark.parametrize("kind", ["plain", "dora"])
def test_a_compiled_mixed_batch_is_each_sequence_alone(kind, runs):
    """adapter_names (DoRA beside plain adapters and the base: PEFT's own forward refuses DoRA
    there): each sequence's logits are PEFT's for that sequence alone, the op runs once per
    LoRA layer, and no graph break is in lora-kernels' code (PEFT's forward breaks the graph
    where it registers its mixed-batch hooks)."""
    model = peft_model(kind, seed=1)
    ref_model = copy.deepcopy(model)
    x = ids(seed=2)
    names = ["two", "__base__", "one"]
    layers = lora_layers(model)
    acc = lora.accelerate_peft(model)
    rec = Recorder()
    compiled = torch.compile(model, backend=rec)
    with torch.no_grad():
        want = peft_each_alone(ref_model, x, names)
        ref_model.set_adapter("one")
        for _ in range(2):
            runs[0] = 0
            close(compiled(x, adapter_names=names).logits, want, f"{kind}: mixed batch")
            assert runs[0] == len(layers) and rec.ops() >= len(layers)
        assert set(acc.accelerated) == layers and not acc.skipped
        assert breaks_in_lora(model, x, adapter_names=names) == []


def test_inductor_runs_the_kernels(runs):
    """The default backend (Inductor, code generation included): the op survives into the
    generated code and runs once per LoRA layer; changes after compiling (a weight written in
    place, a new scale) are read by the op at the next run."""
    model = peft_model("plain", seed=3)
    ref_model = copy.deepcopy(model)
    x = ids(seed=4)
    layers = lora_layers(model)
    acc = lora.accelerate_peft(model)
    compiled = torch.compile(model)
    with torch.no_grad():
        close(compiled(x).logits, ref_model(x).logits, "inductor")
        assert runs[0] == len(layers) and set(acc.accelerated) == layers and not acc.skipped
        for m in (model, ref_model):
            q = m.base_model.model.model.layers[0].self_attn.q_proj
            q.lora_B["one"].weight.mul_(1.5)
            q.scaling["one"] = 0.25
        close(compiled(x).logits, ref_model(x).logits, "inductor, after changes")


@pytest.mark.parametrize("kind", ["moe", "alora"])
def test_layers_that_cannot_be_traced_are_one_clean_graph_break(kind):
    """MoE experts (the experts forward calls the kernels through cffi) and aLoRA calls (their
    offsets change with the tokens) run the eager forward in a graph break of their own: PEFT's
    logits, the layers served, and every break lora-kernels makes is that one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # PEFT's notes on target_parameters
        if kind == "moe":
            torch.manual_seed(5)
            cfg = transformers.Qwen3MoeConfig(
                vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=32,
                intermediate_size=64, moe_intermediate_size=24, num_experts=4,
                num_experts_per_tok=2)
            base = transformers.AutoModelForCausalLM.from_config(cfg).eval()
            config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                target_modules=["q_proj"],
                                target_parameters=["mlp.experts.gate_up_proj",
                                                   "mlp.experts.down_proj"])
        else:
            base = llama(5)
            config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"],
                                alora_invocation_tokens=[5, 9])
        model = get_peft_model(base, config).eval()
    x = ids(batch=2, t=8, seed=6)
    x[0, 2:4] = torch.tensor([5, 9])   # row 0 invokes the aLoRA adapter, row 1 does not
    with torch.no_grad():
        ref = model(x).logits
        with model.disable_adapter():
            assert (model(x).logits - ref).abs().max() > 1e-3   # the adapter matters
        acc = lora.accelerate_peft(model)
        close(torch.compile(model, backend="eager")(x).logits, ref, kind)   # dynamo alone
        assert acc.accelerated and not acc.skipped
    breaks = torch._dynamo.utils.counters["graph_break"]
    ours = repr(lora.peft_accel.torch_op.eager)   # the function torch.compiler.disable made
    # PEFT's own: aLoRA's offsets are found with a data-dependent nonzero() in PEFT's forward
    peft_own = "aten.nonzero" if kind == "alora" else None
    assert any(ours in reason for reason in breaks), "\n\n".join(breaks)
    assert all(ours in reason or (peft_own and peft_own in reason) for reason in breaks), \
        "\n\n".join(breaks)


def test_training_under_compile_gets_peft_gradients():
    """Autograd recording: the traced forward is PEFT's own, so a compiled training step gives
    PEFT's loss and gradients (the op is not used: it has no derivative)."""
    model = peft_model("plain", seed=7)
    ref_model = copy.deepcopy(model)
    model.train()
    ref_model.train()
    x = ids(seed=8)
    acc = lora.accelerate_peft(model)
    rec = Recorder()
    loss = torch.compile(model, backend=rec)(x, labels=x).loss
    loss.backward()
    ref = ref_model(x, labels=x).loss
    ref.backward()
    assert rec.ops() == 0 and set(acc.skipped) == lora_layers(model)
    assert all(why.startswith("autograd is recording") for why in acc.skipped.values())
    close(loss.detach(), ref.detach(), "loss")
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    want = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    assert grads.keys() == want.keys() and grads
    for n in grads:
        close(grads[n], want[n], n)


def test_the_op_passes_torch_opcheck():
    """Schema, fake (meta) implementation, AOT dispatch with dynamic shapes: torch's own checks
    of a custom op, on a served layer's real call."""
    model = peft_model("dora", seed=9)
    lora.accelerate_peft(model)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        for names in (None, ["two", "one"]):
            out = q.base_layer(x)
            result = torch.library.opcheck(torch.ops.lora_kernels.peft_lora_term.default,
                                           (x, out, id(q), names))
            assert all(v == "SUCCESS" for v in result.values()), result
