# cffi's extension is declared here because pyproject.toml alone cannot carry
# `cffi_modules`; everything else lives in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["build.py:ffibuilder"])
