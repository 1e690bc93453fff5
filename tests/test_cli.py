"""`python -m lora info | inspect PATH`, run as a user runs it: a subprocess of this interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lora

import _adapter_files as af

FIXTURES = Path(__file__).parent / "fixtures"
PEFT_DIR = FIXTURES / "peft_r8_alpha16"
GGUF_LORA = FIXTURES / "gguf" / "lora_r8_alpha16_f32.gguf"
# the directory holding the `lora` this test imported (installed, editable or built in place),
# so the subprocess runs the very same package
LORA_ROOT = Path(lora.__file__).resolve().parent.parent


def _python(*args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(LORA_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=120)


def _run(*args):
    return _python("-m", "lora", *args)


def _meta(name):
    with np.load(FIXTURES / name) as z:
        return json.loads(str(z["meta_json"]))


def _target_lines(stdout, names):
    lines = stdout.splitlines()
    return {name: next(l for l in lines if l.split()[:1] == [name]) for name in names}


def test_inspect_peft_directory():
    res = _run("inspect", PEFT_DIR)
    assert res.returncode == 0, res.stderr
    modules = _meta("peft_r8_alpha16_reference.npz")["modules"]
    lines = _target_lines(res.stdout, modules)
    for name, line in lines.items():
        rows, cols = modules[name]["base_weight_shape"]
        # name, rows x cols, rank, alpha, effective scale, dtype, bytes
        assert line.split() == [name, str(rows), "x", str(cols), "8", "16", "2", "float32",
                                str(8 * (rows + cols) * 4)]
    total = sum(8 * (r + c) * 4 for r, c in (m["base_weight_shape"] for m in modules.values()))
    assert res.stdout.splitlines()[0].startswith("peft_r8_alpha16: PEFT")
    assert f"total: {len(modules)} targets" in res.stdout and f"{total} bytes" in res.stdout
    assert len(res.stdout.splitlines()) == len(modules) + 3        # title, header, targets, total


def test_inspect_peft_safetensors_file_with_scale():
    res = _run("inspect", PEFT_DIR / "adapter_model.safetensors", "--scale", "0.25")
    assert res.returncode == 0, res.stderr
    line = _target_lines(res.stdout, ["lm_head"])["lm_head"]
    assert line.split()[6] == "0.5"                                 # 0.25 * 16 / 8


def test_inspect_alora_shows_its_invocation_tokens():
    res = _run("inspect", FIXTURES / "peft_r8_alpha16_alora")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0].endswith(", aLoRA invocation tokens [17, 42, 5]")
    assert "invocation" not in _run("inspect", PEFT_DIR).stdout


def test_inspect_gguf():
    res = _run("inspect", GGUF_LORA, "--scale", "0.5")
    assert res.returncode == 0, res.stderr
    tensors = _meta("llamacpp_r8_alpha16_f32_reference.npz")["tensors"]
    lines = _target_lines(res.stdout, tensors)
    for name, line in lines.items():
        n_in, n_out = tensors[name]["base_ne"]
        assert line.split() == [name, str(n_out), "x", str(n_in), "8", "16", "1", "float32",
                                str(8 * (n_in + n_out) * 4)]
    assert res.stdout.splitlines()[0].startswith("Peft_R8_Alpha16: GGUF")


def test_inspect_shows_warnings_only_on_success(tmp_path):
    rng = np.random.default_rng(0)
    tensors = af.gguf_linear(rng, "blk.0.attn_q.weight", 8, 16, 2)
    tensors.append(("blk.0.attn_norm.weight", np.ones(16, np.float32), None))
    res = _run("inspect", af.write_gguf(tmp_path / "n.gguf", tensors))
    assert res.returncode == 0, res.stderr
    assert "blk.0.attn_norm.weight" in res.stderr and "blk.0.attn_q.weight" in res.stdout


@pytest.mark.parametrize("case", ["base_model", "truncated", "missing", "not_adapter"])
def test_inspect_bad_file_exits_2_with_one_line(tmp_path, case):
    if case == "base_model":
        path, names = FIXTURES / "gguf" / "base_f32.gguf", ["general.type"]
    elif case == "truncated":
        path = af.write_gguf(tmp_path / "cut.gguf", af.gguf_linear(np.random.default_rng(1),
                                                                   "blk.0.attn_q.weight", 8, 16, 2))
        af.truncate(path, -5)
        names = ["blk.0.attn_q.weight.lora_b"]
    elif case == "missing":
        path, names = tmp_path / "nothing_here", []
    else:
        weights = {"model.layers.0.q_proj.weight": np.ones((2, 2), np.float32)}
        path = af.write_peft(tmp_path / "p", weights, af.peft_config())
        names = ["model.layers.0.q_proj.weight"]
    res = _run("inspect", path)
    assert res.returncode == 2
    assert res.stdout == ""
    err = res.stderr.splitlines()
    assert len(err) == 1, res.stderr
    assert str(path) in err[0] and all(n in err[0] for n in names)


@pytest.mark.parametrize("case", ["random_bytes", "base_model_safetensors", "empty"])
def test_inspect_a_file_that_is_not_an_adapter_says_so(tmp_path, case):
    """A random file, or a base model's model.safetensors (no adapter_config.json, no lora_A /
    lora_B tensors): the one line says the file is not a LoRA adapter, and why."""
    if case == "random_bytes":
        path = tmp_path / "weights.bin"
        path.write_bytes(np.random.default_rng(2).bytes(4096))
        why = "neither a GGUF file nor a readable safetensors file"
    elif case == "base_model_safetensors":
        from safetensors.numpy import save_file

        path = tmp_path / "base" / "model.safetensors"
        path.parent.mkdir()
        save_file({"model.embed_tokens.weight": np.ones((8, 4), np.float32),
                   "model.layers.0.self_attn.q_proj.weight": np.ones((4, 4), np.float32)}, str(path))
        why = "no adapter_config.json"
    else:
        path = tmp_path / "empty"
        path.write_bytes(b"")
        why = "neither a GGUF file nor a readable safetensors file"
    res = _run("inspect", path)
    assert res.returncode == 2 and res.stdout == ""
    err = res.stderr.splitlines()
    assert len(err) == 1, res.stderr
    assert str(path) in err[0] and "not a LoRA adapter" in err[0] and why in err[0], err[0]
    assert "adapter_config.json: missing" not in err[0]


@pytest.mark.parametrize("args", [[], ["inspect"], ["bogus"],
                                  ["inspect", str(PEFT_DIR), "--dtype", "int8"],
                                  ["inspect", str(PEFT_DIR), "--scale", "nan"]])
def test_bad_arguments_exit_2_with_one_line(args):
    res = _run(*args)
    assert res.returncode == 2
    assert len(res.stderr.splitlines()) == 1, res.stderr


def test_info_prints_kernel_info():
    res = _run("info")
    assert res.returncode == 0, res.stderr
    info = lora.kernel_info()
    lines = res.stdout.splitlines()
    # kernel_info() one key per line, then the vLLM plug-in's two (tests/test_vllm_plugin.py)
    assert [l.split(":", 1)[0] for l in lines] == list(info) + ["vllm", "vllm plug-in"]
    got = dict(l.split(": ", 1) for l in lines)
    assert got["isa"] == info["isa"]
    assert got["available_isas"].split(", ") == list(info["available_isas"])
    assert got["isa_reason"].startswith(("flags: ", "table: "))  # a fresh process: not forced
    assert got["cpu"] == ", ".join(f"{k} {v}" for k, v in info["cpu"].items())
    assert got["cpu"].startswith("vendor ")


def test_import_and_info_load_no_file_format_library():
    """`import lora` and `python -m lora info` read no adapter file, so the loader side imports
    gguf, safetensors and ml_dtypes only on first use, inside the loading functions."""
    code = ("import sys, lora, lora.__main__ as cli\n"
            "cli.main(['info'], out=open('/dev/null', 'w'))\n"
            "print([m for m in ('gguf', 'safetensors') if m in sys.modules])\n"
            "print([n for n in ('lora.loaders.adapter', 'lora.loaders.peft', 'lora.loaders.gguf', 'lora.__main__')\n"
            "       if {'ml_dtypes', 'gguf', 'safetensors'} & set(vars(sys.modules[n]))])\n")
    res = _python("-c", code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["[]", "[]"]


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_a_reader_that_stops_early_is_not_an_error(unbuffered):
    """`python -m lora inspect PATH | head -1`: the reader has gone away (here: a pipe whose read
    end is closed before the command starts, so every write fails); nothing on stderr, exit 0
    (a closed stdout is the reader's choice, not a failure), whether stdout writes at once or
    at the end."""
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    env["PYTHONPATH"] = os.pathsep.join([str(LORA_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "lora", "inspect", str(PEFT_DIR)],
                              stdout=write_end, stderr=subprocess.PIPE, env=env, timeout=120)
    finally:
        os.close(write_end)
    assert proc.stderr.decode() == "" and proc.returncode == 0


@pytest.fixture(scope="module")
def dora_files(tmp_path_factory):
    """A DoRA adapter saved by PEFT from a Llama built from a config (q/v projections and the
    embedding), its magnitudes moved off their initial norms, and the base model saved by
    transformers; with each target's magnitude and its norm |W + s B A| (float64, from the
    model's own tensors)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("dora")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)
    base = transformers.LlamaForCausalLM(cfg).eval()
    base.save_pretrained(str(root / "base"))
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, use_dora=True, init_lora_weights=False,
        target_modules=["q_proj", "v_proj", "embed_tokens"]))
    want = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            if not hasattr(m, "lora_magnitude_vector") or "default" not in m.lora_magnitude_vector:
                continue
            mag = m.lora_magnitude_vector["default"].weight
            mag.mul_(torch.rand(mag.shape) + 0.5)
            s = m.scaling["default"]
            w = m.get_base_layer().weight.double()
            if "default" in m.lora_embedding_A:   # [vocab, dim]: the norm of each column
                delta = (m.lora_embedding_B["default"] @ m.lora_embedding_A["default"]).T
                norm = (w + s * delta.double()).norm(dim=0)
            else:
                delta = m.lora_B["default"].weight @ m.lora_A["default"].weight
                norm = (w + s * delta.double()).norm(dim=1)
            want[name.removeprefix("base_model.model.")] = (mag.numpy().copy(), norm.numpy())
    model.save_pretrained(str(root / "adapter"))
    return root / "adapter", root / "base", want


