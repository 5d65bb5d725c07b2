"""eagle2.gpu_check (tiny, CPU) and the graph-safe forward of eagle2.cuda_graphs.

See docs/architecture.md "On GPUs". The GPU run itself (`make gpu-check`) needs CUDA; here
the same code runs with tiny shapes, and the forward that CUDA graphs capture is checked
against the target's own forward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import tiny_target

from eagle2.cuda_graphs import GraphedForward, static_forward

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_gpu_check_runs_from_the_checkout_and_passes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "eagle2.gpu_check", "--tiny", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["passed"] and report["tiny"] and report["imported_forbidden"] == []
    assert {k for k, v in report["lossless"].items() if v.get("equal_to_vanilla")} == {
        "greedy_vanilla", "greedy_eagle2", "greedy_static", "greedy_chain",
        "greedy_eagle2-auto"}
    assert {k for k, v in report["lossless_eagle3_head"].items()
            if v.get("equal_to_vanilla")} == {"greedy_vanilla", "greedy_eagle2", "greedy_chain",
                                              "greedy_eagle2-auto"}
    assert {r["mode"] for r in report["eagle3_vs_vanilla"]} == {"vanilla", "eagle2"}
    assert all(r["eager_ms"] > 0 for r in report["forward_cost"])
    assert {r["mode"] for r in report["eagle2_vs_vanilla"]} == {"vanilla", "eagle2"}


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
