"""`eagle2 bench-service`: its metrics on hand-made inputs, and one tiny run against a real
service (Ray Serve, the OpenAI endpoint, the embedded model) that checks the report's fields
and that its token counts are the service's own, never the speed."""

from __future__ import annotations

import argparse
import json

import pytest

from services.bench_service import (
    add_cpu,
    compare_ids,
    dist_ms,
    engine_summary,
    per_token,
    serving_metrics,
    stats_delta,
)


def test_serving_metrics_follow_vllms_definitions():
    reqs = [  # 5 tokens in 3 chunks (first at 0.1 s, then +0.2, +0.3): TPOT (0.6-0.1)/4
        {"token_ids": [1, 2, 3, 4, 5], "ttft_s": 0.1, "itl_s": [0.2, 0.3], "latency_s": 0.6},
        {"token_ids": [7], "ttft_s": 0.3, "itl_s": [], "latency_s": 0.3},
        {"token_ids": [], "ttft_s": None, "itl_s": [], "latency_s": None,
         "error": "HTTP 429: busy"},
    ]
    m = serving_metrics(reqs, wall_s=2.0)
    assert (m["requests"], m["completed"], m["errors"]) == (3, 2, 1)
    assert m["error_messages"] == ["HTTP 429: busy"]
    assert m["output_tokens"] == 6 and m["output_tokens_per_s"] == 3.0
    assert m["requests_per_s"] == 1.0 and m["tokens_per_chunk"] == 1.5  # 6 tokens, 4 chunks
    assert m["tpot_ms"] == {"mean": 125.0, "median": 125.0, "p99": 125.0}  # one request > 1
    assert m["ttft_ms"]["mean"] == 200.0 and m["ttft_ms"]["median"] == 200.0
    assert m["itl_ms"]["mean"] == 250.0 and m["itl_ms"]["p99"] == pytest.approx(299.0)


def test_dist_ms_empty_and_p99():
    assert dist_ms([]) == {"mean": None, "median": None, "p99": None}
    d = dist_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert d["mean"] == 50.5 and d["median"] == 50.5 and d["p99"] == pytest.approx(99.01)


def test_stats_delta_and_engine_summary():
    before = {"draft_s": 1.0, "verify_s": 2.0, "prefill_s": 0.5, "other_s": 0.1, "steps": 10,
              "draft_rpc_calls": 10, "draft_rpc_s": 0.8, "batch_sizes": [1] * 10,
              "loop_steps": 12, "loop_step_s": 3.0, "loop_host_s": 0.1, "loop_dispatch_s": 0.05,
              "loop_step_cpu_s": 2.0, "loop_host_cpu_s": 0.08,
              "router_messages": 20, "router_delivery_s": 0.2, "router_work_s": 0.02,
              "event_frames": 12, "event_messages": 20}
    after = {"draft_s": 1.5, "verify_s": 3.0, "prefill_s": 0.7, "other_s": 0.2, "steps": 14,
             "draft_rpc_calls": 14, "draft_rpc_s": 1.2, "batch_sizes": [1] * 10 + [4, 4, 3, 1],
             "loop_steps": 16, "loop_step_s": 4.0, "loop_host_s": 0.12, "loop_dispatch_s": 0.054,
             "loop_step_cpu_s": 2.6, "loop_host_cpu_s": 0.096,
             "router_messages": 30, "router_delivery_s": 0.25, "router_work_s": 0.03,
             "event_frames": 16, "event_messages": 32, "rank_bytes_out": None}
    d = stats_delta(before, after)
    assert d["steps"] == 4 and d["batch_sizes"] == [4, 4, 3, 1]
    e = engine_summary(d, tokens=20)
    assert e["tokens_per_step"] == 5.0 and e["draft_ms_per_step"] == 125.0
    assert e["batch_size_mean"] == 3.0 and e["batch_size_max"] == 4
    assert e["draft_rpc_ms_per_call"] == 100.0 and e["draft_outside_rpc_ms_per_step"] == 25.0
    assert e["loop_step_ms_per_step"] == 250.0 and e["loop_host_ms_per_step"] == 5.0
    assert e["loop_dispatch_ms_per_step"] == 1.0
    assert e["loop_step_cpu_ms_per_step"] == 150.0 and e["loop_host_cpu_ms_per_step"] == 4.0
    assert e["router_delivery_ms_per_message"] == 5.0 and e["router_work_ms_per_message"] == 1.0
    assert e["rank_bytes_out_per_step"] is None and e["bytes_per_step"] is None
    assert e["events_per_frame"] == 3.0 and e["frames_per_step"] == 1.0
    empty = engine_summary(stats_delta({}, {"steps": 0, "batch_sizes": []}), tokens=0)
    assert empty["draft_ms_per_step"] is None and empty["batch_size_mean"] is None


