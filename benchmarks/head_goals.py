"""The draft head's goals, measured at the README's settings (40 + 40 prompts x 256 tokens,
batch 1): each figure from its own `eagle2 bench` run, one process a run, then one table.

    .venv/bin/python benchmarks/head_goals.py run OUT [--draft DIR] [--only NAME,...]
    .venv/bin/python benchmarks/head_goals.py report OUT [--json FILE]

`run` writes OUT/NAME/results.json for each run below (skipping those already there, so an
interrupted run resumes); `report` reads them (or OUT/NAME.json), prints every goal with its
figure and whether it is met, and writes JSON. tau is deterministic for a fixed tree (greedy,
or seeded at T = 1), so those runs need not be alone on the machine; the `full` run's tokens/s
do (its ratio to plain decoding is what the 2.0x goal reads), nor does `hf` (plain decoding,
eagle2 and HF `generate` in one run, ~20 minutes; it runs only when named in --only).

The current release's runs are kept as benchmarks/results/head-goals-xeon-amx-s37/NAME.json
and their report as benchmarks/results/head-goals-xeon-amx-s37.json, which

    .venv/bin/python benchmarks/head_goals.py report benchmarks/results/head-goals-xeon-amx-s37 \
        --json benchmarks/results/head-goals-xeon-amx-s37.json

writes again byte for byte.

The 26-token tree is depth 5, top_k 8 (`--tree fixed`): "lookup 5" lets prompt lookup's and
the n-gram store's chains join its rerank no deeper than the head's depth (a tree of 26
tokens, depth 5); "lookup 16" is the engine's default chain length (chains may reach past
depth 5); "head alone" is `--lookup 0`. static is the EAGLE-1 tree of the same 26 tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

COMMON = ["--suite", "mt_bench,humaneval", "--num-prompts", "40", "--max-tokens", "256"]
TREE26 = ["--tree", "fixed", "--total-tokens", "26", "--depth", "5", "--tree-top-k", "8"]
T1 = ["--temperature", "1.0", "--seed", "0"]
RUNS: dict[str, list[str]] = {
    "full": ["--modes", "vanilla,eagle2"],
    "tree26-lookup-40": ["--modes", "eagle2,static", *TREE26, "--lookup", "16", "--threads", "2"],
    "tree26-lookup5-40": ["--modes", "eagle2", *TREE26, "--lookup", "5", "--threads", "2"],
    "tree26-alone-40": ["--modes", "eagle2", *TREE26, "--lookup", "0", "--threads", "2"],
    "t1-default-40": ["--modes", "eagle2", *T1, "--threads", "2"],
    "t1-tree26-lookup-40": ["--modes", "eagle2", *TREE26, "--lookup", "16", *T1,
                            "--threads", "2"],
    "t1-tree26-alone-40": ["--modes", "eagle2", *TREE26, "--lookup", "0", *T1,
                           "--threads", "2"],
    # the reference's default tree on a GPU (60 tokens, depth 6, top_k 10)
    "t1-tree60-lookup-40": ["--modes", "eagle2", "--tree", "fixed", "--total-tokens", "60",
                            "--depth", "6", "--tree-top-k", "10", "--lookup", "16", *T1,
                            "--threads", "2"],
    "hf": ["--modes", "vanilla,eagle2,hf"],
}
SUITES = ("mt_bench", "humaneval")
# the T = 1 goal reads the best of these trees
T1_TREES = {"default": "t1-default-40", "26-token, lookup 16": "t1-tree26-lookup-40",
            "26-token, head alone": "t1-tree26-alone-40",
            "60-token, lookup 16": "t1-tree60-lookup-40"}


def run(out: Path, draft: str | None, only: list[str] | None) -> None:
    names = only or [n for n in RUNS if n != "hf"]
    for name in names:
        if name not in RUNS:
            raise SystemExit(f"unknown run {name!r}; choose from {', '.join(RUNS)}")
        if (out / name / "results.json").exists():
            print(f"{name}: done already", flush=True)
            continue
        cmd = [sys.executable, "-m", "eagle2.cli", "bench", *COMMON, *RUNS[name],
               "--out", str(out / name), *(["--draft", draft] if draft else [])]
        print(" ".join(cmd), flush=True)
        with open(out / f"{name}.txt", "w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)


def _load(out: Path, name: str) -> dict | None:
    """A run's results: OUT/NAME/results.json as `run` writes it, or OUT/NAME.json as kept in
    benchmarks/results/ (one file a run)."""
    for path in (out / name / "results.json", out / f"{name}.json"):
        if path.exists():
            return json.loads(path.read_text())
    return None


def _mode(res: dict | None, mode: str, key: str) -> list[float] | None:
    """key of mode per suite (MT-bench, HumanEval), None where the run is missing."""
    if res is None:
        return None
    return [res["suites"][s]["modes"][mode][key] for s in SUITES]


def _ratio(a: list[float] | None, b: list[float] | None) -> list[float] | None:
    return None if a is None or b is None else [x / y for x, y in zip(a, b, strict=True)]


def report(out: Path) -> dict:
    res = {name: _load(out, name) for name in RUNS}
    tau = {name: _mode(r, "eagle2", "tau") for name, r in res.items()}
    static = _mode(res["tree26-lookup-40"], "static", "tau")
    full = res["full"]
    speedup = _mode(full, "eagle2", "speedup")
    lossless = None if full is None else full.get("lossless")
    hf = res["hf"]
    # (goal, the figure it reads per suite, its threshold per suite, what else to show)
    rows = [
        ("T = 0, 26-token tree, lookup 5: tau", tau["tree26-lookup5-40"], (3.0, 3.5),
         {"lookup 16": tau["tree26-lookup-40"], "head alone": tau["tree26-alone-40"]}),
        ("T = 0, 26 tokens: dynamic (lookup 5) / static tau", _ratio(tau["tree26-lookup5-40"],
                                                                    static), (1.15, 1.15),
         {"static tau": static, "head alone / static": _ratio(tau["tree26-alone-40"], static),
          "lookup 16 / static": _ratio(tau["tree26-lookup-40"], static)}),
        ("T = 0, default tree: tau", tau["full"], (2.4, 2.4), {}),
        ("T = 1: tau, best tree", _best([tau[n] for n in T1_TREES.values()]), (2.0, 2.0),
         {label: tau[n] for label, n in T1_TREES.items()}),
        ("T = 0, batch 1: eagle2 / plain tokens/s", speedup, (2.0, 2.0),
         {"lossless": lossless}),
        ("T = 0, batch 1: eagle2 / HF generate tokens/s",
         _ratio(_mode(hf, "eagle2", "tokens_per_s"), _mode(hf, "hf", "tokens_per_s")),
         (3.0, 3.0), {"eagle2 / plain in that run": _mode(hf, "eagle2", "speedup")}),
    ]
    goals = []
    for goal, figure, need, extra in rows:
        met = None if figure is None else all(f >= n for f, n in zip(figure, need, strict=True))
        goals.append({"goal": goal, "need": list(need), "figure": _round(figure), "met": met,
                      **{k: _round(v) for k, v in extra.items()}})
        shown = "not run" if figure is None else " / ".join(f"{f:.2f}" for f in figure)
        verdict = "-" if met is None else ("met" if met else "NOT met")
        print(f"{goal:<52} {shown:>13}  (>= {need[0]} / {need[1]})  {verdict}")
        for k, v in extra.items():
            if v is not None:
                print(f"    {k}: {_round(v)}")
    machine = next((r["machine"] for r in res.values() if r is not None), None)
    return {"suites": list(SUITES), "runs": {n: RUNS[n] for n in RUNS if res[n] is not None},
            "common": COMMON, "goals": goals, "machine": machine}


def _best(taus: list[list[float] | None]) -> list[float] | None:
    """Per suite, the highest tau among the runs that exist (None: a missing run)."""
    have = [t for t in taus if t is not None]
    return [max(col) for col in zip(*have, strict=True)] if have else None


def _round(v):
    if isinstance(v, list):
        return [round(x, 3) if isinstance(x, float) else x for x in v]
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--draft", help="head directory (default: the shipped head)")
    r.add_argument("--only", help=f"comma list of runs: {', '.join(RUNS)}")
    p = sub.add_parser("report")
    p.add_argument("out", type=Path)
    p.add_argument("--json", type=Path, help="where to write the table (default OUT/goals.json)")
    args = ap.parse_args()
    if args.cmd == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        run(args.out, args.draft, args.only.split(",") if args.only else None)
    else:
        table = report(args.out)
        path = args.json or args.out / "goals.json"
        path.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
