"""The benchmark: metrics on hand-made inputs, a tiny bench run, shards and repeats."""

from __future__ import annotations

import json

import pytest
import torch

from eagle2.bench import report
from eagle2.bench.report import PromptRun, acceptance_by_depth


# ----- metrics ----------------------------------------------------------------------------------
def test_acceptance_by_depth_hand_made():
    # 4 steps: accepted 0, 0, 1, 3 draft tokens
    assert acceptance_by_depth({0: 2, 1: 1, 3: 1}) == [0.5, 0.25, 0.25]
    assert acceptance_by_depth({0: 2, 1: 1, 3: 1}, max_depth=5) == [0.5, 0.25, 0.25, 0.0, 0.0]
    assert acceptance_by_depth({2: 3}) == [1.0, 1.0]
    assert acceptance_by_depth({0: 7}) == []
    assert acceptance_by_depth({}, max_depth=2) == [0.0, 0.0]


def test_mode_metrics_tau_speedup_and_split():
    runs = {
        "vanilla": [PromptRun("a", 5, [1, 2, 3, 4], 4, 2.0, "length", {0: 3},
                              {"draft": 0.0, "verify": 1.5, "prefill": 0.5, "other": 0.0})],
        "eagle2": [PromptRun("a", 5, [1, 2, 3, 4], 2, 1.0, "length", {2: 1},
                             {"draft": 0.25, "verify": 0.5, "prefill": 0.25, "other": 0.0})],
    }
    suite = report.finish_suite(runs, greedy=True, max_depths={"eagle2": 3})
    e = suite["modes"]["eagle2"]
    assert (e["tau"], e["tau_decode"], e["tokens_per_s"], e["speedup"]) == (2.0, 3.0, 4.0, 2.0)
    assert e["acceptance_by_depth"] == [1.0, 1.0, 0.0]
    assert e["accepted_length_hist"] == {"3": 1}
    assert e["time_split"]["draft"] == {"s": 0.25, "frac": 0.25}
    assert suite["modes"]["vanilla"]["tau"] == 1.0 and suite["lossless"] is True
    runs["eagle2"][0].token_ids[2] = 9
    bad = report.finish_suite(runs, greedy=True, max_depths={})
    assert bad["lossless"] is False
    assert bad["mismatches"] == [{"mode": "eagle2", "prompt_id": "a", "first_mismatch": 2}]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    from eagle2.cli import main

    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    rc = main(["bench", "--suite", "mt_bench", "--suite", "humaneval", "--num-prompts", "1",
               "--max-tokens", "8", "--modes", "vanilla,eagle2,hf", "--total-tokens", "6",
               "--depth", "2", "--tree-top-k", "2", "--out", str(out), "--dtype", "float32",
               "--device", "cpu", "--threads", "1"])
    assert torch.get_num_threads() == threads  # run() puts the thread count back
    return rc, out


def test_tiny_bench_writes_results_and_chart(bench_run):
    rc, out = bench_run
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["lossless"] is True
    assert set(res) >= {"definitions", "config", "machine", "suites", "wall_s"}
    assert res["machine"]["torch_threads"] >= 1 and res["machine"]["cpu_count"] >= 1
    assert res["config"]["trees"]["eagle2"]["total_tokens"] == 6
    for suite in ("mt_bench", "humaneval"):
        s = res["suites"][suite]
        assert s["lossless"] is True and s["mismatches"] == []
        assert set(s["modes"]) == {"vanilla", "eagle2", "hf"}
        assert s["modes"]["vanilla"]["speedup"] == 1.0
        e = s["modes"]["eagle2"]
        assert len(e["acceptance_by_depth"]) == 3  # depth 2 -> 3 draft levels
        assert set(e["time_split"]) == {"draft", "verify", "prefill", "other"}
        assert e["per_prompt"][0]["new_tokens"] <= 8 and e["tau"] >= 1.0
        assert s["modes"]["hf"]["time_split"] is None
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_bad_arguments():
    from eagle2.cli import main

    assert main(["bench", "--modes", "vanilla,turbo"]) == 2
    assert main(["bench", "--tree", "budget", "--depth", "3"]) == 2
    assert main(["bench", "--batch", "2", "--modes", "vanilla,hf"]) == 2
    assert main(["bench", "--suite", "gsm8k"]) == 2


def test_hf_mode_uses_the_same_target_greedy(bench_run):
    _, out = bench_run
    res = json.loads((out / "results.json").read_text())
    for suite in res["suites"].values():
        hf, van = suite["modes"]["hf"], suite["modes"]["vanilla"]
        assert hf["tau"] == 1.0
        assert hf["per_prompt"][0]["new_tokens"] == van["per_prompt"][0]["new_tokens"]



