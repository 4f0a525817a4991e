"""The benchmarks' plots: matplotlib on its file backend, saved into docs/."""

import os

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (saying so) when
    matplotlib is not installed (``pip install -e ".[bench]"``)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, name, dpi=100):
    """Writes ``fig`` to docs/``name`` and says where."""
    path = os.path.join(DOCS, name)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    print(f"wrote {path}")
