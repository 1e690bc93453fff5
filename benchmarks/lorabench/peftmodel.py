"""The PEFT rows: a whole Llama-shaped model with PEFT LoRA adapters, run end to end by PEFT and
by ``lora.accelerate_peft``.

The model is built from a config (random weights, nothing downloaded): hidden 1024, 8 layers
(``--quick``: 2), intermediate 2816, 16 heads, vocab 4096 (the LoRA work does not depend on it;
Llama's 32000 would add 128 MB of lm_head reads to every float32 step's floor), rank 16 on q, k,
v, o, gate, up and down, four adapters ``a0``..``a3`` (``init_lora_weights=False``: random B).
A float32 and a bfloat16 model: the bf16 one is the float32 PEFT model with only its non-LoRA
parameters cast to bf16, which is what PEFT's default (``autocast_adapter_dtype=True``) gives.

Rows, each call under ``torch.inference_mode()``:

* ``decode b1``: one single-token step on a KV cache holding a 16-token prompt (prefilled once;
  the cache is cropped back after every step), adapter ``a0`` active;
* ``prefill b128``: one 128-token sequence, logits of its last position only (as ``generate``
  asks for them), adapter ``a0`` active;
* ``mixed b8``: one decode step of 8 sequences, ``adapter_names`` over ``a0``..``a3`` and
  ``"__base__"``, on a cache of 16 positions per sequence.

Implementations: ``ours`` = PEFT's model under ``lora.accelerate_peft``; ``peft_unmerged`` =
PEFT's own forward (adapters float32); ``peft_bf16_adapters`` (bf16 model) = the same with the
adapters in bf16 (``autocast_adapter_dtype=False``); ``peft_base`` = the same model with its
adapter layers disabled, the floor of every row: no LoRA work, and the same base-model work as a
merged model (PEFT's forward calls the base layer alone in both states).  The floor runs on the
very tensors the other implementations read: a merged *copy* of the model lives elsewhere in
memory, and on a 2-vCPU Zen 4 VM two copies of the same weights ran a decode step 2.4-3 ms
apart (35-36 against 38-39 ms, every paired run), more than the LoRA overheads measured here.
The LoRA overhead of an implementation is its time less the floor's: a difference of a few ms
on a floor of tens, so the implementations are visited in many short rounds (a warm-up call and
two timed calls each, no settling pause), as many as fit in ``ROW_BUDGET_S`` (quick: ``QUICK_``),
and a slow change of the machine's load falls on all of them alike.  Before timing, our logits
are checked against PEFT's own (relative norm: float32 rounding for the float32 model).
"""

from __future__ import annotations

import time
import warnings

from .timing import Impl
from .workloads import Built, Skip, Workload

HIDDEN, INTER, HEADS, VOCAB, RANK = 1024, 2816, 16, 4096, 16
LAYERS, QUICK_LAYERS = 8, 2
ADAPTERS = ("a0", "a1", "a2", "a3")
PROMPT, PREFILL = 16, 128
MIXED = ["a0", "a1", "__base__", "a2", "a3", "a0", "__base__", "a1"]
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DECODE, PREFILL_NAME, MIXED_NAME = "peft decode b1", f"peft prefill b{PREFILL}", "peft mixed b8"
FLOORS = ("peft_base",)
# relative-norm tolerance of ours against PEFT's logits: float32 rounding through the layers;
# in bf16 a LoRA term summed in another order can round the other way, and that bf16 ulp moves on
_TOL = {"float32": 1e-5, "bfloat16": 3e-2}
ROW_BUDGET_S, QUICK_ROW_BUDGET_S, MAX_ROUNDS = 20.0, 3.0, 15


