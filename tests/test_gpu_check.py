"""eagle2.gpu_check in CPU mode (tiny shapes) and the graph-safe forward of eagle2.cuda_graphs.

See docs/architecture.md "On GPUs". The GPU run itself (`make gpu-check`) needs CUDA; here
every phase runs with tiny shapes: the JSON is rewritten (valid) after each phase, a phase
that fails is recorded with its error while the later phases still run, budgets cut
repetitions and skip phases, and tp = 2 runs over gloo in two processes. The forward that
CUDA graphs capture is checked against the target's own forward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_target

from eagle2 import gpu_check
from eagle2.cuda_graphs import GraphedForward, static_forward

ROOT = Path(__file__).resolve().parents[1]
NAMES = [p.name for p in gpu_check.PHASES]


def test_cpu_mode_writes_every_phase_and_records_a_failed_one(tmp_path):
    """All phases at tiny scale (tp2 skipped on request), backend failed on purpose."""
    seen: list[tuple[str, dict]] = []

    def hook(name, report, path):
        on_disk = json.loads(path.read_text())  # valid JSON after every phase
        seen.append((name, {n: p["status"] for n, p in on_disk["phases"].items()}))
        assert on_disk["phases"][name]["status"] == report["phases"][name]["status"]

    rc = gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--no-cpu-tp",
                         "--fail-phase", "backend"], hook=hook)
    assert rc == 1
    assert [name for name, _ in seen] == NAMES
    for i, (name, statuses) in enumerate(seen):  # written after each: the rest still pending
        assert statuses[name] in ("ok", "failed", "skipped")
        assert all(statuses[n] == "pending" for n in NAMES[i + 1:])
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    phases = report["phases"]
    assert list(phases) == NAMES and report["finished"] and report["passed"] is False
    failed = phases["backend"]
    assert failed["status"] == "failed" and failed["error"]["type"] == "RuntimeError"
    assert "--fail-phase backend" in failed["error"]["message"]
    assert "RuntimeError" in failed["error"]["traceback"][-1]
    assert phases["tp2"]["status"] == "skipped" and "--no-cpu-tp" in phases["tp2"]["reason"]
    ok = [n for n in NAMES if n not in ("backend", "tp2")]
    assert all(phases[n]["status"] == "ok" and phases[n]["wall_s"] >= 0 for n in ok), phases
    _check_results({n: phases[n]["result"] for n in ok})


def _check_results(res: dict) -> None:
    for name in ("lossless", "lossless_eagle3_head"):
        greedy = {k: v["equal_to_vanilla"] for k, v in res[name].items() if "greedy" in k}
        assert len(greedy) >= 4 and all(greedy.values()), res[name]
        assert res[name]["sampling_eagle2"]["ran"] and res[name]["sampling_vanilla"]["ran"]
    for model in ("scaled_lm_head", "unscaled_lm_head"):
        div = res["divergence"][model]
        assert div["prompts"] == len(div["first_diff"]) == 4 and div["top2_gap_min"] > 0
        assert div["fraction_diverged"] == div["diverged"] / 4
    assert res["divergence"]["scaled_lm_head"]["diverged"] == 0  # as `lossless` shows
    only = res["sampling_speed"]["verify_only"]
    assert [r["vocab"] for r in only] == [gpu_check.LLAMA3_VOCAB] * 2
    assert all(r["sampled_ms"] > 0 and r["greedy_ms"] > 0 for r in only)
    assert all(r["sampled_tokens"] >= 2 for r in only)  # the boosted drafts were accepted
    assert [r["batch"] for r in res["sampling_speed"]["verify_step"]] == [1, 2]
    ctx = res["context_4k"]
    assert ctx["prompt_tokens"] == 4096
    assert ctx["vanilla"]["new_tokens"] == ctx["eagle2"]["new_tokens"] == 8
    memory = res["prefill_memory"]
    assert memory["rows"] and all(r["peak_bytes"] is None for r in memory["rows"])
    assert "CUDA" in memory["reason"]
    arr = res["arrivals"]
    assert arr["outputs_equal"] and arr["budget"] == 32  # (fp32 on the CPU: the same tokens)
    assert arr["mixed"]["mixed_steps"] == arr["mixed"]["prompt_steps"] > 0
    assert arr["own_forward"]["mixed_steps"] == 0 < arr["own_forward"]["prompt_steps"]
    assert arr["mixed"]["steps_to_long_first_token"] == 5  # 150 tokens, 32 a step
    assert all(arr[v]["plain_step_ms"] > 0 for v in ("mixed", "own_forward"))
    for v in ("mixed", "own_forward"):  # eager on the CPU: every step counted once
        by_launch = arr[v]["steps_by_launch"]
        assert set(by_launch) == {"plain_eager", "prompt_eager"}
        assert by_launch["prompt_eager"] == arr[v]["prompt_steps"]
        assert arr[v]["step_ms_by_launch"]["plain_eager"] > 0
    rows = res["paged_attention"]["rows"]  # gathered and in place, padded steps eagerly
    assert {(r["batch"], r["mode"], r["variant"]) for r in rows} == {
        (2, m, v[0]) for m in ("eagle2", "vanilla")
        for v in gpu_check.PAGED_VARIANTS}
    assert all(r["same_tokens_as_gather"] for r in rows)
    assert all(set(r["steps_by_launch"]) == {"padded"} for r in rows)
    warm = res["warmup"]
    assert set(warm) == {"eagle2_eager", "vanilla_eager", "skipped_for_budget"}
    assert all(warm[k]["first_s"] > 0 and warm[k]["again_s"] > 0 for k in warm if "_" in k
               and k != "skipped_for_budget")
    assert all(r["eager_ms"] > 0 for r in res["forward_cost"]["rows"])
    assert len(res["forward_cost"]["rows"]) == 6 and res["forward_cost_70b_4_layers"]["rows"]
    assert {r["mode"] for r in res["eagle3_vs_vanilla"]["rows"]} == {"vanilla", "eagle2"}
    assert res["imports"]["imported_forbidden"] == []


@pytest.mark.slow  # tp2 over gloo is tests/test_tp.py's; this runs gpu_check's phase
def test_tp2_over_gloo_from_the_checkout(tmp_path):
    """`--phases tp2` as `make gpu-check` starts it: setup, then tp = 2 in two processes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "eagle2.gpu_check", "--device", "cpu",
                           "--phases", "tp2,imports", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    phases = json.loads((tmp_path / "gpu-check.json").read_text())["phases"]
    tp = phases["tp2"]["result"]
    assert tp["process_group"] == "gloo" and tp["world_size"] == 2
    assert tp["argmax_agreement"] == 1.0 and tp["max_abs_logit_diff"] < 1e-4
    assert tp["tp2"]["ms_1_tokens"] > 0 and tp["tp1"]["ms_16_tokens"] > 0
    skipped = [n for n in NAMES if n not in ("setup", "tp2", "imports")]
    assert all(phases[n] == {"status": "skipped", "reason": "not selected (--phases)"}
               for n in skipped)