def test_shards_merge_into_one_report(tmp_path):
    """Two --shard runs split the prompts; --merge gives the report of all of them, whether
    the shards wrote to folders of their own or to one (their files carry the shard)."""
    from eagle2.cli import main

    common = ["bench", "--suite", "mt_bench", "--num-prompts", "3", "--max-tokens", "6",
              "--modes", "vanilla,eagle2", "--total-tokens", "4", "--depth", "2",
              "--tree-top-k", "2", "--dtype", "float32", "--device", "cpu", "--threads", "1"]
    for i in (0, 1):
        assert main([*common, "--shard", f"{i}/2", "--out", str(tmp_path / f"s{i}")]) == 0
        assert (tmp_path / f"s{i}" / f"results-shard-{i}-of-2.json").exists()
    assert main(["bench", "--merge", str(tmp_path / "s1"), str(tmp_path / "s0"),
                 "--out", str(tmp_path / "all")]) == 0
    shards = [json.loads((tmp_path / f"s{i}" / f"runs-shard-{i}-of-2.json").read_text())
              for i in (0, 1)]
    assert [len(s["runs"]["mt_bench"]["eagle2"]) for s in shards] == [2, 1]
    res = json.loads((tmp_path / "all" / "results.json").read_text())
    suite = res["suites"]["mt_bench"]
    assert res["lossless"] is True and res["config"]["merged_shards"] == ["0/2", "1/2"]
    for mode in ("vanilla", "eagle2"):
        runs = [r for s in shards for r in s["runs"]["mt_bench"][mode]]
        m = suite["modes"][mode]
        assert [p["prompt_id"] for p in m["per_prompt"]] == sorted(
            (r["prompt_id"] for r in runs), key=int)
        assert m["new_tokens"] == sum(len(r["token_ids"]) for r in runs)
        assert m["num_steps"] == sum(r["num_steps"] for r in runs)
    # both shards' files in one folder (as two shards given the same --out leave them)
    shared = tmp_path / "shared"
    shared.mkdir()
    for i in (0, 1):
        name = f"runs-shard-{i}-of-2.json"
        (shared / name).write_text((tmp_path / f"s{i}" / name).read_text())
    assert main(["bench", "--merge", str(shared), "--out", str(tmp_path / "all2")]) == 0
    again = json.loads((tmp_path / "all2" / "results.json").read_text())
    assert again["suites"] == res["suites"]
    # a shard merged with itself, or a run that was not sharded, is refused
    assert main(["bench", "--merge", str(tmp_path / "s0"), str(tmp_path / "s0"),
                 "--out", str(tmp_path / "bad")]) == 2
    assert main(["bench", "--merge", str(tmp_path / "s0"), str(tmp_path / "nothing"),
                 "--out", str(tmp_path / "bad")]) == 2


def test_repeats_run_every_group_again_with_the_mode_order_rotating(tmp_path):
    from eagle2.cli import main

    assert main(["bench", "--suite", "mt_bench", "--num-prompts", "2", "--max-tokens", "6",
                 "--modes", "vanilla,eagle2", "--total-tokens", "4", "--depth", "2",
                 "--tree-top-k", "2", "--dtype", "float32", "--device", "cpu", "--threads",
                 "1", "--batch", "2", "--repeats", "2", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["lossless"] is True and res["config"]["repeats"] == 2
    for mode in ("vanilla", "eagle2"):
        m = res["suites"]["mt_bench"]["modes"][mode]
        assert m["num_prompts"] == 4  # 2 prompts x 2 repeats
        ids = sorted(p["prompt_id"] for p in m["per_prompt"])
        assert len(set(ids)) == 2 and ids[0] == ids[1] and ids[2] == ids[3]
    assert main(["bench", "--repeats", "0"]) == 2


def test_shard_must_name_a_shard_of_the_count():
    from eagle2.cli import main

    assert main(["bench", "--shard", "2/2", "--total-tokens", "4"]) == 2


def test_budget_costs_are_measured_before_the_timed_runs(tmp_path, monkeypatch):
    """The cost-aware budget measures this machine's costs at its first step: the bench does
    that untimed, so the first timed group does not count a measurement as drafting."""
    from eagle2.bench import run as bench_run_mod
    from eagle2.cli import main

    seen = []
    timed = bench_run_mod._loop

    def loop(llm, *args, **kwargs):
        seen.append(llm.engine.known_costs)
        return timed(llm, *args, **kwargs)

    monkeypatch.setattr(bench_run_mod, "_loop", loop)
    assert main(["bench", "--suite", "mt_bench", "--num-prompts", "1", "--max-tokens", "4",
                 "--modes", "vanilla,eagle2", "--dtype", "float32", "--device", "cpu",
                 "--threads", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["config"]["trees"]["eagle2"]["budget"] == "auto"
    # forward and draft costs known (measured now, or read from this machine's cache)
    assert len(seen) == 1 and seen[0] is not None and 1 in seen[0].draft_batches
