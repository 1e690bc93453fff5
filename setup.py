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

import numpy
from setuptools import Extension, setup

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

setup(cffi_modules=["_cffi_build.py:ffibuilder"], ext_modules=[edge],
      options={"bdist_wheel": {"py_limited_api": "cp39"}})