def test_budgets_cut_repetitions_and_skip_phases(tmp_path, monkeypatch):
    phases = [replace(p, budget_s=0.0) if p.name == "forward_cost" else p
              for p in gpu_check.PHASES]
    monkeypatch.setattr(gpu_check, "PHASES", phases)
    run = gpu_check.run_check(_args(tmp_path, "--phases", "backend,forward_cost"))["phases"]
    info = run["backend"]["result"]["info"]  # `Backend.info` of the kernels in use
    assert info["backend"] == "cpu" and info["fused"] and "attention" in info
    cost = run["forward_cost"]
    assert cost["status"] == "ok" and cost["truncated"] and cost["result"]["rows"] == []
    assert len(cost["result"]["skipped_for_budget"]) == 6
    spent = gpu_check.run_check(_args(tmp_path, "--budget-s", "1"))
    assert {p["status"] for p in spent["phases"].values()} == {"skipped"}
    assert "budget" in spent["phases"]["imports"]["reason"]
    assert spent["phases"]["lossless"]["reason"].startswith("needs the model")


def test_a_phase_far_past_its_budget_is_stopped():
    t0 = time.monotonic()
    with pytest.raises(gpu_check.PhaseTimeout), gpu_check._Alarm(1.0):
        time.sleep(10)
    assert time.monotonic() - t0 < 5


