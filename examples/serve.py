"""A multi-adapter serving loop: one base model, three LoRA adapters, a mixed batch per step.

    pip install -c .ci/constraints.txt -e ".[peft]"   # torch, peft, transformers: only to write the adapter files
    python examples/serve.py     # a few seconds; nothing is downloaded

What it shows:

1. three PEFT adapters, and a retrained version of one, written by PEFT itself for a tiny random
   Llama (built from a config) into a temporary directory, then loaded from those files with
   ``lora.load_peft``: ``chat`` (every projection), ``sql`` (q and v only) and ``check``, an
   activated LoRA (aLoRA) that acts only from its invocation tokens on;
2. an ``AdapterSet`` over them and one live bank per projection;
3. a toy NumPy model step: each layer's seven projections are base matmuls followed by one bank
   call, so every position of the batch gets its own request's adapter and scale.  The
   attention is reduced to a per-token gate (no KV cache): it is not a language model, it only
   runs every projection the way a server would;
4. a prefill of five requests (one on the base model, one scaled down to 0.5, one aLoRA whose
   positions before the invocation are masked with ``alora_mask``), then decode steps, with
   ``sql`` replaced by a retrained version (``AdapterSet.replace``) in the middle of the run:
   the next step sees it, under the same slot id.

Per-step times are printed; they include the NumPy base matmuls, which dominate at this size.
"""

import math
import os
import tempfile
import time
import warnings

# The toy's matmuls are tiny: NumPy's BLAS threads would only add wake-ups (on a busy 2-core
# machine, 100x the time of one thread).  Set before NumPy loads; yours wins if set.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402

import lora  # noqa: E402

HIDDEN, INTER, LAYERS, HEADS, VOCAB = 256, 688, 4, 4, 512
PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
        "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
        "down": "mlp.down_proj"}
INVOKE = [17, 42, 5]  # the aLoRA adapter's invocation sequence (token ids)


