"""The Python blocks of README.md and docs/*.md, as `tests/test_docs.py` runs
them (no TensorFlow here: parsing only).

A block is every fenced ```` ```python ```` block. An HTML comment on the line
right before the fence (invisible on the rendered page) says how it runs::

    <!-- docs: tf_keras -->      runs in the tf_keras process only (tfmot blocks;
                                 a block that sets TF_USE_LEGACY_KERAS=1 must say so)
    <!-- docs: keras3 -->        runs in the Keras 3 process only (`import keras`)
    <!-- docs: continues -->     runs in the namespace the page's previous block left
                                 (which the reader has just seen)
    <!-- docs: signature tf_gradkit.X -->
                                 not run: each call in it is checked against
                                 `inspect.signature` of tf_gradkit.X (or its method)
    <!-- docs: excerpt examples/Y.py -->
                                 not run here: each code line is a line of
                                 examples/Y.py, which `make test` runs

Words combine (`<!-- docs: tf_keras continues -->`). A block without a comment
is flavour-neutral and runs once: in the Keras 3 process when it is at an even
place among its page's Python blocks (0, 2, ...), in the tf_keras process at
an odd one (a `continues` block where the block it continues runs). So the
two sides of `make test`, which run side by side, share the cost, and each
flavour runs flavour-neutral blocks.
"""

import ast
import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(
    r"(?:<!--\s*docs:(?P<marker>[^>]*?)-->[ \t]*\n)?```python\n(?P<code>.*?)```", re.S)
FLAGS = ("tf_keras", "keras3", "continues")
WITH_ARGUMENT = ("signature", "excerpt")
PINS_TF_KERAS = 'os.environ["TF_USE_LEGACY_KERAS"] = "1"'


@dataclasses.dataclass
class Block:
    page: str        # "docs/x.md", relative to the repository
    index: int       # its place among the page's python blocks
    line: int        # the fence's line in the page
    code: str
    marker: str      # the comment's words, "" without one
    process: str = "keras3"   # "keras3" or "tf_keras": the pytest process whose runner runs it

    @property
    def id(self):
        return f"{self.page}#{self.index}"

    @property
    def words(self):
        return self.marker.split()

    def argument(self, word):
        words = self.words
        return words[words.index(word) + 1] if word in words[:-1] else None

    @property
    def runs(self):
        return not any(w in self.words for w in WITH_ARGUMENT)


def blocks():
    for path in PAGES:
        text = path.read_text()
        page = str(path.relative_to(ROOT))
        previous = None
        for i, match in enumerate(FENCE.finditer(text)):
            line = text[:match.start("code")].count("\n")
            block = Block(page, i, line, match.group("code"), (match.group("marker") or "").strip())
            if "tf_keras" in block.words:
                block.process = "tf_keras"
            elif "keras3" in block.words:
                block.process = "keras3"
            elif "continues" in block.words and previous is not None:
                block.process = previous.process
            else:
                block.process = "keras3" if i % 2 == 0 else "tf_keras"
            previous = block
            yield block


def marker_problems(block):
    """What is wrong with a block's comment (a list of sentences)."""
    problems = []
    words = block.words
    known = set(FLAGS) | set(WITH_ARGUMENT)
    skip = False
    for i, word in enumerate(words):
        if skip:
            skip = False
            continue
        if word in WITH_ARGUMENT:
            if i + 1 >= len(words):
                problems.append(f"`{word}` needs an argument")
            skip = True
        elif word not in known:
            problems.append(f"unknown word {word!r} (known: {sorted(known)})")
    if "tf_keras" in words and "keras3" in words:
        problems.append("a block runs in one process: tf_keras or keras3, not both")
    if block.runs and PINS_TF_KERAS in block.code and "tf_keras" not in words:
        problems.append("it sets TF_USE_LEGACY_KERAS=1: put `<!-- docs: tf_keras -->` before it")
    return problems


def _comment_tokens(code):
    import io  # noqa: PLC0415
    import tokenize  # noqa: PLC0415
    return [tok for tok in tokenize.generate_tokens(io.StringIO(code).readline)
            if tok.type == tokenize.COMMENT]


def comments(code):
    """``{line: comment}`` of a block (1-based lines, the text after ``#``)."""
    return {tok.start[0]: tok.string[1:].strip() for tok in _comment_tokens(code)}


def code_lines(code):
    """A block's lines without their comments, stripped."""
    lines = code.splitlines()
    for tok in _comment_tokens(code):
        row, col = tok.start
        lines[row - 1] = lines[row - 1][:col]
    return [line.strip() for line in lines]


def print_statements(code):
    """``[(first line, last line, the first line's text, the statement's
    comments joined)]`` of each ``print(...)`` statement in ``code``
    (1-based lines)."""
    lines = code.splitlines()
    notes = comments(code)
    found = []
    for node in ast.walk(ast.parse(code)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "print"):
            note = " ".join(notes[i] for i in range(node.lineno, node.end_lineno + 1) if i in notes)
            found.append((node.lineno, node.end_lineno, lines[node.lineno - 1].strip(), note))
    return sorted(found)
