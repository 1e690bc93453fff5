"""``lora.accelerate_peft``: PEFT's own ``generate`` for a mixed batch, with and without it.

    pip install -c .ci/constraints.txt -e ".[peft]"   # the tested torch (a CPU build), PEFT, transformers
    python examples/peft_generate.py     # nothing is downloaded; three rounds of each: 118 s on a
                                         # 2-vCPU Intel Xeon VM (KVM) whose cores other work kept busy

A small random Llama built from a config, two PEFT LoRA adapters (``init_lora_weights=False``:
random B, as if trained), and one greedy ``generate`` over a batch whose rows use different
adapters (``adapter_names``; ``"__base__"`` is the model without adapter).  The same call runs
under PEFT's forward, then inside ``with lora.accelerate_peft(model):``, which changes nothing in
PEFT's API.  Prints tokens/s for both, and for the base model alone (adapters disabled: what
the LoRA work costs on top of it), the fastest of three interleaved rounds each, and exits 1
unless the generated tokens are identical.  A LoRA cost below zero (a run faster than the base
model it contains) is the machine's noise and is flagged as such, as is a large spread between
the rounds.

The model is float32, and the token check holds in float32 only: in bfloat16 (or float16) PEFT's
logits and ours carry that dtype's rounding noise, of the same size but not the same bits, so a
greedy token may differ where two candidates are closer than the noise (docs/peft.md, "Results
in float32, bfloat16 and float16 models").  Judge a half-precision model by its logits' error
against the float32 model instead.

On a machine whose cores are busy with other work, PyTorch's thread pool can make every small
op many times slower; PEFT's mixed-batch path runs more ops than ours, so the ratio then grows
with the load.  ``OMP_NUM_THREADS=1 python examples/peft_generate.py`` shows the one-thread case.
"""

import sys
import time
import warnings

import torch
import transformers
from peft import LoraConfig, get_peft_model

import lora

ADAPTER_NAMES = ["sql", "chat", "__base__", "sql"]  # one per row of the batch
PROMPT, NEW = 16, 32  # tokens per row: prompt, then generated
ROUNDS = 3  # timed generations of each kind, interleaved; the fastest of each is reported


def build():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408,
                                   num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=8)
    model = transformers.LlamaForCausalLM(cfg)
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with warnings.catch_warnings():  # a transformers deprecation notice that PEFT triggers
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=every,
                                                 init_lora_weights=False, task_type="CAUSAL_LM"),
                               adapter_name="chat")
    model.add_adapter("sql", LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                        init_lora_weights=False))
    return model.eval()


def generate(model, prompt):
    """Greedy tokens [batch, PROMPT + NEW] and the seconds they took."""
    kw = dict(adapter_names=ADAPTER_NAMES, do_sample=False, pad_token_id=0)
    model.generate(input_ids=prompt, max_new_tokens=2, **kw)  # warm-up
    t = time.perf_counter()
    out = model.generate(input_ids=prompt, max_new_tokens=NEW, min_new_tokens=NEW, **kw)
    return out, time.perf_counter() - t


def lora_cost(t, t_base, steps=NEW):
    """What the LoRA work added per generated step, in ms; a time below the base model's (which
    it contains) is the machine's noise, and says so rather than print a negative cost."""
    cost = (t - t_base) / steps * 1e3
    if cost < 0:
        return f"LoRA cost not measurable: {-cost:.2f} ms/step below the base model's time (noise, not a saving)"
    return f"LoRA {cost:6.2f} ms/step"


def main():
    model = build()
    prompt = torch.randint(1, 4096, (len(ADAPTER_NAMES), PROMPT),
                           generator=torch.Generator().manual_seed(1))
    made = len(ADAPTER_NAMES) * NEW
    print(f"batch of {len(ADAPTER_NAMES)} rows on adapters {ADAPTER_NAMES}, {PROMPT}-token "
          f"prompts, {NEW} new tokens each; torch threads: {torch.get_num_threads()}")
    times = {"base": [], "peft": [], "ours": []}
    with torch.inference_mode():
        for _ in range(ROUNDS):  # interleaved: a burst of load slows one round of each, not one kind
            with model.disable_adapter():
                times["base"].append(generate(model, prompt)[1])
            ref, t = generate(model, prompt)
            times["peft"].append(t)
            with lora.accelerate_peft(model) as acc:
                got, t = generate(model, prompt)
            times["ours"].append(t)
    t_base, t_peft, t_ours = (min(times[k]) for k in ("base", "peft", "ours"))
    noisy = []

    def line(what, t):
        cost = "" if t is t_base else ", " + lora_cost(t, t_base)
        if "noise" in cost:
            noisy.append(what)
        return f"{what:<22} {made / t:6.1f} tokens/s ({t:5.2f} s{cost})"

    print(line("base model alone:", t_base))
    print(line("PEFT:", t_peft))
    print(line("lora.accelerate_peft:", t_ours) + f", {t_peft / t_ours:.2f}x PEFT's tokens/s; "
          f"{len(acc.accelerated)} LoRA layers served, {len(acc.skipped)} left to PEFT")
    spread = max(max(v) / min(v) for v in times.values())
    if noisy or spread > 1.2:
        print(f"noisy: the {ROUNDS} rounds of one kind differ by up to {spread:.2f}x (other work on the "
              f"machine?); the times above are the fastest round of each")
    if not torch.equal(ref, got):
        rows = sorted({int(r) for r in (ref != got).nonzero()[:, 0]})
        print(f"MISMATCH: the generated tokens differ in rows {rows}")
        return 1
    print(f"the generated tokens are identical ({ref.shape[0]} x {NEW}; a float32 model: in "
          f"bfloat16 they may differ within rounding noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
