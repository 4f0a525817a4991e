"""Every Python block in README.md and docs/*.md runs, and prints what its
page says (issue 40).

How a block declares where and whether it runs: `tests/docs_blocks.py`
(an HTML comment before the fence). Each block runs once, in the process its
comment names (tf_keras for tfmot blocks, keras3 for `import keras` ones) or,
flavour-neutral, the one its place on its page picks (the two sides of
`make test` share the cost). Each pytest process starts one interpreter that
runs its blocks in order, each in a fresh namespace (or, marked `continues`,
in the one its page's previous block left), Keras's global state reset
between blocks. TensorFlow's import is paid once per process, so the cost is
the blocks' own: keep them small (`DOCS_TIMINGS=file.json` writes each
block's seconds).

A `print(...)` line with a trailing comment shows its output: the comment is
a claim about what it prints, and `tests/docs_expected.py` holds the check
of each such line (numbers within a stated tolerance, text, or "varies" when
the page says so). A print line with a comment and no check, or a check
whose line is gone from its page, fails `test_every_shown_output_is_checked`.
"""

import ast
import importlib
import inspect
import json
import os
import pathlib
import subprocess
import sys

import docs_blocks
import docs_expected
import pytest

BLOCKS = list(docs_blocks.blocks())
RUN = [b for b in BLOCKS if b.runs]


def _process():
    return "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") in ("1", "true", "True") else "keras3"


# One interpreter runs its process's blocks in order. Each block's `print`
# is recorded with the line it was called from (the innermost frame in the
# block's own code), so each check reads the output of its own line.
_RUNNER = r"""
import builtins, json, sys, time, traceback
blocks = json.loads(sys.stdin.read())
namespace = None
for name, code, continues, next_continues in blocks:
    printed = []
    def recorder(*args, sep=" ", end="\n", file=None, flush=False, _name=name, _out=printed):
        if file is None:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename != _name:
                frame = frame.f_back
            _out.append([frame.f_lineno if frame is not None else None,
                         sep.join(str(a) for a in args)])
        builtins.print(*args, sep=sep, end=end, file=file, flush=flush)
    if not continues or namespace is None:
        namespace = {"__name__": "__main__"}
    import tensorflow as tf
    namespace["print"] = tf.autograph.experimental.do_not_convert(recorder)
    start = time.perf_counter()
    try:
        exec(compile(code, name, "exec"), namespace)
        result = None
    except BaseException:  # noqa: BLE001 - reported to the test
        result = traceback.format_exc()[-3000:]
    if not next_continues:
        tf.keras.mixed_precision.set_global_policy("float32")
        import inspect   # Keras 3's clear_session without its full gc.collect()
        clear = tf.keras.backend.clear_session
        clear(**({"free_memory": False} if "free_memory" in inspect.signature(clear).parameters
                 else {}))
    sys.stdout.flush()
    builtins.print("@@DOCS@@" + json.dumps([name, result, printed, time.perf_counter() - start]),
                   flush=True)
"""


@pytest.fixture(scope="module")
def docs_run():
    """``{block id: (error or None, [[line, printed text], ...])}`` of the
    blocks of this process, run together once; and the runner's stderr."""
    mine = [b for b in RUN if b.process == _process()]
    mine = [[b.id, b.code, "continues" in b.words,
             i + 1 < len(mine) and "continues" in mine[i + 1].words] for i, b in enumerate(mine)]
    if not mine:
        return {}, ""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(docs_blocks.ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, "-c", _RUNNER], env=env, cwd=docs_blocks.ROOT,
                         input=json.dumps(mine), capture_output=True, text=True, timeout=900)
    results, timings = {}, {}
    for line in out.stdout.splitlines():
        if line.startswith("@@DOCS@@"):
            name, error, printed, seconds = json.loads(line[len("@@DOCS@@"):])
            results[name] = (error, printed)
            timings[name] = seconds
    if os.environ.get("DOCS_TIMINGS"):  # where to write each block's seconds (JSON)
        pathlib.Path(os.environ["DOCS_TIMINGS"]).write_text(json.dumps(timings, indent=1))
    return results, out.stderr[-3000:]


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_doc_block_runs_and_prints_what_its_page_says(block, docs_run):
    if block.process != _process():
        pytest.skip(f"runs once, in the {block.process} process")
    results, stderr = docs_run
    assert block.id in results, f"the docs runner stopped before {block.id}: {stderr}"
    error, printed = results[block.id]
    assert error is None, f"{block.id} (line {block.line} of {block.page}) failed:\n{error}"
    for first, last, text, _ in docs_blocks.print_statements(block.code):
        expect = docs_expected.EXPECT.get((block.page, text))
        if expect is None:
            continue
        outputs = [out for line, out in printed if line is not None and first <= line <= last]
        assert outputs, f"{block.id}: `{text}` printed nothing"
        expect.check_all(outputs, f"{block.id}: `{text}`")


