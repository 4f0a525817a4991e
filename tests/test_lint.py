"""`ruff check` passes on the whole tree, with pyproject.toml's rules.

The rules are F, E9 and the ones the code's ``# noqa:`` markers cite; RUF100
flags a marker that no selected rule needs (pyproject.toml says which cited
rules are not selected, and why). Skipped, saying so, where ruff is not
installed (it is in the ``test`` extra: ``pip install -e ".[test]"``).
"""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.keras_free

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff():
    """The ruff command: the one installed beside this Python, else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "ruff")
    if os.path.exists(beside):
        return [beside]
    found = shutil.which("ruff")
    return [found] if found else None


def test_ruff_passes_on_the_tree():
    command = _ruff()
    if command is None:
        pytest.skip("ruff is not installed (pip install ruff, or the test extra)")
    result = subprocess.run(command + ["check", "--no-cache", "--output-format", "concise",
                                       ROOT], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_can_fail(tmp_path):
    """The same command finds a violation of a selected rule (so a passing
    tree is not a ruff that checked nothing)."""
    command = _ruff()
    if command is None:
        pytest.skip("ruff is not installed (pip install ruff, or the test extra)")
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import os\n    return os.sep\n")
    result = subprocess.run(command + ["check", "--no-cache", "--config",
                                       os.path.join(ROOT, "pyproject.toml"), str(bad)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "PLC0415" in result.stdout, result.stdout
