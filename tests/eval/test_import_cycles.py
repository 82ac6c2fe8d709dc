"""The import graph of eval/ (kvquant.eval) has no circles (issue 19 item 6). The circles it had: runner <->
retrieval (retrieval took eleven private names of runner), serve <-> wandb_logger, measure <-> schemes (the
fake mode's cache now lives in `fakequant`, below both) and lm_eval_cli <-> lm_eval_model (the argument checks
now live in `lm_eval_args`, below both; the command line imports the model, never the other way). Read from
the source with ast (tests/import_graph.py), so that an import inside a function counts as much as one at
the top of a module."""

from __future__ import annotations

from pathlib import Path

from import_graph import cycles, edges_within, import_edges, import_graph  # tests/import_graph.py

EVAL = Path(__file__).resolve().parents[2] / "eval"
PACKAGE = "kvquant.eval"
# the modules of the run harness and its tasks (issue 19 item 6)
HARNESS = ("harness", "runner", "retrieval", "serve", "results", "recommend", "wandb_logger", "config")


def test_the_cycle_finder_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b"], ["c", "d"]]


def test_the_graph_sees_relative_lazy_and_absolute_imports():
    g = import_graph(EVAL, PACKAGE)
    assert "harness" in g["runner"]  # from . import harness
    assert "results" in g["serve"]  # from .results import ...
    assert "retrieval" in g["runner"]  # inside run(): from .retrieval import run_retrieval
    assert "runner" in g["recommend"]  # inside recommend(): from .runner import run
    assert "lm_eval_model" in g["lm_eval_cli"]  # inside cli(): import kvquant.eval.lm_eval_model
    assert "fakequant" in g["schemes"]  # inside make_cache(): from .fakequant import FakeQuantCache


def test_the_pieces_both_sides_shared_live_below_them():
    g = import_graph(EVAL, PACKAGE)
    assert {"fakequant"} <= g["measure"] and "measure" not in g["schemes"]
    assert "lm_eval_args" in g["lm_eval_model"] and "lm_eval_cli" not in g["lm_eval_model"]
    assert g["fakequant"] == set() and g["lm_eval_args"] <= {"config"}


def test_no_harness_module_is_in_an_import_cycle():
    g = import_graph(EVAL, PACKAGE)
    found = [c for c in cycles(g) if set(c) & set(HARNESS)]
    assert not found, f"import cycles through the run harness: {found}"
    assert "runner" not in g["retrieval"], "retrieval must take what it shares with runner from harness"


def test_eval_has_no_import_cycles():
    edges = import_edges(EVAL, PACKAGE)
    found = cycles(import_graph(EVAL, PACKAGE))
    assert found == [], "import cycles in eval/: " + "; ".join(
        f"{c}: {', '.join(edges_within(edges, c))}" for c in found
    )
