"""The vLLM serving rows' engine runs (lorabench/workloads/vllmrows.py), each in a process of
its own: the plug-in's switch (LORA_VLLM) is read when vLLM loads its plugins.

    python vllm_serve.py build DIR SIZES_JSON            # the model and adapters, into DIR
    python vllm_serve.py serve DIR SIZES_JSON REPEATS    # one engine: rows a, b, c

``build`` makes a Llama-shaped model from a config (random bfloat16 weights, nothing
downloaded) and PEFT adapters of the given rank on every linear layer (``init_lora_weights=
False``: random B).  ``serve`` starts one vLLM engine (LoRA enabled, max_loras = the adapter
count), warms every row up once, then times ``LLM.generate`` of each row REPEATS times,
interleaved, and prints ``RESULT {"times": {"a": [...], "b": [...], "c": [...]}, ...}``.
"""

import json
import os
import sys
import time


def build(root, sz):
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=sz["vocab"], hidden_size=sz["hidden"], intermediate_size=sz["inter"],
        num_hidden_layers=sz["layers"], num_attention_heads=sz["heads"],
        num_key_value_heads=sz["kv_heads"], max_position_embeddings=512,
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(os.path.join(root, "model"))
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(sz["vocab"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                         eos_token="t2").save_pretrained(os.path.join(root, "model"))
    for i in range(sz["adapters"]):
        torch.manual_seed(100 + i)
        peft_model = get_peft_model(model, LoraConfig(
            r=sz["rank"], lora_alpha=2 * sz["rank"], target_modules="all-linear",
            init_lora_weights=False))
        peft_model.save_pretrained(os.path.join(root, f"a{i}"))
        model = peft_model.unload()


def serve(root, sz, repeats):
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=os.path.join(root, "model"), dtype="bfloat16", enable_lora=True,
              max_loras=sz["adapters"], max_lora_rank=sz["rank"], max_num_seqs=sz["requests"],
              max_model_len=256, seed=0)
    adapters = [LoRARequest(f"a{i}", i + 1, os.path.join(root, f"a{i}"))
                for i in range(sz["adapters"])]
    n = sz["requests"]
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % (sz["vocab"] - 3) + 3
                                     for j in range(sz["prompt"])]} for i in range(n)]
    with_base = adapters + [None]
    rows = {"a": [None] * n,
            "b": [adapters[i % len(adapters)] for i in range(n)],
            "c": [with_base[i % len(with_base)] for i in range(n)]}
    params = SamplingParams(temperature=0.0, max_tokens=sz["new"], ignore_eos=True,
                            detokenize=False)
    times = {k: [] for k in rows}
    for k, reqs in rows.items():        # warm-up: every adapter loaded once, every shape seen
        llm.generate(prompts, params, lora_request=reqs, use_tqdm=False)
    for _ in range(repeats):
        for k, reqs in rows.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=reqs, use_tqdm=False)
            times[k].append(time.perf_counter() - t0)
            assert all(len(o.outputs[0].token_ids) == sz["new"] for o in outs)

    def stats(worker=None):
        try:
            import lora.vllm as lv
            return lv.stats()
        except ImportError:
            return {}
    try:
        served = llm.collective_rpc(stats)[0]
    except Exception:   # pragma: no cover - a vLLM without callable RPCs
        served = {}
    print("RESULT " + json.dumps({"times": times, "stats": served}), flush=True)


if __name__ == "__main__":
    cmd, root, sizes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if cmd == "build":
        build(root, sizes)
    else:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        serve(root, sizes, int(sys.argv[4]))