def _span(v):
    return f"{float(v.min()):.4g}..{float(v.max()):.4g}"


@pytest.mark.model
def test_inspect_dora_shows_every_column_without_a_base(dora_files):
    adapter, _, want = dora_files
    res = _run("inspect", adapter)
    assert res.returncode == 0, res.stderr
    title = res.stdout.splitlines()[0]
    assert title.startswith("adapter: PEFT DoRA adapter, 3 targets, alpha 8, scale 1, dtype "
                            "float32") and "--base" in title
    assert res.stdout.splitlines()[1].split() == ["target", "rows", "x", "cols", "rank", "alpha",
                                                  "eff.scale", "dtype", "bytes", "magnitude"]
    lines = _target_lines(res.stdout, want)
    total = 0
    for name, line in lines.items():
        mag = want[name][0]
        rows, cols = (96, 32) if "embed" in name else (mag.size, 32)
        size = 4 * (rows + cols) * 4 + mag.size * 4      # the pair and the magnitude, float32
        total += size
        assert line.split() == [name, str(rows), "x", str(cols), "4", "8", "2", "float32",
                                str(size), f"[{mag.size}]", _span(mag)]
    assert f"{total} bytes" in res.stdout.splitlines()[-1]


@pytest.mark.model
@pytest.mark.parametrize("form", ["directory", "safetensors"])
def test_inspect_dora_with_base_shows_the_norms(dora_files, form):
    adapter, base, want = dora_files
    res = _run("inspect", adapter, "--base", base if form == "directory"
               else base / "model.safetensors")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[1].split()[-2:] == ["magnitude", "norm"]
    for name, line in _target_lines(res.stdout, want).items():
        mag, norm = want[name]
        cells = line.split()
        assert cells[-3:] == [f"[{mag.size}]", _span(mag), _span(norm)], name
        assert _span(mag) != _span(norm)               # the norm is not the magnitude again


