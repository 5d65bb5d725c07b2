"""benchmarks/head_goals.py's report: each goal reads the right run, mode and suite, and a
missing run reads as not run (not as met)."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "head_goals.py"


@pytest.fixture(scope="module")
def head_goals():
    spec = importlib.util.spec_from_file_location("head_goals", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(out: Path, name: str, modes: dict[str, dict[str, tuple[float, float]]]) -> None:
    """modes: mode -> key -> (MT-bench value, HumanEval value)."""
    suites = {}
    for i, suite in enumerate(("mt_bench", "humaneval")):
        suites[suite] = {"modes": {m: {k: v[i] for k, v in keys.items()}
                                   for m, keys in modes.items()}}
    (out / name).mkdir(parents=True)
    (out / name / "results.json").write_text(json.dumps(
        {"suites": suites, "lossless": True, "machine": {"cpu_count": 2}}))


def test_report_reads_each_goal_from_its_run(tmp_path, head_goals, capsys):
    _write(tmp_path, "tree26-lookup-40", {"eagle2": {"tau": (3.6, 4.4)},
                                          "static": {"tau": (2.5, 2.5)}})
    _write(tmp_path, "tree26-lookup5-40", {"eagle2": {"tau": (3.25, 3.4)}})
    _write(tmp_path, "tree26-alone-40", {"eagle2": {"tau": (2.6, 2.7)}})
    _write(tmp_path, "full", {"vanilla": {"tau": (1.0, 1.0), "speedup": (1.0, 1.0)},
                              "eagle2": {"tau": (2.6, 3.2), "speedup": (2.1, 2.4)}})
    _write(tmp_path, "t1-default-40", {"eagle2": {"tau": (1.3, 1.7)}})
    _write(tmp_path, "t1-tree60-lookup-40", {"eagle2": {"tau": (1.8, 2.1)}})
    table = head_goals.report(tmp_path)
    goals = {g["goal"]: g for g in table["goals"]}
    tree = goals["T = 0, 26-token tree, lookup 5: tau"]
    assert tree["figure"] == [3.25, 3.4] and tree["met"] is False  # HumanEval needs 3.5
    assert tree["head alone"] == [2.6, 2.7] and tree["lookup 16"] == [3.6, 4.4]
    ratio = goals["T = 0, 26 tokens: dynamic (lookup 5) / static tau"]
    assert ratio["figure"] == [1.3, 1.36] and ratio["met"] is True
    assert ratio["head alone / static"] == [1.04, 1.08]
    assert goals["T = 0, default tree: tau"]["met"] is True
    t1 = goals["T = 1: tau, best tree"]
    assert t1["figure"] == [1.8, 2.1] and t1["met"] is False  # the best of the runs there
    assert t1["26-token, head alone"] is None
    speed = goals["T = 0, batch 1: eagle2 / plain tokens/s"]
    assert speed["figure"] == [2.1, 2.4] and speed["met"] is True and speed["lossless"] is True
    hf = goals["T = 0, batch 1: eagle2 / HF generate tokens/s"]
    assert hf["figure"] is None and hf["met"] is None
    assert "not run" in capsys.readouterr().out
    assert set(table["runs"]) == {"tree26-lookup-40", "tree26-lookup5-40", "tree26-alone-40",
                                  "full", "t1-default-40", "t1-tree60-lookup-40"}


def test_kept_runs_give_the_kept_report(head_goals):
    """benchmarks/results keeps the current release's runs (one NAME.json a run) beside their
    report: the report read again from those runs is the kept one, figure for figure."""
    results = SCRIPT.parent / "results"
    kept = json.loads((results / "head-goals-xeon-amx-s37.json").read_text())
    assert head_goals.report(results / "head-goals-xeon-amx-s37") == kept
    assert all(g["figure"] is not None for g in kept["goals"])
