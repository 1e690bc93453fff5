# cffi's extension is declared here because pyproject.toml alone cannot carry
# `cffi_modules`; everything else lives in pyproject.toml.
#
# The extension uses only the stable ABI (cffi defines Py_LIMITED_API and names
# it _lora_cffi.abi3.so), so the wheel is tagged cp39-abi3: one wheel per
# platform serves CPython 3.9 and every later version.
from setuptools import setup

setup(cffi_modules=["_cffi_build.py:ffibuilder"], options={"bdist_wheel": {"py_limited_api": "cp39"}})