def test_compare_ids_counts_and_names_differences():
    recs = [{"prompt": 0, "token_ids": [1, 2]}, {"prompt": 1, "token_ids": [3]},
            {"prompt": 2, "token_ids": [], "error": "boom"}]
    assert compare_ids(recs, {0: [1, 2], 1: [4]}) == {"compared": 2, "equal": 1, "differ": [1]}


def test_cpu_per_token_sums_deltas_by_role():
    acc: dict = {}
    add_cpu(acc, {"engine": 10.0, "router": 1.0}, {"engine": 10.5, "router": 1.1})
    add_cpu(acc, {"engine": 20.0, "router": 2.0}, {"engine": 20.5, "router": 2.1})
    assert per_token(acc, 500) == {"engine": 2.0, "router": 0.4, "total": 2.4}
    assert per_token({}, 10) is None and per_token(acc, 0) is None


@pytest.mark.slow  # its own service, ~30 s; the metrics code is tested above
def test_tiny_run_against_a_real_service(tmp_path):
    """Starts the service (the embedded model; a fresh local Ray), runs 2 prompts x 6 tokens at
    concurrency 1 and 2 over /v1/chat/completions and in process, and stops it (~60 s on 2
    cores, most of it the service's start)."""
    pytest.importorskip("ray")
    pytest.importorskip("aiohttp")
    from services import bench_service

    p = argparse.ArgumentParser()
    bench_service.add_arguments(p)
    out = tmp_path / "bench.json"
    args = p.parse_args(["--num-prompts", "2", "--max-tokens", "6", "--concurrency", "1,2",
                         "--max-context", "512", "--port", "19120", "--http-port", "18120",
                         "--out", str(out)])
    assert bench_service.run(args) == 0
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert [r["concurrency"] for r in report["levels"]] == [1, 2]
    outputs = report["service_outputs"]
    assert len(outputs) == 4  # 2 prompts at each level
    for o in outputs:  # ignore_eos: max_tokens each; the ids the chunks carried = the usage
        assert len(o["token_ids"]) == o["usage_completion_tokens"] == 6
    for row in report["levels"]:
        s = row["service"]
        assert s["errors"] == 0 and s["completed"] == 2 and s["usage_equals_token_ids"]
        assert s["output_tokens"] == sum(o["usage_completion_tokens"] for o in outputs
                                         if o["concurrency"] == row["concurrency"])
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert set(s[key]) == {"mean", "median", "p99"} and s[key]["mean"] is not None
        assert s["engine"]["steps"] >= 1 and s["engine"]["loop_step_ms_per_step"] > 0
        assert 0 < s["engine"]["loop_step_cpu_ms_per_step"]
        assert s["engine"]["router_delivery_ms_per_message"] is not None
        cpu = s["cpu_ms_per_token"]  # the service's own processes, found and measured
        assert cpu["engine"] > 0 and cpu["router"] > 0 and cpu["proxy"] > 0
        assert row["inprocess"]["cpu_ms_per_token"]["inprocess"] > 0
        assert row["inprocess"]["output_tokens"] == 12
        assert row["service_over_inprocess"]["output_tokens_per_s"] > 0
        assert row["service_ids_equal_inprocess_batch1"] == {"compared": 2, "equal": 2,
                                                             "differ": []}
    assert report["service_ids_equal_plain_decoding"]["equal"] == 4
    assert report["service"]["draft"] == "worker"
