"""setup.py's build helpers, without running a build: ``LORA_BUILD_JOBS`` is an integer >= 1 or
a clear refusal before anything compiles; the parallel compile takes over only a compiler class
that compiles through distutils' own loop (GCC, Clang), never one that replaces ``compile()``
(MSVC); it compiles every file, and the first file that fails raises its compiler error.

The helpers are read out of setup.py's source (setup.py runs ``setup()`` when imported)."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parent.parent / "setup.py"
if not SETUP.is_file():  # an installed-wheel run copies tests/ alone
    pytest.skip("setup.py is not beside these tests", allow_module_level=True)

ccompiler = pytest.importorskip("setuptools._distutils.ccompiler")


@pytest.fixture(scope="module")
def helpers():
    """setup.py's _compile_in_parallel and _build_jobs, with the imports they use."""
    tree = ast.parse(SETUP.read_text())
    wanted = {"_compile_in_parallel", "_build_jobs"}
    body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    assert {node.name for node in body} == wanted, "setup.py's build helpers were renamed"
    namespace = {}
    exec("import os\nfrom concurrent.futures import ThreadPoolExecutor, as_completed\n", namespace)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(SETUP), "exec"), namespace)
    return namespace


@pytest.mark.parametrize("text, jobs", [("3", 3), (" 1 ", 1), ("16", 16)])
def test_build_jobs_takes_an_integer(helpers, monkeypatch, text, jobs):
    monkeypatch.setenv("LORA_BUILD_JOBS", text)
    assert helpers["_build_jobs"]() == jobs


@pytest.mark.parametrize("text", ["abc", "0", "-2", "2.5"])
def test_build_jobs_refuses_anything_else_by_name(helpers, monkeypatch, text):
    monkeypatch.setenv("LORA_BUILD_JOBS", text)
    with pytest.raises(SystemExit) as exc:
        helpers["_build_jobs"]()
    assert str(exc.value) == f"LORA_BUILD_JOBS must be an integer >= 1 (compilers at once), got {text!r}"


def test_build_jobs_defaults_to_the_usable_cores(helpers, monkeypatch):
    monkeypatch.delenv("LORA_BUILD_JOBS", raising=False)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert helpers["_build_jobs"]() == min(cores or 1, 8)


def test_a_compiler_that_replaces_compile_is_left_alone(helpers):
    """MSVC's class overrides compile() itself: wrapping distutils' loop around it would build
    nothing, so the helper must not touch it (nor any compiler at one job)."""
    class OwnCompile(ccompiler.CCompiler):
        compiler_type = "own"
        executables = {}

        def compile(self, sources, **kwargs):
            return ["own"]

        def _compile(self, *args):
            raise AssertionError("never called")

    own = OwnCompile()
    helpers["_compile_in_parallel"](own, 4)
    assert "compile" not in vars(own) and own.compile([]) == ["own"]
    unix = ccompiler.new_compiler(compiler="unix")
    helpers["_compile_in_parallel"](unix, 1)
    assert "compile" not in vars(unix)
    try:  # distutils' own MSVC class, where this distutils has it (not instantiated off Windows)
        from setuptools._distutils._msvccompiler import MSVCCompiler
    except ImportError:
        return
    msvc = object.__new__(MSVCCompiler)
    helpers["_compile_in_parallel"](msvc, 4)
    assert "compile" not in vars(msvc)


@pytest.fixture
def unix_compiler(helpers):
    if sys.platform == "win32" or not shutil.which("cc"):
        pytest.skip("a Unix C compiler (cc) only")
    compiler = ccompiler.new_compiler(compiler="unix")
    from setuptools._distutils.sysconfig import customize_compiler
    customize_compiler(compiler)
    helpers["_compile_in_parallel"](compiler, 2)
    assert "compile" in vars(compiler)  # taken over: GCC and Clang compile through the loop
    return compiler


def test_the_parallel_compile_builds_every_file(unix_compiler, tmp_path):
    sources = []
    for i in range(5):
        src = tmp_path / f"f{i}.c"
        src.write_text("".join(f"int f{i}_{j}(int x) {{ return x + {j}; }}\n" for j in range(3 * i + 1)))
        sources.append(str(src))
    objects = unix_compiler.compile(sources, output_dir=str(tmp_path / "out"))
    assert len(objects) == 5 and all(Path(obj).is_file() for obj in objects)
    assert [Path(obj).stem for obj in objects] == [f"f{i}" for i in range(5)]  # the callers' order


def test_the_first_failing_file_raises_its_error(unix_compiler, tmp_path):
    from setuptools._distutils.errors import CompileError

    good = tmp_path / "good.c"
    good.write_text("int good(void) { return 1; }\n")
    bad = tmp_path / "bad.c"
    bad.write_text("int bad(void) { return undeclared_name; }\n")
    with pytest.raises(CompileError):
        unix_compiler.compile([str(good), str(bad)], output_dir=str(tmp_path / "out"))


def test_a_bad_build_jobs_stops_setup_before_anything_compiles(tmp_path):
    """The whole command, as a user types it: the refusal, and no object built."""
    env = dict(os.environ, LORA_BUILD_JOBS="many")
    done = subprocess.run([sys.executable, str(SETUP), "-q", "build_ext", "--build-temp", str(tmp_path / "t"),
                           "--build-lib", str(tmp_path / "l")], cwd=SETUP.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "LORA_BUILD_JOBS must be an integer >= 1 (compilers at once), got 'many'" in done.stderr
    assert not list(tmp_path.rglob("*.o")) and not list(tmp_path.rglob("*.so"))
