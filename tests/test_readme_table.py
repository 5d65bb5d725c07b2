"""benchmarks/readme_table.py: the README's figures table is the one benchmarks/results gives
(a number edited by hand in the README fails), and the table builder reads each figure,
setting and command from a run's JSON."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def table():
    return _load("readme_table")


def test_readme_table_is_the_results_table(table, capsys):
    assert table.main(["--check", str(README)]) == 0, capsys.readouterr().err


def test_a_figure_edited_by_hand_fails_the_check(table, tmp_path, capsys):
    text = README.read_text()
    block = table.current(text)
    assert "**2.06x / 2.39x**" in block  # the batch-1 row, from head-goals-xeon-amx-s37/full.json
    edited = tmp_path / "README.md"
    edited.write_text(text.replace(block, block.replace("**2.06x / 2.39x**", "**2.10x / 2.39x**")))
    assert table.main(["--check", str(edited)]) == 1
    assert "2.10x" in capsys.readouterr().err
    edited.write_text(text.replace(block, block.replace("\n|---|", "\n| extra row |\n|---|")))
    assert table.main(["--check", str(edited)]) == 1
    edited.write_text("no table here\n")
    with pytest.raises(ValueError):
        table.main(["--check", str(edited)])


def test_write_puts_the_table_between_the_markers(table, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n\n{table.BEGIN}\nold\n{table.END}\n\nafter\n")
    assert table.main(["--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "old" not in text and table.build_table() in text
    assert table.main(["--check", str(readme)]) == 0


def _bench(tmp_path: Path, name: str, *, modes, temperature=0.0, tree="budget", lookup=16,
           batch=1, follow=True, lossless=True) -> None:
    trees = {m: {"total_tokens": 26 if tree == "fixed" else 32, "depth": 5, "top_k": 8,
                 "lookup": lookup} for m in modes if m != "hf"}
    suites = {}
    for s, (plain, fast, tau) in {"mt_bench": (100.0, 150.0, 2.5),
                                  "humaneval": (80.0, 200.0, 3.125)}.items():
        suites[s] = {"modes": {
            "vanilla": {"tokens_per_s": plain, "tau": 1.0, "speedup": 1.0},
            "eagle2": {"tokens_per_s": fast, "tau": tau, "speedup": fast / plain},
            "static": {"tokens_per_s": fast, "tau": tau - 1, "speedup": None},
            "hf": {"tokens_per_s": 25.0, "tau": 1.0, "speedup": 0.25}}}
    res = {"config": {"suites": ["mt_bench", "humaneval"], "num_prompts": 10, "max_tokens": 64,
                      "temperature": temperature, "seed": 0, "top_p": 1.0, "top_k": 0,
                      "modes": list(modes), "batch_size": batch, "repeats": 1, "warmup": False,
                      "background_load": 0, "draft": "/x/eagle2/heads/smollm2-135m-instruct",
                      "tree_source": tree, "trees": trees},
           "machine": {"cpu_count": 4, "torch_threads": 3, "threads_follow_load": follow,
                       "dtype": "bfloat16"},
           "suites": suites, "lossless": lossless}
    (tmp_path / name).write_text(json.dumps(res))


def test_rows_from_synthetic_results(table, tmp_path):
    _bench(tmp_path, "b1.json", modes=["vanilla", "eagle2"])
    _bench(tmp_path, "hf.json", modes=["vanilla", "eagle2", "hf"], batch=1)
    _bench(tmp_path, "t1.json", modes=["eagle2", "static"], temperature=1.0, tree="fixed",
           lookup=0, follow=False, lossless=None)
    def level(c, service, inproc, equal):
        def run(tps, ms):
            return {"errors": 0, "output_tokens_per_s": tps, "ttft_ms": {"median": ms * 5},
                    "tpot_ms": {"median": ms}, "itl_ms": {"p99": ms * 3}}
        return {"concurrency": c, "service": run(service, 20.0), "inprocess": run(inproc, 10.0),
                "service_over_inprocess": {"output_tokens_per_s": service / inproc},
                "service_ids_equal_inprocess_batch1": {"compared": 6, "equal": equal}}
    svc_run = {"args": {"suite": "mt_bench", "num_prompts": 6, "max_tokens": 128,
                        "concurrency": "1,4", "mode": "eagle2", "draft_placement": "worker",
                        "engine_threads": None, "port": 19100, "out": "x.json"},
               "machine": {"cpus": 2, "loadavg_start": [0.25, 1.0, 1.0]},
               "levels": [level(1, 70.0, 100.0, 6), level(4, 120.0, 200.0, 6)],
               "service_ids_equal_plain_decoding": {"compared": 12, "equal": 12}}
    (tmp_path / "svc.json").write_text(json.dumps(svc_run))
    rows = [("b1.json", "speedup", "here"), ("hf.json", "hf", "here"),
            ("t1.json", "tau", "there"), ("svc.json", "service", "elsewhere")]
    lines = table.build_table(tmp_path, rows).splitlines()
    assert len(lines) == 2 + len(rows) and lines[1] == "|---|---|---|---|"
    b1, hf, t1, svc = lines[2:]
    assert b1 == (
        "| batch 1, T = 0, cost-aware tree; 10 + 10 prompts x 64 | eagle2 / plain decoding "
        "**1.50x / 2.50x** (150.0 / 200.0 against 100.0 / 80.0 tokens/s), tau 2.50 / 3.12; "
        "eagle2's output equals plain decoding's on all 20 prompts | `eagle2 bench --suite "
        "mt_bench,humaneval --num-prompts 10 --max-tokens 64 --modes vanilla,eagle2` | "
        "`b1.json`; here, 4 CPUs (3 threads), bfloat16 |")
    assert "eagle2 / HF `generate` **6.00x / 8.00x** (150.0 / 200.0 against 25.0 / 25.0" in hf
    assert "--modes vanilla,eagle2,hf`" in hf
    assert t1.startswith("| batch 1, T = 1, 26-token tree (depth 5, top_k 8), head alone "
                         "(no lookup); 10 + 10 prompts x 64 | tau **2.50 / 3.12**; the static "
                         "(EAGLE-1) tree of as many tokens 1.50 / 2.12 | ")
    assert "plain decoding's" not in t1  # sampled: no equality claim
    assert ("`eagle2 bench --suite mt_bench,humaneval --num-prompts 10 --max-tokens 64 --modes "
            "eagle2,static --temperature 1.0 --seed 0 --tree fixed --total-tokens 26 --depth 5 "
            "--tree-top-k 8 --lookup 0 --threads 3`") in t1
    assert svc == (
        "| the service through its OpenAI endpoint (streaming chat completions, draft worker), "
        "6 MT-bench prompts x 128, mode eagle2, against the in-process engine at the same batch, "
        "interleaved | concurrency 1: 70.0 tokens/s, **0.70x** in-process (100.0); TTFT median "
        "100 ms, TPOT median 20.0 ms (in-process 10.0), ITL p99 60 ms; 6 of 6 outputs equal "
        "in-process batch 1's; concurrency 4: 120.0 tokens/s, **0.60x** in-process (200.0); "
        "TTFT median 100 ms, TPOT median 20.0 ms (in-process 10.0), ITL p99 60 ms; 6 of 6 "
        "outputs equal in-process batch 1's; all 12 service outputs equal plain decoding's | "
        "`eagle2 bench-service --num-prompts 6 --concurrency 1,4` | `svc.json`; elsewhere, "
        "2 CPUs, load average 0.2 at the start |")
    svc_run["service_ids_equal_plain_decoding"]["equal"] = 11  # one output differs: no figure
    (tmp_path / "svc.json").write_text(json.dumps(svc_run))
    with pytest.raises(ValueError):
        table.build_table(tmp_path, [("svc.json", "service", "here")])
    _bench(tmp_path, "bad.json", modes=["vanilla", "eagle2"], lossless=False)
    with pytest.raises(ValueError):
        table.build_table(tmp_path, [("bad.json", "speedup", "here")])


def _flags(argv: list[str]) -> dict[str, str | None]:
    out, i = {}, 0
    while i < len(argv):
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        out[argv[i]] = value
        i += 1 if value is None else 2
    return out


def test_commands_are_the_ones_head_goals_ran(table):
    """The commands the table derives from the kept head-goals runs are head_goals.py's."""
    goals = _load("head_goals")
    runs = table.RESULTS / "head-goals-xeon-amx-s37"
    checked = 0
    for name, argv in goals.RUNS.items():
        res = json.loads((runs / f"{name}.json").read_text())
        derived = table.bench_command(res).removeprefix("eagle2 bench ").split()
        assert _flags(derived) == _flags(goals.COMMON + argv), name
        checked += 1
    assert checked == len(goals.RUNS)


