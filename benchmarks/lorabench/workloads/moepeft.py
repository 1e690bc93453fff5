"""The PEFT MoE rows: a whole Qwen3-MoE model with PEFT LoRA on attention and on the routed
experts (``target_parameters``), run end to end by PEFT and by ``lora.accelerate_peft``.

The model is built from a config (random weights, nothing downloaded): hidden 1024, 4 layers
(``--quick``: 1 layer of a model a quarter as wide), 32 experts, top-4, moe_intermediate 512,
16 heads (4 KV heads), vocab 4096; rank 16 on q, k, v, o and on every layer's ``gate_up_proj``
and ``down_proj`` experts; four adapters ``a0``..``a3`` (``init_lora_weights=False``: random
B).  A float32 and a bfloat16 model (the float32 PEFT model with its non-LoRA parameters cast,
as in the Llama PEFT rows).  PEFT's experts wrapper builds ``W + s B A`` for every expert at
every forward; ours adds the LoRA term for the routed pairs only.

Rows, each call under ``torch.inference_mode()`` (the steps of `lorabench.peftmodel`):

* ``peft moe decode b1``: one single-token step on a KV cache holding a 16-token prompt,
  adapter ``a0`` active;
* ``peft moe prefill b128``: one 128-token sequence, logits of its last position only;
* ``peft moe mixed b8``: one decode step of 8 sequences, ``adapter_names`` over ``a0``..``a3``
  and ``"__base__"`` (PEFT refuses ``adapter_names`` on its experts wrapper: no PEFT column).

Implementations: ``ours`` (accelerated); ``peft_unmerged`` (PEFT's own forward);
``peft_base``, the floor: the accelerated model with its adapter layers disabled (our experts
forward, no LoRA work: the base step both share); ``transformers_base``: the adapter layers
disabled under PEFT's forward, i.e. transformers' default experts implementation, the yardstick
of our experts forward itself.  Rounds interleave the implementations (a warm-up and two timed
calls each) as in the Llama PEFT rows, at least ``MIN_ROUNDS`` of them in a full run.  Before
timing, our logits are checked against PEFT's (a mixed batch: against PEFT run on each adapter's
sequences alone with that adapter active).
"""

from __future__ import annotations

import time
import warnings

from ..peftmodel import MIXED, PREFILL, PROMPT, PeftModels
from ..timing import Impl
from .core import Built, Skip, Workload

HIDDEN, LAYERS, EXPERTS, TOP_K, MOE_INTER, HEADS, KV_HEADS, VOCAB, RANK = 1024, 4, 32, 4, 512, 16, 4, 4096, 16
QUICK = {"hidden": 256, "layers": 1, "moe_inter": 128}
ADAPTERS = ("a0", "a1", "a2", "a3")  # MIXED (the mixed batch's names), PREFILL, PROMPT: the Llama rows'
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
DECODE, PREFILL_NAME, MIXED_NAME = "peft moe decode b1", f"peft moe prefill b{PREFILL}", "peft moe mixed b8"
_TOL = {"float32": 1e-5, "bfloat16": 3e-2}   # relative norm vs PEFT, as the Llama PEFT rows
ROW_BUDGET_S, QUICK_ROW_BUDGET_S, MIN_ROUNDS, MAX_ROUNDS = 40.0, 2.0, 5, 15


class MoeModels:
    """One dtype's MoE PEFT model, shared by its rows; ``use(state)`` puts it in a state:
    "ours", "peft_unmerged", "peft_base" (accelerated, adapter layers disabled) or
    "transformers_base" (PEFT's forward, adapter layers disabled)."""

    def __init__(self, ctx, quick, dtype):
        torch = ctx.torch
        try:
            import transformers
            from peft import LoraConfig, get_peft_model
        except ImportError as e:
            raise Skip(f"needs peft and transformers (pip install -c .ci/constraints.txt '.[bench]'): {e}") from None
        if not hasattr(transformers, "Qwen3MoeConfig"):
            raise Skip(f"transformers {transformers.__version__} has no Qwen3-MoE")
        self.torch, self.lora = torch, ctx.lora
        hidden = QUICK["hidden"] if quick else HIDDEN
        self.layers = QUICK["layers"] if quick else LAYERS
        torch.manual_seed(0)
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=self.layers, num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS, head_dim=hidden // HEADS, intermediate_size=2 * hidden,
            moe_intermediate_size=QUICK["moe_inter"] if quick else MOE_INTER, num_experts=EXPERTS,
            num_experts_per_tok=TOP_K, max_position_embeddings=256)
        with warnings.catch_warnings():  # PEFT's notes on target_parameters
            warnings.simplefilter("ignore")
            model = None
            for name in ADAPTERS:
                config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=ATTENTION,
                                    target_parameters=EXPERT_PARAMS, init_lora_weights=False)
                if model is None:
                    model = get_peft_model(transformers.AutoModelForCausalLM.from_config(cfg), config,
                                           adapter_name=name)
                else:
                    model.add_adapter(name, config)
        model.set_adapter(ADAPTERS[0])
        for name, p in model.named_parameters():
            if "lora_" not in name:
                p.data = p.data.to(getattr(torch, dtype))
        self.model = model.eval()
        self.state, self.acc = "peft_unmerged", None

    def use(self, state):
        if state == self.state:
            return
        if self.acc is not None:
            self.acc.restore()
            self.acc = None
        self.model.base_model.enable_adapter_layers()
        if state in ("ours", "peft_base"):
            self.acc = self.lora.accelerate_peft(self.model)
        if state in ("peft_base", "transformers_base"):
            self.model.base_model.disable_adapter_layers()
        self.state = state

    step = PeftModels.step  # the same decode / prefill / mixed calls as the Llama PEFT rows


