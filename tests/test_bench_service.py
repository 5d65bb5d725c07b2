"""The bench-service metric aggregation on hand-made inputs (no Ray, no model)."""

from __future__ import annotations

import pytest

from services.bench_service import draft_hop, stats_delta, summarize


def test_stats_delta_subtracts_and_slices_batch_sizes():
    before = {"draft_s": 1.0, "verify_s": 2.0, "prefill_s": 0.5, "other_s": 0.1, "steps": 10,
              "draft_rpc_calls": 10, "draft_rpc_s": 0.8, "batch_sizes": [1] * 10}
    after = {"draft_s": 1.5, "verify_s": 3.0, "prefill_s": 0.7, "other_s": 0.2, "steps": 14,
             "draft_rpc_calls": 14, "draft_rpc_s": 1.2, "batch_sizes": [1] * 10 + [4, 4, 3, 1]}
    d = stats_delta(before, after)
    assert d["steps"] == 4 and d["draft_rpc_calls"] == 4
    assert d["draft_s"] == pytest.approx(0.5) and d["draft_rpc_s"] == pytest.approx(0.4)
    assert d["batch_sizes"] == [4, 4, 3, 1]
    # in-process drafter: no RPC counters
    d2 = stats_delta({**before, "draft_rpc_calls": None, "draft_rpc_s": None},
                     {**after, "draft_rpc_calls": None, "draft_rpc_s": None})
    assert d2["draft_rpc_calls"] is None and d2["draft_rpc_s"] is None


def test_summarize_sequential_and_concurrent():
    reqs = [{"tokens": 30, "wall_s": 1.0, "ttft_s": 0.1}, {"tokens": 10, "wall_s": 1.0}]
    seq = summarize(reqs)
    assert seq["new_tokens"] == 40 and seq["wall_s"] == 2.0 and seq["tokens_per_s"] == 20.0
    assert seq["per_request_tokens_per_s_median"] == 20.0
    assert seq["ttft_ms_mean"] == 100.0 and "engine" not in seq
    delta = {"draft_s": 0.2, "verify_s": 0.6, "other_s": 0.1, "prefill_s": 0.3, "steps": 10,
             "draft_rpc_calls": 10, "draft_rpc_s": 0.15, "batch_sizes": [2, 2, 1, 1, 1, 1, 1, 1,
                                                                         1, 1]}
    conc = summarize(reqs, wall_s=1.25, delta=delta)
    assert conc["tokens_per_s"] == 32.0
    e = conc["engine"]
    assert e["draft_ms_per_step"] == 20.0 and e["verify_ms_per_step"] == 60.0
    assert e["tokens_per_step"] == 4.0
    assert e["batch_size_mean"] == 1.2 and e["batch_size_max"] == 2
    assert e["draft_rpc_ms_per_call"] == 15.0
    assert e["draft_outside_rpc_ms_per_step"] == 5.0
    assert e["rank_wait_ms_per_step"] is None  # an in-process runner: no rank calls
    ranks = summarize(reqs, wall_s=1.25, delta={**delta, "rank_wait_s": 0.55,
                                                 "rank_busy_s": 0.5})["engine"]
    assert ranks["rank_wait_ms_per_step"] == 55.0 and ranks["rank_busy_ms_per_step"] == 50.0


def test_summarize_empty_engine_delta_has_no_division_errors():
    s = summarize([], wall_s=0.0, delta={"draft_s": 0.0, "steps": 0, "batch_sizes": [],
                                         "draft_rpc_calls": None, "draft_rpc_s": None})
    assert s["tokens_per_s"] is None and s["engine"]["draft_ms_per_step"] is None
    assert s["engine"]["batch_size_mean"] is None


def test_draft_hop_difference():
    hop = draft_hop({"draft_ms_per_step": 12.5, "draft_rpc_ms_per_call": 11.0,
                     "draft_outside_rpc_ms_per_step": 1.5, "verify_ms_per_step": 40.0},
                    {"draft_ms_per_step": 10.0, "verify_ms_per_step": 39.0})
    assert hop["grpc_hop_ms_per_step"] == 2.5 and hop["worker_over_inprocess"] == 1.25
    assert hop["draft_worker_busy_s"] is None


def test_traffic_per_step_divides_by_steps_and_sums():
    from services.bench_service import traffic_per_step

    delta = {"rank_bytes_out": 1000, "rank_bytes_in": 3000, "draft_bytes_out": None,
             "draft_bytes_in": None}
    per = traffic_per_step(delta, 10)
    assert per == {"rank_bytes_out_per_step": 100, "rank_bytes_in_per_step": 300,
                   "draft_bytes_out_per_step": None, "draft_bytes_in_per_step": None,
                   "bytes_per_step": 400}
    assert traffic_per_step(delta, 0)["bytes_per_step"] is None