def write_adapters(directory):
    """PEFT writes three adapters, and a retrained ``sql``, for one tiny random Llama; returns
    the base weights as NumPy arrays ``{name: [out, in]}``."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                                   num_hidden_layers=LAYERS, num_attention_heads=HEADS)
    base = transformers.LlamaForCausalLM(cfg)
    weights = {k: v.numpy().copy() for k, v in base.state_dict().items()}
    every = [p.split(".")[-1] for p in PROJ.values()]
    # init_lora_weights=False: random B, as if trained (PEFT starts B at zero)
    kw = dict(task_type="CAUSAL_LM", init_lora_weights=False)
    configs = {
        "chat": LoraConfig(r=8, lora_alpha=16, target_modules=every, **kw),
        "sql": LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"], **kw),
        "check": LoraConfig(r=4, lora_alpha=8, target_modules=every,
                            alora_invocation_tokens=INVOKE, **kw),
        "sql-v2": LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"], **kw),
    }
    model = None
    with warnings.catch_warnings():  # a transformers deprecation notice that PEFT triggers
        warnings.simplefilter("ignore", FutureWarning)
        for name, config in configs.items():
            if model is None:
                model = get_peft_model(base, config, adapter_name=name)
            else:
                model.add_adapter(name, config)
    model.save_pretrained(directory, selected_adapters=list(configs))  # one directory each
    return weights


def rms_norm(h):
    return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-6)


def model_step(w, banks, tokens, ids, scales):
    """One pass of ``tokens`` [n] through the toy model; position i uses adapter slot ids[i]
    (-1: none) scaled by scales[i].  Returns the next token of every position, [n], and the
    seconds spent in the bank calls."""
    in_banks = 0.0

    def proj(layer, p, x):
        nonlocal in_banks
        y = x @ w[f"model.layers.{layer}.{PROJ[p]}.weight"].T      # the base projection
        t = time.perf_counter()
        banks[layer, p].add_batch_to(x, y, ids, scales)            # + each position's LoRA
        in_banks += time.perf_counter() - t
        return y

    h = w["model.embed_tokens.weight"][tokens]
    for layer in range(LAYERS):
        x = rms_norm(h)
        q, k, v = proj(layer, "q", x), proj(layer, "k", x), proj(layer, "v", x)
        gate = 1 / (1 + np.exp(-(q * k).sum(-1, keepdims=True) / math.sqrt(HIDDEN)))
        h = h + proj(layer, "o", gate * v)
        x = rms_norm(h)
        g, u = proj(layer, "gate", x), proj(layer, "up", x)
        h = h + proj(layer, "down", g / (1 + np.exp(-g)) * u)
    return (rms_norm(h) @ w["lm_head.weight"].T).argmax(-1), in_banks


class Request:
    def __init__(self, adapter, scale, prompt):
        self.adapter, self.scale, self.tokens = adapter, scale, list(prompt)


def batch_ids(adapters, requests, n_last):
    """Adapter slot ids and scales for the last ``n_last`` positions of each request, in order.
    An aLoRA adapter applies only from its invocation on: ``alora_mask`` says where."""
    ids, scales = [], []
    for r in requests:
        n = len(r.tokens) if n_last is None else n_last
        if r.adapter is None:
            ids.append(np.full(n, -1))
        else:
            where = adapters[r.adapter].alora_mask(r.tokens)[-n:]  # all True for plain LoRA
            ids.append(np.where(where, adapters.slot(r.adapter), -1))
        scales.append(np.full(n, r.scale))
    return np.concatenate(ids), np.concatenate(scales)


def timing(t0, in_banks):
    total = time.perf_counter() - t0
    return f"{total * 1e3:6.2f} ms (LoRA banks {in_banks * 1e3:5.2f} ms)"


def main(steps=8, replace_at=4):
    tmp = tempfile.TemporaryDirectory()
    t0 = time.perf_counter()
    w = write_adapters(tmp.name)
    print(f"PEFT wrote {sorted(os.listdir(tmp.name))} in {time.perf_counter() - t0:.1f} s")

    adapters = lora.AdapterSet({name: lora.load_peft(os.path.join(tmp.name, name))
                                for name in ("chat", "sql", "check")})
    for name in adapters:
        a = adapters[name]
        print(f"  slot {adapters.slot(name)}: {name:<5} {len(a):2d} projections, "
              f"{a.resident_bytes / 1024:.0f} KiB, invocation tokens {a.invocation_tokens}")
    banks = {(layer, p): adapters.bank(f"model.layers.{layer}.{PROJ[p]}")
             for layer in range(LAYERS) for p in PROJ}

    rng = np.random.default_rng(1)
    requests = [Request("chat", 1.0, rng.integers(50, VOCAB, 12)),
                Request("sql", 1.0, rng.integers(50, VOCAB, 9)),
                Request(None, 1.0, rng.integers(50, VOCAB, 7)),           # the base model
                Request("check", 1.0, [*rng.integers(50, VOCAB, 6), *INVOKE, 60]),
                Request("chat", 0.5, rng.integers(50, VOCAB, 10))]        # chat at half strength

    # prefill: every prompt position in one batch
    tokens = np.concatenate([r.tokens for r in requests])
    ids, scales = batch_ids(adapters, requests, None)
    t = time.perf_counter()
    nxt, in_banks = model_step(w, banks, tokens, ids, scales)
    print(f"prefill  {len(tokens):3d} positions {timing(t, in_banks)}   adapter ids {ids.tolist()}")
    ends = np.cumsum([len(r.tokens) for r in requests]) - 1
    for r, tok in zip(requests, nxt[ends]):
        r.tokens.append(int(tok))

    # decode: one new position per request and step
    for step in range(1, steps + 1):
        event = ""
        if step == replace_at:  # hot swap: same name, same slot, the retrained weights
            slot = adapters.replace("sql", lora.load_peft(os.path.join(tmp.name, "sql-v2")))
            event = f"  <- 'sql' replaced by sql-v2 in slot {slot}"
        last = np.array([r.tokens[-1] for r in requests])
        ids, scales = batch_ids(adapters, requests, 1)
        t = time.perf_counter()
        nxt, in_banks = model_step(w, banks, last, ids, scales)
        print(f"decode {step:2d} {len(last):3d} positions {timing(t, in_banks)}   adapter ids "
              f"{ids.tolist()}{event}")
        for r, tok in zip(requests, nxt):
            r.tokens.append(int(tok))

    for r in requests:
        print(f"{r.adapter or 'base':>5} x{r.scale:g}: ... {r.tokens[-steps - 1:]}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