def test_every_shown_output_is_checked():
    """Each print line whose comment shows its output has a check, and each
    check still has its line (a page edit must update both)."""
    missing, lines = [], set()
    for block in RUN:
        for _, _, text, shown in docs_blocks.print_statements(block.code):
            lines.add((block.page, text))
            if shown and (block.page, text) not in docs_expected.EXPECT:
                missing.append(f"{block.id}: {text}")
    assert not missing, ("print lines whose comment shows an output, with no check in "
                         "tests/docs_expected.py:\n" + "\n".join(missing))
    stale = [key for key in docs_expected.EXPECT if key not in lines]
    assert not stale, f"checks in tests/docs_expected.py whose line is gone: {stale}"


def test_varying_outputs_say_so_on_the_page():
    """A check that accepts any number is allowed only where the page says
    the output varies."""
    notes = {(b.page, text): note for b in RUN
             for _, _, text, note in docs_blocks.print_statements(b.code)}
    for key, expect in docs_expected.EXPECT.items():
        if isinstance(expect, docs_expected.Varies):
            assert "varies" in notes.get(key, ""), (
                f"{key}: checked as varying, but its comment does not say so")


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_marker_is_valid(block):
    assert not docs_blocks.marker_problems(block), (block.id, docs_blocks.marker_problems(block))
    if "continues" in block.words:
        previous = [b for b in BLOCKS if b.page == block.page and b.index == block.index - 1]
        assert previous and previous[0].runs and previous[0].process == block.process, (
            f"{block.id} continues the page's previous block, which must run in its process")


def _resolve(path):
    module, _, rest = path.partition(".")
    obj = importlib.import_module(module)
    for part in rest.split(".") if rest else ():
        obj = getattr(obj, part)
    return obj


def _literal(node):
    try:
        return True, ast.literal_eval(node)
    except ValueError:
        return False, None


SIGNATURES = [b for b in BLOCKS if "signature" in b.words]


@pytest.mark.parametrize("block", SIGNATURES, ids=[b.id for b in SIGNATURES])
def test_signature_block_matches_inspect_signature(block):
    """Each call in a signature block binds to the real signature, with the
    parameter names it shows in their order and the defaults it shows."""
    target = _resolve(block.argument("signature"))
    checked = 0
    for node in ast.walk(ast.parse(block.code)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and not isinstance(
                getattr(node, "ctx", None), ast.Store):
            assert hasattr(target, node.attr), f"{block.id}: {target.__name__} has no `{node.attr}`"
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id == target.__name__:
            fn, shown = target, target.__name__
        elif isinstance(node.func, ast.Attribute):
            fn, shown = getattr(target, node.func.attr), node.func.attr
        else:
            continue
        signature = inspect.signature(fn)
        params = [p for p in signature.parameters.values() if p.name != "self"]
        for i, arg in enumerate(node.args):
            assert isinstance(arg, ast.Name) and i < len(params) and arg.id == params[i].name, (
                f"{block.id}: `{shown}` argument {i} is shown as {ast.unparse(arg)}; "
                f"the signature is {signature}")
        named = {p.name: p for p in params}
        for keyword in node.keywords:
            if keyword.arg is None:   # **kwargs
                assert any(p.kind is p.VAR_KEYWORD for p in params), (
                    f"{block.id}: `{shown}` shows **{ast.unparse(keyword.value)}; the signature is {signature}")
                continue
            assert keyword.arg in named, f"{block.id}: `{shown}` has no `{keyword.arg}`: {signature}"
            is_literal, value = _literal(keyword.value)
            if is_literal:
                assert named[keyword.arg].default == value, (
                    f"{block.id}: `{shown}` shows {keyword.arg}={value!r}; the signature is {signature}")
        checked += 1
    assert checked, f"{block.id}: no call of {block.argument('signature')} or its methods"


EXCERPTS = [b for b in BLOCKS if "excerpt" in b.words]


@pytest.mark.parametrize("block", EXCERPTS, ids=[b.id for b in EXCERPTS])
def test_excerpt_block_is_in_its_example(block):
    """An excerpt that cannot run here (it needs TF_CONFIG) shows lines of an
    example that `make test` runs."""
    name = block.argument("excerpt")
    source = docs_blocks.ROOT / name
    assert source.is_file(), f"{block.id}: no {name}"
    example_lines = set(docs_blocks.code_lines(source.read_text()))
    for code in docs_blocks.code_lines(block.code):
        assert not code or code in example_lines, f"{block.id}: `{code}` is not a line of {name}"
    makefile = (docs_blocks.ROOT / "Makefile").read_text()
    assert pathlib.Path(name).stem in makefile, f"{name} is not run by `make test`"
