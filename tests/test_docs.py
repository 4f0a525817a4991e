"""Every complete Python example in docs/ runs.

A block counts as a complete example when it imports something; signature
sketches (no import) are skipped. Each block runs once: blocks that pin
tf_keras themselves (the tfmot examples) in the tf_keras process, the others
in the Keras 3 process.
"""

import json
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


# Runs blocks one after another in one interpreter, each in a fresh namespace,
# resetting Keras's global state between them (TensorFlow's import is most of
# a small block's time). Prints one JSON line per block.
_RUNNER = r"""
import json, sys, traceback
blocks = json.loads(sys.stdin.read())
for name, code in blocks:
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
        result = None
    except BaseException:  # noqa: BLE001 - reported to the test
        result = traceback.format_exc()[-3000:]
    import tensorflow as tf
    tf.keras.mixed_precision.set_global_policy("float32")
    tf.keras.backend.clear_session()
    print("@@DOCS@@" + json.dumps([name, result]), flush=True)
"""


def _pins_tf_keras(code):
    return 'os.environ["TF_USE_LEGACY_KERAS"] = "1"' in code


def _run_together(pinned, env):
    """Results of the blocks that pin tf_keras (``pinned``) or of the others,
    run together once in one interpreter."""
    blocks = [(p.id, p.values[0]) for p in _examples()
              if _pins_tf_keras(p.values[0]) == pinned]
    out = subprocess.run([sys.executable, "-c", _RUNNER], env=env,
                         input=json.dumps(blocks), capture_output=True, text=True,
                         timeout=1800)
    results = {}
    for line in out.stdout.splitlines():
        if line.startswith("@@DOCS@@"):
            name, error = json.loads(line[len("@@DOCS@@"):])
            results[name] = error
    return results, out.stderr[-3000:]


@pytest.fixture(scope="module")
def shared_run():
    """The flavour-neutral blocks, in a Keras 3 process."""
    return _run_together(False, dict(os.environ))


@pytest.fixture(scope="module")
def tfmot_run():
    """The blocks that pin tf_keras (the tfmot ones), in a tf_keras process:
    one tensorflow and tfmot import for all of them."""
    return _run_together(True, dict(os.environ, TF_USE_LEGACY_KERAS="1"))


@pytest.mark.parametrize("code", list(_examples()))
def test_doc_example_runs(code, request):
    # Each block runs once: the tfmot ones (which pin tf_keras themselves, so
    # need an interpreter pinned to tf_keras, shared among them) in the
    # tf_keras process, the others in the Keras 3 one. Their features are
    # tested under both flavours by the suite; here we check that the docs run.
    if _pins_tf_keras(code) != _legacy_process():
        pytest.skip("runs once, in the other flavour's process")
    results, stderr = request.getfixturevalue(
        "tfmot_run" if _pins_tf_keras(code) else "shared_run")
    name = request.node.callspec.id
    assert name in results, f"the docs runner stopped before {name}: {stderr}"
    assert results[name] is None, results[name]