def _models(ctx, quick, dtype):
    key = ("peft moe", quick, dtype)
    if key not in ctx.cache:
        for k in [k for k in ctx.cache if k[0] in ("peft", "peft moe")]:  # one model alive at a time
            del ctx.cache[k]
        ctx.cache[key] = MoeModels(ctx, quick, dtype)
    return ctx.cache[key]


def _mixed_check(m):
    """(ours, PEFT) logits of the last position of 8 prompts: ours in one mixed batch, PEFT on
    each adapter's prompts alone with that adapter active (``__base__``: adapters disabled)."""
    torch = m.torch
    x = torch.randint(0, VOCAB, (len(MIXED), PROMPT), generator=torch.Generator().manual_seed(5))

    @torch.inference_mode()
    def last(**kw):
        return m.model(input_ids=x[kw.pop("rows")] if "rows" in kw else x, use_cache=False,
                       logits_to_keep=1, **kw).logits[:, -1].double()

    def ours():
        m.use("ours")
        return last(adapter_names=MIXED).numpy()

    def peft():
        out = torch.empty(len(MIXED), VOCAB, dtype=torch.float64)
        for name in dict.fromkeys(MIXED):
            rows = [i for i, a in enumerate(MIXED) if a == name]
            m.use("transformers_base" if name == "__base__" else "peft_unmerged")
            if name != "__base__":
                m.model.set_adapter(name)
            out[rows] = last(rows=rows)
        m.use("peft_unmerged")
        m.model.set_adapter(ADAPTERS[0])
        return out.numpy()

    return ours, peft


def build_moe_peft(ctx, kind, quick, dtype):
    if ctx.torch is None:
        raise Skip("torch is not importable (or --no-torch)")
    m = _models(ctx, quick, dtype)
    mixed = kind == "mixed"
    m.use("ours" if mixed else "peft_unmerged")  # the step fills its cache: PEFT refuses a mixed one
    run = m.step(kind, m.model, MIXED if mixed else None)
    states = ["ours"] + ([] if mixed else ["peft_unmerged"]) + ["peft_base"]
    impls = {s: Impl(run, before=lambda s=s: m.use(s)) for s in states}
    base_run = m.step(kind, m.model) if mixed else run  # adapters disabled: no adapter_names
    impls["peft_base"] = Impl(base_run, before=lambda: m.use("peft_base"))
    impls["transformers_base"] = Impl(base_run, before=lambda: m.use("transformers_base"))

    def logits(state):
        m.use(state)
        return run().double().numpy()

    per_round = 0.0
    for name, impl in impls.items():
        impl.before()
        t = time.perf_counter()
        impl.fn()
        per_round += 3 * (time.perf_counter() - t)  # a warm-up and two samples each
    budget = QUICK_ROW_BUDGET_S if quick else ROW_BUDGET_S
    rounds = min(MAX_ROUNDS, int(budget / per_round))
    timing = {"rounds": max(1 if quick else MIN_ROUNDS, rounds), "samples": 2, "settle_s": 0.0,
              "impl_budget_s": 0.0}
    info = {"layers": m.layers, "floor": "peft_base"}
    check = _mixed_check(m) if mixed else (lambda: logits("ours"), lambda: logits("peft_unmerged"))
    return Built(impls, 0, 0, (*check, _TOL[dtype]), info, timing)


def workloads(quick):
    """The MoE PEFT rows, float32 first (one dtype's model is built once, by its first row)."""
    return [Workload(name, "peft", dtype, lambda c, k=kind, d=dtype: build_moe_peft(c, k, quick, d))
            for dtype in ("float32", "bfloat16")
            for name, kind in ((DECODE, "decode"), (PREFILL_NAME, "prefill"), (MIXED_NAME, "mixed"))]
