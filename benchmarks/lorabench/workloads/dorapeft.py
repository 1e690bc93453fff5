"""The PEFT DoRA rows: the Llama of the PEFT rows (`lorabench.peftmodel`) with DoRA adapters
(``use_dora=True``) beside plain LoRA ones on the same modules, run end to end by PEFT and by
``lora.accelerate_peft``.

The model: the PEFT rows' Llama config (``--quick``: 1 layer of a model a quarter as wide, the
code path only: the quick run's budget has no room for PEFT's DoRA forward at full width),
float32, rank 16 on q, k, v, o, gate, up and down; two DoRA adapters ``d0``, ``d1`` and two
plain ones ``p0``, ``p1`` (``init_lora_weights=False``: random B; each DoRA magnitude is PEFT's
initial norm times ``1 + 0.1 N(0, 1)`` per row, as after training, so the row factors are not 1).

Rows, each call under ``torch.inference_mode()`` (the steps of `lorabench.peftmodel`):

* ``peft dora decode b1``: one single-token step on a 16-token KV cache;
* ``peft dora prefill b128`` (full run only): one 128-token sequence, last position's logits;
* ``peft dora mixed b8``: one decode step of 8 sequences, ``adapter_names`` over ``d0``, ``d1``,
  ``p0`` and ``p1`` (PEFT refuses DoRA adapters in such a batch: no PEFT column).

Implementations of the single-adapter rows: ``ours`` (``d0`` under ``accelerate_peft``);
``peft_unmerged`` (PEFT's default DoRA forward: ``W + s B A`` and its row norms at every call);
``peft_dora_cached`` (the same with ``peft.tuners.lora.dora.ENABLE_DORA_CACHING`` on: the norm
kept between calls in eval mode, stale after a scale change); ``ours_plain`` and ``peft_plain``
(``p0``, plain LoRA, ours and PEFT's); ``ours_set_scale`` (decode only: PEFT's ``set_scale`` on
every ``d0`` layer, alternating between two scales, then one accelerated decode step: the DoRA
norm for a new scale) and the floor ``peft_base`` (the same model with its adapter layers
disabled: no adapter work, on the same tensors; see `lorabench.peftmodel` for why not a merged
copy).  The mixed row: ``ours`` (the DoRA + plain batch), ``ours_plain`` (the same batch through
``p0`` alone) and the same floor.  Rounds interleave the
implementations (a warm-up and two timed calls each) as in the PEFT rows.  Before timing, our
logits are checked against PEFT's (the mixed batch: against PEFT run on each adapter's
sequences alone with that adapter active).
"""

from __future__ import annotations

import time
import warnings

from .. import peftmodel as pm
from ..timing import Impl
from .core import Built, Skip, Workload

DORA, PLAIN = ("d0", "d1"), ("p0", "p1")
MIXED = ["d0", "p0", "d1", "p1", "d0", "p1", "d1", "p0"]
DECODE, PREFILL_NAME, MIXED_NAME = "peft dora decode b1", f"peft dora prefill b{pm.PREFILL}", "peft dora mixed b8"
SCALES = (1.0, 0.5)  # ours_set_scale alternates between these
TOL = 1e-4  # relative norm vs PEFT: float32 rounding, and PEFT's norm is a float32 one
QUICK = {"hidden": 256, "inter": 704, "layers": 1, "heads": 4}
ROW_BUDGET_S, QUICK_ROW_BUDGET_S, MIN_ROUNDS, MAX_ROUNDS = 40.0, 2.0, 5, 15


class DoraModels:
    """The DoRA + plain PEFT model; ``use(state, adapter)`` puts
    the model in a state: "ours" (accelerated), "peft_unmerged", "peft_dora_cached" or
    "peft_base" (adapter layers disabled), with `adapter` active."""

    def __init__(self, ctx, quick):
        torch = ctx.torch
        try:
            import peft.tuners.lora.dora as peft_dora
            import transformers
            from peft import LoraConfig, get_peft_model
            from peft.tuners.lora import LoraLayer
        except ImportError as e:
            raise Skip(f"needs peft and transformers (pip install -c .ci/constraints.txt '.[bench]'): {e}") from None
        if not hasattr(peft_dora, "ENABLE_DORA_CACHING"):
            raise Skip("this peft has no peft.tuners.lora.dora.ENABLE_DORA_CACHING")
        self.torch, self.lora, self.peft_dora = torch, ctx.lora, peft_dora
        hidden, inter, self.layers, heads = ((QUICK["hidden"], QUICK["inter"], QUICK["layers"], QUICK["heads"])
                                             if quick else (pm.HIDDEN, pm.INTER, pm.LAYERS, pm.HEADS))
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=pm.VOCAB, hidden_size=hidden, intermediate_size=inter,
                                       num_hidden_layers=self.layers, num_attention_heads=heads,
                                       num_key_value_heads=heads)
        with warnings.catch_warnings():  # a transformers deprecation notice that PEFT triggers
            warnings.simplefilter("ignore", FutureWarning)
            model = None
            for name in DORA + PLAIN:
                config = LoraConfig(r=pm.RANK, lora_alpha=2 * pm.RANK, target_modules=pm.MODULES,
                                    init_lora_weights=False, use_dora=name in DORA, task_type="CAUSAL_LM")
                if model is None:
                    model = get_peft_model(transformers.LlamaForCausalLM(cfg), config, adapter_name=name)
                else:
                    model.add_adapter(name, config)
        g = torch.Generator().manual_seed(1)
        self.dora_layers = [mod for mod in model.modules() if isinstance(mod, LoraLayer) and "d0" in mod.scaling]
        with torch.no_grad():
            for mod in self.dora_layers:
                for name in DORA:
                    w = mod.lora_magnitude_vector[name].weight
                    w.mul_(1 + 0.1 * torch.randn(w.shape, generator=g))
        model.set_adapter("d0")
        self.model = model.eval()
        self.state, self.adapter, self.scale, self.acc = "peft_unmerged", "d0", SCALES[0], None

    step = pm.PeftModels.step  # the same decode / prefill / mixed calls as the PEFT rows

    def set_scale(self, scale):
        """PEFT's ``set_scale`` of ``d0`` on every layer (the user's call)."""
        for mod in self.dora_layers:
            mod.set_scale("d0", scale)
        self.scale = scale

    def use(self, state, adapter="d0"):
        if self.scale != SCALES[0]:
            self.set_scale(SCALES[0])
        if (state, adapter) == (self.state, self.adapter):
            return
        if self.acc is not None and state != "ours":
            self.acc.restore()
            self.acc = None
        self.peft_dora.ENABLE_DORA_CACHING = state == "peft_dora_cached"
        self.model.base_model.enable_adapter_layers()
        if adapter != self.adapter:
            self.model.set_adapter(adapter)  # under accelerate_peft too: it follows PEFT's switch
        if state == "ours" and self.acc is None:
            self.acc = self.lora.accelerate_peft(self.model)
            if self.acc.skipped:  # else "ours" would time PEFT's DoRA forward under our name
                raise AssertionError(f"accelerate_peft skipped DoRA layers: {dict(self.acc.skipped)}")
        elif state == "peft_base":
            self.model.base_model.disable_adapter_layers()
        self.state, self.adapter = state, adapter


