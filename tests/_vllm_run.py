"""One vLLM engine run for tests/test_vllm_e2e.py, in a process of its own (the environment it
needs — LORA_VLLM, LD_PRELOAD, the engine's process layout — is fixed at process start).

``python tests/_vllm_run.py SPEC.json``: SPEC holds ``model`` (a directory), ``adapters``
({name: directory}), ``requests`` ([[prompt token ids, adapter name or null], ...]),
``max_tokens``, ``engine`` (extra `vllm.LLM` arguments) and optionally ``lora_request``
({name: extra `LoRARequest` fields}).  The last line printed is
``RESULT {json}``: each request's greedy tokens, and what every worker process reports (the
wrapper class vLLM built, lora.vllm.stats(), the kernels' and torch's thread counts).
"""

import json
import os
import sys


def worker_report(worker=None):
    """Run inside each vLLM worker (collective_rpc): what served its LoRA layers."""
    import torch

    import lora

    report = {"pid": os.getpid(), "torch_threads": torch.get_num_threads(), "lora_threads": lora.get_num_threads(),
              "stats": {}, "wrapper": None}
    try:
        import lora.vllm as lv

        report["stats"] = lv.stats()
    except ImportError:
        pass
    runner = getattr(worker, "model_runner", None)
    manager = getattr(runner, "lora_manager", None)
    adapter_manager = getattr(manager, "_adapter_manager", None)
    wrappers = getattr(adapter_manager, "punica_wrapper_mapping", {}) or {}
    report["wrapper"] = sorted({f"{type(w).__module__}.{type(w).__qualname__}"
                                for w in wrappers.values()})
    return report


def main(path):
    with open(path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=spec["model"], dtype="float32", enable_lora=True, max_model_len=128,
              seed=0, enforce_eager=True, **spec["engine"])
    ids = {name: i + 1 for i, name in enumerate(spec["adapters"])}
    extra = spec.get("lora_request", {})    # {name: extra LoRARequest fields}
    lora_requests = [None if name is None else LoRARequest(name, ids[name],
                                                           spec["adapters"][name],
                                                           **extra.get(name, {}))
                     for _, name in spec["requests"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in spec["requests"]], params,
                        lora_request=lora_requests, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    workers = llm.collective_rpc(worker_report)
    print("RESULT " + json.dumps({"tokens": tokens, "workers": workers, "pid": os.getpid()}),
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
