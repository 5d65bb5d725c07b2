"""The benchmark: metrics on hand-made inputs, the tuner's choice and replay, a tiny bench run."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_target

from eagle2.bench import autotune, report
from eagle2.bench.autotune import CostTable, choose, interpolate, replay_accepted
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


# ----- the tuner: choice and replay (pure) -----------------------------------------------------
def test_choose_picks_the_known_best():
    table = CostTable(
        verify_s={1: 0.10, 8: 0.12, 32: 0.30},
        draft_s={(2, 4): 0.02, (4, 4): 0.04},
        accepted={(2, 4, 8): 1.0, (2, 4, 32): 1.3, (4, 4, 8): 1.4, (4, 4, 32): 2.2,
                  (2, 4, 16): 1.2},
    )
    ranked = choose(table)
    # tokens/s: (2,4,8) 2/.14=14.3  (2,4,16) 2.2/.20=11.0  (2,4,32) 2.3/.32=7.2
    #           (4,4,8) 2.4/.16=15.0 (4,4,32) 3.2/.34=9.4   -> depth 4, N 8
    best = ranked[0]
    assert (best.depth, best.top_k, best.total_tokens) == (4, 4, 8)
    assert best.tokens_per_s == pytest.approx(2.4 / 0.16)
    assert ranked[1].total_tokens == 8 and ranked[1].depth == 2
    assert interpolate(table.verify_s, 16) == pytest.approx(0.18)
    assert interpolate(table.verify_s, 64) == pytest.approx(0.30 + 32 * 0.18 / 24)


def test_choose_skips_budgets_the_tree_cannot_fill():
    table = CostTable(verify_s={1: 0.1, 64: 0.1}, draft_s={(1, 1): 0.0},
                      accepted={(1, 1, 3): 1.0, (1, 1, 64): 5.0})
    assert [c.total_tokens for c in choose(table)] == [3]  # 2 candidates only


def test_replay_accepted_hand_made():
    # level 1: tokens 5 (-.1), 7 (-.9); level 2 under 5: 8 (-.3), 9 (-.4); under 7: 1 (-1.0)
    cands = [([5, 7], [-0.1, -0.9], [-1, -1], 1), ([8, 9, 1], [-0.3, -0.4, -1.0], [0, 0, 1], 2)]
    out = replay_accepted(cands, truth=[5, 9, 4], depths=(1,), sizes=(2, 3, 4, 6))
    # ranks: 5 -> 0, 8 -> 1, 9 -> 2, 7 -> 3, 1 -> 4; the truth path is 5 -> 9
    assert out == {(1, 2): 1, (1, 3): 1, (1, 4): 2, (1, 6): 2}
    out = replay_accepted(cands, truth=[7, 1, 4], depths=(1,), sizes=(4, 5, 6))
    assert out == {(1, 4): 0, (1, 5): 1, (1, 6): 2}
    assert replay_accepted(cands[:1], truth=[3], depths=(1,), sizes=(3,)) == {(1, 3): 0}


@pytest.fixture
def one_thread():
    """One torch thread: on a shared 2-core machine two threads can be 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_tune_end_to_end_on_a_tiny_model(one_thread):
    from eagle2.api import Eagle2
    from eagle2.head import new_head

    target = tiny_target(vocab=48, seed=3)
    llm = Eagle2(target, new_head(target.config, seed=0), max_batch=1, max_context=256)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
    result = autotune.tune(llm, calibration=prompts, gen_tokens=16, prefix_tokens=32, repeats=1,
                           max_positions=8, depths=(1, 2), top_ks=(1, 2), sizes=(3, 4, 6))
    t = result.table
    assert set(t.verify_s) == set(autotune.VERIFY_SIZES)
    assert set(t.draft_s) == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert t.num_positions == 8
    assert all(0 <= a <= 3 for a in t.accepted.values())
    assert result.best == result.ranked[0]
    tree = result.tree()
    assert tree.mode == "eagle2" and tree.total_tokens in (3, 4, 6)
    assert (2, 1, 4) in t.accepted  # the full chain of depth 2 is always replayed
    assert result.chain().top_k == 1
    json.dumps(result.to_json())
    assert "choice:" in result.format()


def test_replay_positions_spread_evenly():
    seqs = [(list(range(20)), None, 5), (list(range(12)), None, 4)]
    # reach 3: positions 5..16 (12) and 4..8 (5)
    assert autotune.replay_positions(seqs, 3, 100) == [list(range(5, 17)), list(range(4, 9))]
    spread = autotune.replay_positions(seqs, 3, 4)
    assert sum(map(len, spread)) == 4 and spread[0][0] == 5


def test_replay_matches_the_engine_step_by_step(one_thread):
    """The tuner's replay gives exactly the accepted lengths the engine gets (greedy)."""
    from conftest import make_engine

    from eagle2.config import SamplingParams, TreeConfig
    from eagle2.drafter import Drafter
    from eagle2.engine import Request
    from eagle2.runner import LocalRunner

    target = tiny_target(vocab=8, seed=3)  # small vocabulary: a random head is often right
    prompt = [1, 5, 2, 7, 3]
    for depth, k, n in ((2, 2, 5), (3, 3, 8), (1, 4, 4)):
        engine = make_engine(target, head_seed=0, max_batch=1)
        engine.add(Request("s", tuple(prompt), SamplingParams(max_tokens=40, ignore_eos=True),
                           TreeConfig("eagle2", total_tokens=n, depth=depth, top_k=k,
                                      budget="fixed", lookup=0)))  # head nodes only
        produced, output = [], []
        while engine.has_work():
            for ev in engine.step():
                produced.append(len(ev.token_ids))
                output += ev.token_ids
        ids = prompt + output
        positions, pos = [], len(prompt)
        for c in produced[1:-1]:  # verification steps; the last one may be cut by max_tokens
            positions.append(pos)
            pos += c
        drafter = Drafter(engine.drafter.head, target.embed, target.lm_head, max_slots=1,
                          max_len=64, keep_candidates=True)
        feats = autotune._features(LocalRunner(target, 1, 64), ids)
        replay = [r[(depth, k, n)] for r in autotune.replay_sequence(
            drafter, "r", ids, feats, positions, (depth,), (k,), (n,))]
        assert replay == [c - 1 for c in produced[1:-1]]
        assert max(replay) >= 1  # the comparison is not vacuous


# ----- a tiny bench through the CLI -------------------------------------------------------------
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
    assert res["lossless"] is True and res["tuner"] is None
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
    assert main(["bench", "--tree", "tuned", "--depth", "3"]) == 2
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


def test_shard_needs_a_fixed_tree():
    from eagle2.cli import main

    assert main(["bench", "--shard", "0/2", "--tree", "tuned"]) == 2
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
