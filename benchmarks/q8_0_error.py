"""The quantization error of q8_0 storage: how far ``s · B A x`` of a q8_0 delta lies from the
float32 adapter's, per shape class, for random and trained-like factors.

    python benchmarks/q8_0_error.py            # about a minute (PyTorch and PEFT for the
                                               # trained-like rows; without them those are skipped)

The error of a delta is ``||d_q8(x) - d_f32(x)|| / ||d_f32(x)||`` over a batch of random
activations, ``d(x) = s · B (A x)`` computed by the library (so only the stored values differ),
reported as the median and the largest over the deltas of a class.  Factors:

* **random**: Gaussian factors at a given magnitude, A and B alike;
* **PEFT init**: A as PEFT initialises it (``init_lora_weights=True``: Kaiming-uniform, bound
  ``1 / sqrt(in)``), B Gaussian at a given magnitude (what a few steps of training give it);
* **trained**: a PEFT adapter on a small Llama-shaped model built from a config, trained a few
  AdamW steps on random tokens from PEFT's own initialisation (B starts at 0), saved by PEFT and
  loaded by `lora.load_peft` with ``dtype="float32"`` and ``dtype="q8_0"``.

Q8_0 stores a block's scale ``d = max|x| / 127`` in float16: below ``max|x| = 127 · 2^-14 ≈
7.75e-3`` the scale is subnormal and keeps fewer significant bits (``d`` is a multiple of
``2^-24``), so the whole block is scaled by up to half a step of ``2^-24 / d`` off.  The rows at
small magnitudes show how much that costs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np

import lora

SHAPES = (("q/k/v/o 4096x4096", 4096, 4096), ("gate/up 11008x4096", 11008, 4096),
          ("down 4096x11008", 4096, 11008))


def rel_err(dq, df, x):
    """The relative error of dq's delta against df's on activations x [n, cols]."""
    oq = np.zeros((x.shape[0], dq.rows), np.float32)
    of = np.zeros_like(oq)
    dq.add_batch_to(x, oq)
    df.add_batch_to(x, of)
    return float(np.linalg.norm(oq.astype(np.float64) - of) / max(np.linalg.norm(of.astype(np.float64)), 1e-300))


def pair_error(a, b, rng, n=8):
    """Relative error of the q8_0 pair against the float32 pair on n random activations."""
    df = lora.LoraDelta(a, b, alpha=2.0 * a.shape[0])
    dq = lora.LoraDelta(a, b, alpha=2.0 * a.shape[0], dtype="q8_0")
    x = rng.standard_normal((n, a.shape[1])).astype(np.float32)
    return rel_err(dq, df, x)


def synthetic_rows(rng, rank):
    rows = []
    for label, r, c in SHAPES:
        for mag in (1.0, 1e-2, 3e-3, 1e-3, 1e-4):
            a = (rng.standard_normal((rank, c)) * mag).astype(np.float32)
            b = (rng.standard_normal((r, rank)) * mag).astype(np.float32)
            rows.append((f"random N(0, {mag:g}^2)", label, rank, pair_error(a, b, rng)))
        bound = 1.0 / np.sqrt(c)          # PEFT's Kaiming-uniform A
        for bmag in (1e-2, 1e-3, 1e-4, 3e-5, 1e-5):
            a = rng.uniform(-bound, bound, (rank, c)).astype(np.float32)
            b = (rng.standard_normal((r, rank)) * bmag).astype(np.float32)
            rows.append((f"PEFT-init A, B N(0, {bmag:g}^2)", label, rank, pair_error(a, b, rng)))
    return rows


def trained_rows(steps=20, lr=2e-4, rank=16):
    """A PEFT LoRA on a small Llama from a config, trained `steps` AdamW steps on random
    tokens; every target's error, by module kind."""
    try:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        print(f"trained-like rows skipped: {exc}", file=sys.stderr)
        return []
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=8)
    model = LlamaForCausalLM(cfg)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (4, 64))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    rng = np.random.default_rng(1)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        f32 = lora.load_peft(tmp, dtype="float32")
        q8 = lora.load_peft(tmp, dtype="q8_0")
        for name, df in f32.items():
            kind = name.rsplit(".", 1)[-1]
            a, b = df.lora_weights()
            x = rng.standard_normal((8, df.cols)).astype(np.float32)
            out.append((f"trained {steps} steps, lr {lr:g}", f"{kind} {df.rows}x{df.cols}", df.rank,
                        rel_err(q8[name], df, x), float(np.abs(a).max()), float(np.abs(b).max())))
    return out


def summarise(rows):
    groups = {}
    for r in rows:
        groups.setdefault(r[:3], []).append(r[3])
    return [(*k, float(np.median(v)), float(np.max(v)), len(v)) for k, v in groups.items()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"lora {lora.kernel_info()['version']}, isa {lora.kernel_info()['isa']}")
    print("| factors | shape class | rank | median rel. error | max | deltas |")
    print("|---|---|---|---|---|---|")
    for f, shape, rank, med, mx, n in summarise(synthetic_rows(rng, args.rank)):
        print(f"| {f} | {shape} | {rank} | {med:.2e} | {mx:.2e} | {n} |")
    trained = trained_rows(args.steps, rank=args.rank)
    if trained:
        amax = max(r[4] for r in trained)
        bmax = max(r[5] for r in trained)
        for f, shape, rank, med, mx, n in summarise([r[:4] for r in trained]):
            print(f"| {f} | {shape} | {rank} | {med:.2e} | {mx:.2e} | {n} |")
        print(f"\ntrained: max |A| {amax:.3g}, max |B| {bmax:.3g}")


if __name__ == "__main__":
    main()