def test_first_diffs():
    assert gpu_check.first_diffs([[1, 2, 3], [1, 2], [4]], [[1, 2, 3], [1, 5], [4, 4]]) == [
        None, 1, 1]


def _args(tmp_path, *extra):
    return gpu_check.parse_args(["--out", str(tmp_path), "--device", "cpu", *extra])


def test_static_forward_equals_the_target_forward():
    """Mask over the whole cache (what a graph captures) == mask over the used prefix."""
    target = tiny_target(hidden=64, heads=4, kv_heads=2, seed=3)
    num_b, num_n, prefix = 2, 5, 7
    tokens = torch.randint(0, 64, (num_b, num_n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(num_n, num_n, dtype=torch.bool).tril().expand(num_b, num_n, num_n)
    caches = []
    for _ in range(2):
        cache = target.allocate_cache(num_b, 32)
        cache.k.normal_(generator=torch.Generator().manual_seed(1))
        cache.v.normal_(generator=torch.Generator().manual_seed(2))
        cache.lengths[:] = torch.tensor([prefix, prefix - 3])
        caches.append(cache)
    positions = caches[0].lengths[:, None] + torch.arange(num_n)
    want = target.forward(tokens, positions, mask, caches[0], torch.arange(num_b)).features
    got = static_forward(target, caches[1], tokens, positions, mask)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(caches[1].k, caches[0].k)  # same K/V written to the scratch


def test_graphed_forward_falls_back_to_eager_on_cpu():
    target = tiny_target(hidden=64, heads=4, kv_heads=2)
    graphed = GraphedForward(target, target.allocate_cache(1, 16), [(1, 2)])
    assert not graphed.enabled and graphed.graphs == {}
    out = graphed(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]),
                  torch.ones(1, 2, 2, dtype=torch.bool).tril())
    assert out.shape == (1, 2, 64)


def test_a_lossless_mismatch_is_reported_with_the_margin_where_it_happened(monkeypatch):
    """A greedy output that differs from vanilla's (one token flipped here) is a failed check
    whose entry names where it differs and vanilla's top-1 minus top-2 logit there, which
    tells a near-tie flipped by rounding (~0) from a defect."""
    target = gpu_check.random_target("tiny", torch.float32, "cpu")
    from eagle2.head import new_head

    head = new_head(target.config, seed=0, dtype=torch.float32)
    real, seen = gpu_check.generate, {}

    def flipped(engine, prompts, params, tree):
        tokens, stats = real(engine, prompts, params, tree)
        seen.setdefault(tree.mode, [list(t) for t in tokens])
        if tree.mode == "chain":
            tokens[1][3] = (tokens[1][3] + 1) % target.vocab_size
        return tokens, stats

    monkeypatch.setattr(gpu_check, "generate", flipped)
    out = gpu_check.check_lossless(target, head, {"total_tokens": 8, "depth": 3, "top_k": 2}, 6,
                                   sampling=False)
    assert out["greedy_eagle2"]["equal_to_vanilla"] and out["greedy_static"]["equal_to_vanilla"]
    chain = out["greedy_chain"]
    assert not chain["equal_to_vanilla"] and chain["first_mismatch"] == [(1, 3)]
    want = gpu_check.logit_gaps(target, [gpu_check.random_prompts(target.vocab_size, [7, 12, 5])[1]
                                         + seen["vanilla"][1][:3]])
    assert chain["top2_gap_at_mismatch"] == [want["top2_gap_min"]] and want["top2_gap_min"] > 0
