"""``lora.accelerate_peft`` on a mixture-of-experts model: PEFT LoRA on the routed experts.

    pip install -c .ci/constraints.txt -e ".[peft]"   # the tested torch (a CPU build), PEFT, transformers
    python examples/moe_generate.py     # about a minute on 2 cores; nothing is downloaded

A small random Qwen3-MoE built from a config (16 experts, top-4), two PEFT LoRA adapters on
its experts' 3-D weights and on q/v (``target_parameters``; ``init_lora_weights=False``: random
B, as if trained).  PEFT adds ``s B_e A_e`` to every expert's weight at every forward;
``accelerate_peft`` adds the LoRA term for the routed (token, expert) pairs only.

1. Greedy ``generate`` of a batch on adapter ``chat``: PEFT's forward, then inside ``with
   lora.accelerate_peft(model):``; tokens/s of both and of the base model (adapters disabled),
   and the tokens must be identical.
2. A mixed batch (``adapter_names``), which PEFT refuses on its experts layers: accelerated in one
   ``generate``, and each row must equal PEFT generating that row alone with its adapter.

Exits 1 unless every token agrees.  Timings on a machine whose cores are busy with other work
are noisy; PEFT's rebuild of the expert weights dominates its step either way.
"""

import sys
import time
import warnings

import torch
import transformers
from peft import LoraConfig, get_peft_model

import lora

ADAPTER_NAMES = ["sql", "chat", "__base__", "sql"]  # one per row of the mixed batch
PROMPT, NEW = 16, 16  # tokens per row: prompt, then generated
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def build():
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=4096, hidden_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                      intermediate_size=1024, moe_intermediate_size=256,
                                      num_experts=16, num_experts_per_tok=4)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with warnings.catch_warnings():  # PEFT's notes on target_parameters
        warnings.simplefilter("ignore")
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                                 target_parameters=EXPERTS, init_lora_weights=False),
                               adapter_name="chat")
        model.add_adapter("sql", LoraConfig(r=8, lora_alpha=16, target_parameters=EXPERTS,
                                            init_lora_weights=False))
    return model.eval()


def generate(model, prompt, **kw):
    """Greedy tokens [batch, PROMPT + NEW] and the seconds they took."""
    kw.update(do_sample=False, pad_token_id=0)
    model.generate(input_ids=prompt, max_new_tokens=2, **kw)  # warm-up
    t = time.perf_counter()
    out = model.generate(input_ids=prompt, max_new_tokens=NEW, min_new_tokens=NEW, **kw)
    return out, time.perf_counter() - t


def main():
    model = build()
    prompt = torch.randint(1, 4096, (len(ADAPTER_NAMES), PROMPT),
                           generator=torch.Generator().manual_seed(1))
    made = len(ADAPTER_NAMES) * NEW
    print(f"Qwen3-MoE: 4 layers, 16 experts, top-4; batch of {len(ADAPTER_NAMES)}, {PROMPT}-token "
          f"prompts, {NEW} new tokens each; torch threads: {torch.get_num_threads()}")
    model.set_adapter("chat")
    with torch.inference_mode():
        with model.disable_adapter():
            _, t_base = generate(model, prompt)
        ref, t_peft = generate(model, prompt)
        alone = {}
        for row, name in enumerate(ADAPTER_NAMES):  # PEFT: each row alone, on its adapter
            if name == "__base__":
                with model.disable_adapter():
                    alone[row] = generate(model, prompt[row:row + 1])[0][0]
            else:
                model.set_adapter(name)
                alone[row] = generate(model, prompt[row:row + 1])[0][0]
        model.set_adapter("chat")
        with lora.accelerate_peft(model) as acc:
            got, t_ours = generate(model, prompt)
            mixed, t_mixed = generate(model, prompt, adapter_names=ADAPTER_NAMES)
            experts = [n for n in acc.accelerated if n.endswith("mlp.experts")]

    def line(what, t):
        return f"{what:<34} {made / t:7.1f} tokens/s ({t:5.2f} s)"

    print(line("base model alone:", t_base))
    print(line("PEFT, adapter 'chat':", t_peft))
    print(line("accelerate_peft, adapter 'chat':", t_ours) + f", {t_peft / t_ours:.1f}x PEFT's tokens/s")
    print(line("accelerate_peft, mixed batch:", t_mixed) + f" (PEFT refuses adapter_names here); "
          f"{len(experts)} experts modules served, {len(acc.skipped)} layers left to PEFT")
    bad = []
    if not torch.equal(ref, got):
        bad.append("the single-adapter tokens differ from PEFT's")
    bad += [f"mixed row {row} ({ADAPTER_NAMES[row]}) differs from PEFT on that row alone"
            for row in alone if not torch.equal(mixed[row], alone[row])]
    if bad:
        print("MISMATCH: " + "; ".join(bad))
        return 1
    print(f"the generated tokens are identical to PEFT's ({ref.shape[0]} x {NEW}, twice)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
