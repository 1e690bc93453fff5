"""What a user gets without the optional extras: ``import lora`` needs neither torch nor PEFT,
and ``accelerate_peft`` without them is an ``ImportError`` that says which extra to install
(run in a child interpreter in which the missing package cannot be imported)."""

import subprocess

import pytest

from conftest import PYTHON, subprocess_env

# a child interpreter where `missing` cannot be imported, calling accelerate_peft
CHILD = """
import sys
for name in {missing!r}:
    sys.modules[name] = None          # import name -> ImportError, as if it were not installed
import lora
try:
    lora.accelerate_peft(object())
except ImportError as exc:
    print(type(exc).__name__, "|", exc)
"""


@pytest.mark.parametrize("missing", [("torch",), ("peft",), ("torch", "peft")])
def test_accelerate_peft_without_the_extra_names_it(missing):
    res = subprocess.run([PYTHON, "-c", CHILD.format(missing=missing)], capture_output=True,
                         text=True, env=subprocess_env(), timeout=120)
    assert res.returncode == 0, res.stderr
    kind, _, message = res.stdout.strip().partition(" | ")
    assert kind == "ImportError", res.stdout          # not a bare ModuleNotFoundError
    assert 'pip install "lora-kernels[peft]"' in message and "accelerate_peft" in message
    assert missing[0] in message                       # which import failed
