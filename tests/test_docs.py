"""Every complete Python example in docs/ runs.

A block counts as a complete example when it imports something; signature
sketches (no import) are skipped. Each block runs once: blocks that pin
tf_keras themselves (the tfmot examples) in the tf_keras process, the others
in the Keras 3 process.
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


def _legacy_process():
    return os.environ.get("TF_USE_LEGACY_KERAS") in ("1", "true", "True")


@pytest.mark.parametrize("code", list(_examples()))
def test_doc_example_runs(code):
    # Each block runs once: the tfmot ones (which pin tf_keras themselves) in
    # the tf_keras process, the others in the Keras 3 one. Their features are
    # tested under both flavours by the suite; here we check the docs run.
    pins_tf_keras = 'os.environ["TF_USE_LEGACY_KERAS"] = "1"' in code
    if pins_tf_keras != _legacy_process():
        pytest.skip("runs once, in the other flavour's process")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
