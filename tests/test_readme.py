"""The README's examples run as a user runs them: pasted into a fresh interpreter started in any
directory (here a temporary one), not only in the repository's root."""

import re
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, subprocess_env

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(section):
    """The ```python blocks of the README section headed `section`."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.S)


@pytest.mark.skipif(not README.is_file(), reason="the tests run outside a checkout")
@pytest.mark.parametrize("section", ["Ten lines", "Serving many adapters"])
def test_readme_example_runs_from_any_directory(tmp_path, section):
    blocks = python_blocks(section)
    assert blocks, f"no python example under '## {section}'"
    for code in blocks:
        res = subprocess.run([PYTHON, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                             env=subprocess_env(), timeout=300)
        assert res.returncode == 0, f"{section}:\n{code}\n{res.stderr}"
        assert "Warning" not in res.stderr, res.stderr
