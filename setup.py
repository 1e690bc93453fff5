# Two extensions:
# - lora._lora_cffi, the C library and its cffi bindings (_cffi_build.py; pyproject.toml alone
#   cannot carry `cffi_modules`);
# - lora._edge (csrc/python/edge.c), the one edge every apply method takes first: CPython
#   functions that read a NumPy array's or a torch tensor's facts in C and call lora_apply
#   through the pointer lora._lora_cffi hands over, and (csrc/python/edge_peft.h)
#   accelerate_peft's short path of a PEFT LoRA Linear layer; it includes only lora.h of the
#   library, and needs NumPy's headers to build, not to run.
#
# Both use only the stable ABI of CPython 3.9 (cffi defines Py_LIMITED_API; edge.c defines it
# itself), so the wheel is tagged cp39-abi3: one wheel per platform serves CPython 3.9 and
# every later version.
import os
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cffi_build import build_flags  # noqa: E402

_cflags, _ldflags = build_flags(openmp=False)
if sys.platform.startswith("linux"):
    # the module calls nothing in libc, so the linker's --as-needed would leave it without a
    # libc.so.6 (or musl) dependency, which auditwheel reads to tell a manylinux wheel from a
    # musllinux one
    _ldflags = _ldflags + ["-Wl,--no-as-needed", "-lc"]
edge = Extension(
    "lora._edge",
    sources=[os.path.join("csrc", "python", "edge.c")],
    include_dirs=["csrc", numpy.get_include()],
    depends=[os.path.join("csrc", "lora.h")]
    + [os.path.join("csrc", "python", name) for name in ("edge_facts.h", "edge_view.h", "edge_peft.h")],
    extra_compile_args=_cflags,
    extra_link_args=_ldflags,
    py_limited_api=True,
)


def _compile_in_parallel(compiler, jobs):
    """Compile an extension's C files on `jobs` threads, the largest first.  The AVX-512 kernel
    file alone is most of a build (about 37 of 42 s on two cores; 51 s one file at a time), so
    the others compile beside it.  Only for a compiler class that compiles through distutils'
    own loop (CCompiler.compile over _setup_compile / _compile, as GCC and Clang do); one that
    replaces compile() itself (MSVC) keeps it.  The first file that fails stops the files not
    yet started, and its error is raised."""
    from setuptools._distutils.ccompiler import CCompiler

    cls = type(compiler)
    if jobs < 2 or cls.compile is not CCompiler.compile or cls._compile is CCompiler._compile:
        return

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                extra_preargs=None, extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
        todo = sorted((obj for obj in objects if obj in build),
                      key=lambda obj: -os.path.getsize(build[obj][0]))

        def one(obj):
            src, ext = build[obj]
            compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(one, obj) for obj in todo]
            for done in as_completed(futures):
                if done.exception() is not None:
                    for f in futures:
                        f.cancel()
                    raise done.exception()
        return objects

    compiler.compile = compile


def _build_jobs():
    """LORA_BUILD_JOBS (an integer >= 1; 1: one file at a time), else one per usable core."""
    text = os.environ.get("LORA_BUILD_JOBS", "").strip()
    if not text:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return min(cores or 1, 8)
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise SystemExit(f"LORA_BUILD_JOBS must be an integer >= 1 (compilers at once), got {text!r}")
    return jobs


class BuildExt(build_ext):
    def build_extensions(self):
        _compile_in_parallel(self.compiler, _build_jobs())
        super().build_extensions()


setup(cffi_modules=["_cffi_build.py:ffibuilder"], ext_modules=[edge], cmdclass={"build_ext": BuildExt},
      options={"bdist_wheel": {"py_limited_api": "cp39"}})
