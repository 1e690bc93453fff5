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
from concurrent.futures import ThreadPoolExecutor

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
    """Compile an extension's C files on `jobs` threads, the largest first (the AVX-512 kernel
    file takes most of a build; one compiler per core halves the build on two cores).  The
    files and flags are distutils' own (its _setup_compile / _compile, as CCompiler.compile
    loops over them); a compiler class without them keeps compiling one file at a time."""
    if jobs < 2 or not all(hasattr(compiler, n) for n in ("_setup_compile", "_get_cc_args", "_compile")):
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
            for _ in pool.map(one, todo):  # re-raises the first CompileError
                pass
        return objects

    compiler.compile = compile


class BuildExt(build_ext):
    def build_extensions(self):
        # LORA_BUILD_JOBS=1 compiles one file at a time; by default one compiler per usable core
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        jobs = int(os.environ.get("LORA_BUILD_JOBS") or cores)
        _compile_in_parallel(self.compiler, min(jobs, 8))
        super().build_extensions()


setup(cffi_modules=["_cffi_build.py:ffibuilder"], ext_modules=[edge], cmdclass={"build_ext": BuildExt},
      options={"bdist_wheel": {"py_limited_api": "cp39"}})