class PeftModels:
    """One dtype's model, shared by its rows: the PEFT model, its state set per timed block by
    ``use``."""

    def __init__(self, ctx, layers, dtype):
        torch = ctx.torch
        try:
            import transformers
            from peft import LoraConfig, get_peft_model
        except ImportError as e:
            raise Skip(f"needs peft and transformers (pip install -c .ci/constraints.txt '.[bench]'): {e}") from None
        self.torch, self.lora, self.layers = torch, ctx.lora, layers
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                                       num_hidden_layers=layers, num_attention_heads=HEADS,
                                       num_key_value_heads=HEADS)
        with warnings.catch_warnings():  # a transformers deprecation notice that PEFT triggers
            warnings.simplefilter("ignore", FutureWarning)
            model = None
            for name in ADAPTERS:
                config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=MODULES,
                                    init_lora_weights=False, task_type="CAUSAL_LM")
                if model is None:
                    model = get_peft_model(transformers.LlamaForCausalLM(cfg), config, adapter_name=name)
                else:
                    model.add_adapter(name, config)
        model.set_adapter(ADAPTERS[0])
        self.lora_params = []  # (parameter, its float32 data, a bf16 copy): peft_bf16_adapters
        for name, p in model.named_parameters():
            if "lora_" not in name:
                p.data = p.data.to(getattr(torch, dtype))
            elif dtype == "bfloat16":
                self.lora_params.append((p, p.data, p.data.to(torch.bfloat16)))
        self.model = model.eval()
        self.state, self.acc = "peft_unmerged", None

    def use(self, state):
        """Put the PEFT model in `state`: "ours" (accelerated), "peft_unmerged",
        "peft_bf16_adapters" or "peft_base" (adapter layers disabled)."""
        if state == self.state:
            return
        if self.acc is not None:
            self.acc.restore()
            self.acc = None
        for p, f32, _ in self.lora_params:
            p.data = f32
        self.model.base_model.enable_adapter_layers()
        if state == "ours":
            self.acc = self.lora.accelerate_peft(self.model)
        elif state == "peft_bf16_adapters":
            for p, _, bf16 in self.lora_params:
                p.data = bf16
        elif state == "peft_base":
            self.model.base_model.disable_adapter_layers()
        self.state = state

    def step(self, kind, model, adapter_names=None):
        """A no-argument call running one `kind` step of `model` under inference mode; returns the
        logits."""
        torch = self.torch
        g = torch.Generator().manual_seed(3)
        kw = {} if adapter_names is None else {"adapter_names": adapter_names}
        if kind == "prefill":
            x = torch.randint(0, VOCAB, (1, PREFILL), generator=g)

            @torch.inference_mode()
            def prefill():
                return model(input_ids=x, use_cache=False, logits_to_keep=1, **kw).logits

            return prefill
        batch = 1 if kind == "decode" else len(MIXED)
        prompt = torch.randint(0, VOCAB, (batch, PROMPT), generator=g)
        token = torch.randint(0, VOCAB, (batch, 1), generator=g)
        with torch.inference_mode():
            cache = model(input_ids=prompt, use_cache=True, **kw).cache

        @torch.inference_mode()
        def decode():
            logits = model(input_ids=token, cache=cache, use_cache=True, **kw).logits
            cache.crop(-1)  # back to the prompt: every step sees the same cache length
            return logits

        return decode


def overheads(result, stat="median_s"):
    """{implementation: its `stat` ("median_s" or "min_s") less the floor's} of a finished row,
    and the floor's own; the minima are the better guess of what a call costs when the machine
    is busy (noise only ever adds)."""
    impls = result["impls"]
    t0 = impls[result["floor"]][stat]
    return {k: v[stat] - t0 for k, v in impls.items() if k not in FLOORS}, t0


def fmt_overhead(seconds):
    """An overhead in ms.  A negative one (a time below the floor it contains: the floor's own
    run was slowed more by the machine's load) is noise, and is printed as such, never as a
    saving."""
    text = f"{seconds * 1e3:.2f}"
    return text + " [below the floor: noise]" if seconds < 0 else text


def _models(ctx, layers, dtype):
    key = ("peft", layers, dtype)
    if key not in ctx.cache:
        for k in [k for k in ctx.cache if k[0] == "peft"]:  # one dtype's models alive at a time
            del ctx.cache[k]
        ctx.cache[key] = PeftModels(ctx, layers, dtype)
    return ctx.cache[key]


def build_peft(ctx, kind, layers, dtype):
    if ctx.torch is None:
        raise Skip("torch is not importable (or --no-torch)")
    m = _models(ctx, layers, dtype)
    m.use("peft_unmerged")
    names = MIXED if kind == "mixed" else None
    run = m.step(kind, m.model, names)
    states = ["ours", "peft_unmerged"] + (["peft_bf16_adapters"] if dtype == "bfloat16" else [])
    impls = {s: Impl(run, before=lambda s=s: m.use(s)) for s in states}
    # the floor: the same batch on the same model with its adapter layers disabled (a mixed
    # batch without adapter_names: PEFT refuses adapter names for disabled layers)
    impls["peft_base"] = Impl(m.step(kind, m.model), before=lambda: m.use("peft_base"))

    def logits(state):
        m.use(state)
        return run().double().numpy()

    m.use("ours")
    t = time.perf_counter()
    run()
    per_round = 3 * len(impls) * (time.perf_counter() - t)  # a warm-up and two samples each
    budget = QUICK_ROW_BUDGET_S if layers == QUICK_LAYERS else ROW_BUDGET_S
    timing = {"rounds": max(1, min(MAX_ROUNDS, int(budget / per_round))), "samples": 2,
              "settle_s": 0.0, "impl_budget_s": 0.0}
    info = {"layers": layers, "floor": "peft_base"}
    return Built(impls, 0, 0, (lambda: logits("ours"), lambda: logits("peft_unmerged"), _TOL[dtype]), info,
                 timing)


def workloads(layers):
    """The PEFT rows, float32 first (the models of one dtype are built once, by its first row)."""
    return [Workload(name, "peft", dtype, lambda c, k=kind, d=dtype: build_peft(c, k, layers, d))
            for dtype in ("float32", "bfloat16")
            for name, kind in ((DECODE, "decode"), (PREFILL_NAME, "prefill"), (MIXED_NAME, "mixed"))]
