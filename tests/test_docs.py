"""Every complete Python example in docs/ runs, under the process's flavour.

A block counts as a complete example when it imports something; signature
sketches (no import) are skipped. Blocks that pin tf_keras themselves (the
tfmot examples) run once, in the tf_keras process.
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
    if 'os.environ["TF_USE_LEGACY_KERAS"] = "1"' in code and os.environ.get(
            "TF_USE_LEGACY_KERAS") not in ("1", "true", "True"):
        pytest.skip("a tf_keras-only example (tfmot); runs in the tf_keras process")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
