"""cffi builder for lora-kernels (out-of-line API mode).

`csrc/lora.h` is the one truth for the C API: the part between its
LORA_CDEF markers is the cdef.  setup.py names `_cffi_build.py:ffibuilder` in
`cffi_modules`, so `pip install .`, `pip wheel .` and `python -m build` compile this.  (The
leading underscore keeps this module from shadowing PyPA's `build` package when a command runs
from the repository root.)

Build knobs (environment):
  CC=...                  the C compiler (gcc or clang; MSVC on Windows)
  LORA_DISABLE_OPENMP=1   build serial even where OpenMP works
  LORA_LIBOMP_PREFIX=...  macOS: where libomp lives, if not in Homebrew's usual places
  LORA_CFLAGS="..."       extra compile and link flags (the sanitizer CI stage)

OpenMP: `-fopenmp` when it links; on macOS, Apple clang with Homebrew's libomp;
otherwise (MSVC, macOS without libomp) a serial build that runs one thread.

Never tuned to the build machine (no -march flag): every ISA path is compiled into one extension with
per-file target pragmas and chosen at import from the CPU's feature bits.
"""

import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import warnings

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
# every ISA file is compiled everywhere; each one is empty where its
# LORA_HAVE_* macro (kernels.h) is not defined
SOURCES = ["isa.c", "team.c", "delta.c", "apply.c", "plan.c", "blocks.c", "experts.c", "dora.c",
           "merge.c", "bench.c", "kernels_scalar.c", "kernels_avx2.c", "kernels_avx512.c", "kernels_neon.c"]


def read_cdef():
    with open(os.path.join(HERE, "csrc", "lora.h")) as f:
        text = f.read()
    return text.split("/* LORA_CDEF_BEGIN */", 1)[1].split("/* LORA_CDEF_END */", 1)[0]


def _compiler():
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


_OMP_PROBE = ("#include <omp.h>\nint main(void){int n=0;\n#pragma omp parallel\n{n=omp_get_num_threads();}\n"
              "return n<1;}\n")


def _links(compile_args, link_args):
    """True when the OpenMP probe compiles and links with these flags."""
    with tempfile.TemporaryDirectory() as tmp:
        c_file = os.path.join(tmp, "probe.c")
        with open(c_file, "w") as f:
            f.write(_OMP_PROBE)
        cmd = _compiler() + compile_args + [c_file, "-o", os.path.join(tmp, "probe")] + link_args
        try:
            return subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


def _libomp_prefixes():
    """Where Homebrew's libomp may live (macOS clang has no OpenMP runtime of its own):
    LORA_LIBOMP_PREFIX, `brew --prefix libomp`, then Homebrew's default prefixes."""
    found = [os.environ.get("LORA_LIBOMP_PREFIX", "")]
    try:
        found.append(subprocess.run(["brew", "--prefix", "libomp"], capture_output=True, text=True,
                                    timeout=60).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    found += ["/opt/homebrew/opt/libomp", "/usr/local/opt/libomp"]
    return [p for p in found if p and os.path.exists(os.path.join(p, "include", "omp.h"))]


def openmp_flags():
    """(compile, link) flags for OpenMP: `-fopenmp` when a tiny OpenMP program compiles and
    links with it (GCC, Linux clang with libomp); on macOS, Apple clang with Homebrew's libomp
    (`-Xpreprocessor -fopenmp -lomp` and its include/lib paths); else ([], []) with a warning:
    the extension is built serial and runs one thread."""
    if os.environ.get("LORA_DISABLE_OPENMP", "") not in ("", "0"):
        return [], []
    if sys.platform == "win32":
        return [], []  # MSVC is best effort: the portable path, one thread
    candidates = [(["-fopenmp"], ["-fopenmp"])]
    if sys.platform == "darwin":
        for prefix in _libomp_prefixes():
            candidates.append((["-Xpreprocessor", "-fopenmp", "-I" + os.path.join(prefix, "include")],
                               ["-L" + os.path.join(prefix, "lib"), "-lomp"]))
    for compile_args, link_args in candidates:
        if _links(compile_args, link_args):
            return compile_args, link_args
    hint = " (on macOS: brew install libomp)" if sys.platform == "darwin" else ""
    warnings.warn("lora-kernels: the C compiler cannot build OpenMP code; building a serial "
                  "(one-thread) extension" + hint, RuntimeWarning)
    return [], []


def build_flags(openmp=True):
    """(compile, link) flags of an extension: the library's (OpenMP when it links) or, with
    ``openmp=False``, the same without OpenMP (setup.py's lora._edge, which runs no threads)."""
    if sys.platform == "win32":
        return ["/O2", "/fp:precise"], []
    omp_compile, omp_link = openmp_flags() if openmp else ([], [])
    extra = shlex.split(os.environ.get("LORA_CFLAGS", ""))
    # -ffp-contract=off: no multiply-add is fused unless a kernel says so, so
    # each path's summation order is the one its file header writes down.
    compile_args = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno", "-pthread"]
    # -ldl: dladdr/dlsym (team.c finds the OpenMP runtime's fork-time release); part of libc
    # from glibc 2.34, its own library before
    dl = ["-ldl"] if sys.platform.startswith("linux") else []
    return compile_args + omp_compile + extra, ["-pthread"] + omp_link + dl + extra


ffibuilder = FFI()
ffibuilder.cdef(read_cdef())
_cflags, _ldflags = build_flags()
ffibuilder.set_source(
    "lora._lora_cffi",
    '#include "lora.h"\n',
    sources=[os.path.join("csrc", name) for name in SOURCES],
    include_dirs=["csrc"],
    depends=[os.path.join("csrc", name) for name in sorted(os.listdir(os.path.join(HERE, "csrc")))
             if name.endswith(".h")],
    extra_compile_args=_cflags,
    extra_link_args=_ldflags,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
