"""Every complete Python example in docs/ runs, under the process's flavour.

A block counts as a complete example when it imports something; signature
sketches (no import) are skipped.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _examples():
    for path in sorted(DOCS.glob("*.md")):
        for i, code in enumerate(BLOCK.findall(path.read_text())):
            if re.search(r"^(import|from) ", code, re.M):
                yield pytest.param(code, id=f"{path.name}#{i}")


@pytest.mark.parametrize("code", list(_examples()))
def test_doc_example_runs(code):
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