def _models(ctx, quick):
    key = ("peft dora", quick)
    if key not in ctx.cache:
        for k in [k for k in ctx.cache if k[0] in ("peft", "peft moe", "peft dora")]:  # one model alive
            del ctx.cache[k]
        ctx.cache[key] = DoraModels(ctx, quick)
    return ctx.cache[key]


def _mixed_check(m):
    """(ours, PEFT) logits of the last position of 8 prompts: ours in one mixed batch, PEFT on
    each adapter's prompts alone with that adapter active."""
    torch = m.torch
    x = torch.randint(0, pm.VOCAB, (len(MIXED), pm.PROMPT), generator=torch.Generator().manual_seed(5))

    @torch.inference_mode()
    def last(rows=slice(None), **kw):
        return m.model(input_ids=x[rows], use_cache=False, logits_to_keep=1, **kw).logits[:, -1].double()

    def ours():
        m.use("ours")
        return last(adapter_names=MIXED).numpy()

    def peft():
        out = torch.empty(len(MIXED), pm.VOCAB, dtype=torch.float64)
        for name in dict.fromkeys(MIXED):
            m.use("peft_unmerged", name)
            rows = [i for i, a in enumerate(MIXED) if a == name]
            out[rows] = last(rows)
        return out.numpy()

    return ours, peft


def build_dora_peft(ctx, kind, quick):
    if ctx.torch is None:
        raise Skip("torch is not importable (or --no-torch)")
    m = _models(ctx, quick)
    mixed = kind == "mixed"
    m.use("ours")  # the step fills its cache: PEFT refuses DoRA adapters in a mixed one
    run = m.step(kind, m.model, MIXED if mixed else None)
    if mixed:
        impls = {"ours": Impl(run, before=lambda: m.use("ours")),
                 "ours_plain": Impl(m.step(kind, m.model, ["p0"] * len(MIXED)), before=lambda: m.use("ours")),
                 "peft_base": Impl(m.step(kind, m.model), before=lambda: m.use("peft_base"))}
        check = _mixed_check(m)
    else:
        impls = {"ours": Impl(run, before=lambda: m.use("ours")),
                 "ours_plain": Impl(run, before=lambda: m.use("ours", "p0"))}
        if kind == "decode":
            def set_scale_then_decode():
                m.set_scale(SCALES[1] if m.scale == SCALES[0] else SCALES[0])
                return run()

            impls["ours_set_scale"] = Impl(set_scale_then_decode, before=lambda: m.use("ours"))
        for state, adapter in (("peft_unmerged", "d0"), ("peft_dora_cached", "d0"), ("peft_plain", "p0")):
            impls[state] = Impl(run, before=lambda s=state, a=adapter: m.use(
                "peft_unmerged" if s == "peft_plain" else s, a))
        impls["peft_base"] = Impl(m.step(kind, m.model), before=lambda: m.use("peft_base"))

        def logits(state):
            m.use(state)
            return run().double().numpy()

        check = (lambda: logits("ours"), lambda: logits("peft_unmerged"))
    per_round = 0.0
    for impl in impls.values():
        if impl.before is not None:
            impl.before()
        t = time.perf_counter()
        impl.fn()
        per_round += 3 * (time.perf_counter() - t)  # a warm-up and two samples each
    rounds = min(MAX_ROUNDS, int((QUICK_ROW_BUDGET_S if quick else ROW_BUDGET_S) / per_round))
    timing = {"rounds": max(1 if quick else MIN_ROUNDS, rounds), "samples": 2, "settle_s": 0.0,
              "impl_budget_s": 0.0}
    info = {"layers": m.layers, "floor": "peft_base"}
    return Built(impls, 0, 0, (*check, TOL), info, timing)


def workloads(quick):
    """The PEFT DoRA rows (the model is built once, by the first)."""
    kinds = ((DECODE, "decode"), (MIXED_NAME, "mixed")) + (() if quick else ((PREFILL_NAME, "prefill"),))
    return [Workload(name, "peft", "float32", lambda c, k=kind: build_dora_peft(c, k, quick))
            for name, kind in kinds]
