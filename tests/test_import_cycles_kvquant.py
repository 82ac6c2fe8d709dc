"""The import graph of kvquant/ (the package, kvquant.paging, kvquant.codecs, kvquant.native) has no circles
(issue 19 item 6), read from the source with ast (tests/import_graph.py): an import inside a function counts,
a name taken through kvquant's lazy facade (`kvquant.QuantizedCache`) is an edge to the module defining it,
and importing `kvquant.codecs.base` is an edge to `kvquant.codecs` too (its __init__, the codec registry,
runs first). Imports under `if TYPE_CHECKING:` never run and do not count.

Circles broken here: native -> models (for `cache_root`, now `kvquant.paths`, below both) closed
models -> attention -> cache -> codecs -> native; calibration -> codecs.calibrot (the fitting driver, now
`kvquant.fitting`, above both) closed calibration <-> calibrot."""

from __future__ import annotations

from pathlib import Path

from import_graph import cycles, edges_within, import_edges  # tests/import_graph.py

import kvquant

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "kvquant"
# the installed package: kernels/ and eval/ install as kvquant.kernels and kvquant.eval (package-dir)
MOUNTS = {"kernels": REPO / "kernels", "eval": REPO / "eval"}
# edges that still close a circle, in files other work owns; each names the fix. Remove an edge once gone.
PENDING: set[tuple[str, str]] = set()  # edges to cut while a known circle waits for its fix: none


def _graph(mounts=None) -> tuple[dict, dict]:
    edges = import_edges(PACKAGE, "kvquant", kvquant._LAZY, mounts)
    return edges, {m: set(t) for m, t in edges.items()}


def _reach(g: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` depends on, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for m in g[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


def _message(edges: dict, found: list[list[str]]) -> str:
    return "; ".join(f"{c}: {', '.join(edges_within(edges, c))}" for c in found)


def test_the_graph_reads_lazy_imports_the_facade_and_parent_packages():
    _, g = _graph()
    assert "" not in g  # the facade is a table of names, no node
    assert "attention" in g["models"]  # inside load_model(): from .attention import ...
    assert "attention" in g["hf"]  # from . import ATTN_IMPLEMENTATION (the facade's table: attention)
    assert {"codecs", "codecs.base"} <= g["memory"]  # from .codecs.base import ...: the registry runs first
    assert "paging" not in g["paging.pool"]  # a module's own package is no edge
    assert "paging.store" not in g["paging.budget"]  # under `if TYPE_CHECKING:` only


def test_the_pieces_moved_down_and_up_stay_there():
    _, g = _graph()
    assert g["paths"] == set() and "paths" in g["native"] and "models" not in g["native"]
    below = _reach(g, "calibration")
    codecs = sorted(m for m in below if m.startswith("codecs"))
    assert not codecs, f"calibration (the file format the codecs read) reaches {codecs}"
    assert {"calibration", "rotfit"} <= g["fitting"]
    assert "fitting" not in set().union(*(g[m] for m in g if m != "fitting"))
    # the codecs never reach the attention function or the calibration fits (-crot's fit lives in rotfit)
    assert not {"attention", "rotfit", "fitting"} & _reach(g, "codecs"), sorted(_reach(g, "codecs"))
    assert "calibration" not in g["scheme"] and "calibfile" in g["scheme"]  # budget=B reads the JSON only


def test_no_circle_but_the_pending_ones():
    """Strict, over the installed package (kvquant/, kernels/, eval/): with the PENDING edges cut there is
    no circle, so a new one fails here at once."""
    edges, g = _graph(MOUNTS)
    for a, b in PENDING:
        g[a].discard(b)
    found = cycles(g)
    assert found == [], "import cycles: " + _message(edges, found)


def test_kvquant_has_no_import_cycles():
    edges, g = _graph()
    found = cycles(g)
    assert found == [], "import cycles in kvquant/: " + _message(edges, found)