def test_a_tpot_row_reads_its_figures_and_refuses_differing_tokens(table):
    res = {"command": "benchmarks/tp_service_tpot.py --tp 2", "tp_size": 2, "max_tokens": 48,
           "rounds": 3, "machine": {"cpus": 2, "loadavg_start": [0.5, 0, 0]},
           "tokens_equal": True,
           "levels": [{"concurrency": 1, "overhead_ms": 4.09, "service_tpot_ms_median": 4.91,
                       "inprocess_ms_per_token": 0.82}]}
    setting, figure, command = table.row(res, "tpot")
    assert "on 2 rank actors" in setting and "48 tokens x 3 rounds" in setting
    assert "**4.09 ms**" in figure and "4.91 against 0.82 ms" in figure
    assert command == "python benchmarks/tp_service_tpot.py --tp 2"
    with pytest.raises(ValueError):
        table.row({**res, "tokens_equal": False}, "tpot")


def test_a_prompts_row_reads_its_figures_and_refuses_differing_outputs(table):
    side = {"stream_tokens_per_s_in_window": 100.0, "gap_window_p99_ms": 110.0,
            "last_ttft_s": 2.5, "output_tokens_per_s": 200.0, "tpot_ms.median": 40.0,
            "itl_ms.p99": 150.0, "ttft_ms.median": 900.0}
    res = {"command": "benchmarks/chunked_prefill.py --rounds 3 --out x.json",
           "machine": {"cpus": 2, "loadavg_start": [0.4, 0, 0]},
           "config": {"rounds": 3, "streams": 8, "prefill_chunk": 64, "concurrency": 16,
                      "num_prompts": 48, "arrival_tokens": 64},
           "long": {"outputs_equal": True, "long_prompt_tokens": 2000, "mixed": side,
                    "own_forward": {**side, "stream_tokens_per_s_in_window": 80.0},
                    "ratios_mixed_over_own": {"stream_tokens_per_s_in_window": 1.25}},
           "arrivals": {"outputs_equal": True, "mixed": side, "own_forward": side,
                        "ratios_mixed_over_own": {"output_tokens_per_s": 1.0}},
           "burst": {"outputs_equal": True, "prompts": 16, "prompt_tokens": 1319,
                     "padded_tokens": 2208, "mixed": {"prefill_ms": 815.0},
                     "own_forward": {"prefill_ms": 1292.0},
                     "ratios_mixed_over_own": {"prefill_ms": 0.631}}}
    setting, figure, command = table.row(res, "prompts")
    assert "2000-token prompt arriving while 8 streams" in setting
    assert "**1.25x**" in figure and "(100 against 80)" in figure
    assert "**0.63x** the time (815 against 1292 ms)" in figure
    assert command == "python benchmarks/chunked_prefill.py --rounds 3"
    with pytest.raises(ValueError):
        table.row({**res, "arrivals": {**res["arrivals"], "outputs_equal": False}}, "prompts")