@pytest.mark.model
@pytest.mark.parametrize("case", ["missing", "not_safetensors", "wrong_model"])
def test_inspect_dora_with_a_bad_base_exits_2_with_one_line(dora_files, tmp_path, case):
    adapter, _, _ = dora_files
    if case == "missing":
        base, why = tmp_path / "nothing_here", "no such file"
    elif case == "not_safetensors":
        base, why = tmp_path / "model.safetensors", "not a readable safetensors file"
        base.write_bytes(b"not a safetensors file")
    else:
        from safetensors.numpy import save_file

        base, why = tmp_path / "other.safetensors", "no weight for DoRA module"
        save_file({"model.layers.0.mlp.up_proj.weight": np.ones((4, 4), np.float32)}, str(base))
    res = _run("inspect", adapter, "--base", base)
    assert res.returncode == 2 and res.stdout == ""
    err = res.stderr.splitlines()
    assert len(err) == 1 and why in err[0] and str(base) in err[0], res.stderr


def test_inspect_a_plain_adapter_with_base_warns_that_it_is_unused(tmp_path):
    res = _run("inspect", PEFT_DIR, "--base", PEFT_DIR)
    assert res.returncode == 0, res.stderr
    assert "--base is not used" in res.stderr and "LoRA adapter" in res.stdout.splitlines()[0]
