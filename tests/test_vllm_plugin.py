"""The vLLM plug-in's switches: the entry point, `register()` on vLLM's CPU platform, LORA_VLLM,
VLLM_PLUGINS, the supported range, ``python -m lora info``; and that ``import lora`` never
imports vLLM.  The tests that need vLLM skip without it; the import rules run everywhere."""

import subprocess
import sys
import warnings

import pytest

from lora import _vllm_plugin as plugin


def _run(code, **env):
    import os

    full = dict(os.environ)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, timeout=300)


def test_import_lora_imports_neither_vllm_nor_torch():
    proc = _run("import sys, lora; lora.kernel_info(); "
                "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_import_lora_vllm_without_vllm_says_what_to_install():
    proc = _run("import sys; sys.modules['vllm'] = None\nimport lora.vllm")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and "vllm-cpu" in last and "docs/vllm.md" in last


def test_version_range():
    assert plugin.parse_version("0.32.0+cpu") == (0, 32, 0)
    assert plugin.parse_version("0.32") == (0, 32, 0)
    assert plugin.parse_version("dev") is None
    assert plugin.in_range("0.32.0") and plugin.in_range("0.32.7")
    assert not plugin.in_range("0.31.9") and not plugin.in_range("0.33.0")
    assert not plugin.in_range("dev")


@pytest.mark.parametrize("env, off", [
    ({}, None),
    ({"LORA_VLLM": "0"}, "LORA_VLLM=0"),
    ({"LORA_VLLM": "1"}, None),
    ({"VLLM_PLUGINS": "lora_kernels"}, None),
    ({"VLLM_PLUGINS": "other, lora_kernels"}, None),
    ({"VLLM_PLUGINS": "other"}, "VLLM_PLUGINS"),
    ({"VLLM_PLUGINS": ""}, "VLLM_PLUGINS"),
])
def test_switches(env, off):
    why = plugin.disabled_by_env(env)
    assert (why is None) if off is None else (off in why)


def test_info_reports_vllm():
    proc = _run("import runpy, sys; sys.argv = ['lora', 'info']; "
                "runpy.run_module('lora', run_name='__main__')")
    assert proc.returncode == 0, proc.stderr
    lines = dict(ln.split(": ", 1) for ln in proc.stdout.splitlines() if ": " in ln)
    status = plugin.status()
    assert lines["vllm"] == status["vllm"] and lines["vllm plug-in"] == status["vllm plug-in"]
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert status["vllm"] == "not installed"
        assert status["vllm plug-in"].startswith("inactive")
        return
    assert status["vllm plug-in"].startswith("active")
    off = _run("import runpy, sys; sys.argv = ['lora', 'info']; "
               "runpy.run_module('lora', run_name='__main__')", LORA_VLLM="0")
    assert "vllm plug-in: inactive (LORA_VLLM=0)" in off.stdout


# ----------------------------------------------------------------- with vLLM
@pytest.fixture
def vllm_cpu():
    pytest.importorskip("vllm", reason="needs a CPU build of vLLM (docs/vllm.md)")
    from vllm.platforms import current_platform
    from vllm.platforms.cpu import CpuPlatform

    if not isinstance(current_platform, CpuPlatform):
        pytest.skip("vLLM's platform here is not its CPU platform")
    cls = type(current_platform)
    saved = {k: vars(cls)[k] for k in ("get_punica_wrapper",) if k in vars(cls)}
    yield current_platform
    for k in ("get_punica_wrapper",):
        if k in saved:
            setattr(cls, k, saved[k])
        elif k in vars(cls):
            delattr(cls, k)


@pytest.mark.vllm
def test_the_entry_point_is_installed():
    pytest.importorskip("vllm")
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "lora_kernels"]
    assert [ep.value for ep in eps] == ["lora.vllm:register"]
    assert eps[0].load().__module__ == "lora.vllm"


@pytest.mark.vllm
def test_register_on_the_cpu_platform(vllm_cpu, monkeypatch):
    import lora.vllm as lv

    monkeypatch.delenv("LORA_VLLM", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert vllm_cpu.get_punica_wrapper().endswith("PunicaWrapperCPU")
    assert lv.register() is True
    assert vllm_cpu.get_punica_wrapper() == "lora.vllm.PunicaWrapper"
    assert lv.register() is True          # vLLM may load plugins more than once

    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from vllm.lora.punica_wrapper.punica_selector import get_punica_wrapper

    w = get_punica_wrapper(64, max_batches=4, device="cpu")
    assert type(w) is lv.PunicaWrapper and isinstance(w, PunicaWrapperCPU)


@pytest.mark.vllm
@pytest.mark.parametrize("env", [{"LORA_VLLM": "0"}, {"VLLM_PLUGINS": "someone_else"}])
def test_switched_off_register_changes_nothing(vllm_cpu, monkeypatch, env):
    import lora.vllm as lv

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert lv.register() is False
    assert vllm_cpu.get_punica_wrapper().endswith("PunicaWrapperCPU")


@pytest.mark.vllm
def test_outside_the_supported_range_warns_and_changes_nothing(vllm_cpu, monkeypatch):
    import vllm

    import lora.vllm as lv

    monkeypatch.delenv("LORA_VLLM", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    lv._warned.discard("range")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert lv.register() is False
    assert any("0.40.1" in str(c.message) and "supported range" in str(c.message)
               for c in caught)
    assert vllm_cpu.get_punica_wrapper().endswith("PunicaWrapperCPU")


@pytest.mark.vllm
def test_methods_this_plugin_does_not_know_warn_and_run_vllms(monkeypatch):
    """Every public method of vLLM's CPU wrapper is served, knowingly left to vLLM, or wrapped
    to warn once (a method a newer vLLM adds)."""
    pytest.importorskip("vllm")
    import lora.vllm as lv
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    for name, m in vars(PunicaWrapperCPU).items():
        if callable(m) and not name.startswith("_"):
            assert name in lv._OURS or name in lv._VLLMS or \
                getattr(lv.PunicaWrapper, name).__qualname__.startswith("_unserved"), name
    calls = []
    wrapped = lv._unserved("future_op", lambda self, *a: calls.append(a) or "ok")
    lv._warned.discard(("method", "future_op"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert wrapped(object(), 1) == "ok" and wrapped(object(), 2) == "ok"
    assert calls == [(1,), (2,)]
    assert sum("future_op" in str(c.message) for c in caught) == 1


@pytest.mark.vllm
def test_register_never_raises_into_vllms_plugin_loader(vllm_cpu, monkeypatch):
    """vLLM's load_general_plugins does not catch what a plug-in raises: anything unexpected
    in register() is a warning and vLLM's own path, never a process that cannot start."""
    import lora.vllm as lv

    def broken(version):
        raise RuntimeError("something unexpected")

    monkeypatch.delenv("LORA_VLLM", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(lv, "in_range", broken)
    lv._warned.discard("register")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert lv.register() is False
    assert any("something unexpected" in str(c.message) for c in caught)
    assert vllm_cpu.get_punica_wrapper().endswith("PunicaWrapperCPU")