def test_a_budget_row_reads_its_figures_and_refuses_differing_outputs(table):
    side = {"gap_window_p99_ms": 80.0, "window_p99_over_median": 3.7, "ttft_median_s": 0.63,
            "last_ttft_s": 1.39, "output_tokens_per_s": 357.0, "ttft_ms.p99": 2389.0,
            "itl_ms.p99": 115.0}
    res = {"command": "benchmarks/chunked_prefill.py --compare budget --rounds 3 --out x.json",
           "machine": {"cpus": 2, "loadavg_start": [0.4, 0, 0]},
           "config": {"rounds": 3, "streams": 8, "prefill_chunk": 64, "concurrency": 32,
                      "num_prompts": 64, "arrival_tokens": 64},
           "wave": {"outputs_equal": True, "prompts": 16, "prompt_tokens": 1319,
                    "in_budget": side, "outside_budget": {**side, "gap_window_p99_ms": 166.0},
                    "ratios_in_over_outside": {"gap_window_p99_ms": 0.482}},
           "arrivals": {"outputs_equal": True, "in_budget": side, "outside_budget": side,
                        "ratios_in_over_outside": {"output_tokens_per_s": 1.0}}}
    setting, figure, command = table.row(res, "budget")
    assert "16 chat prompts (1319 tokens) arriving together while 8 streams" in setting
    assert "gap p99 is **0.48x** (80 against 166 ms" in figure
    assert "TTFT median 630 against 630 ms" in figure
    assert command == "python benchmarks/chunked_prefill.py --compare budget --rounds 3"
    with pytest.raises(ValueError):
        table.row({**res, "wave": {**res["wave"], "outputs_equal": False}}, "budget")
