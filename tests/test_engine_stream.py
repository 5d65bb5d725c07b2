"""The engine replica's stream plumbing without Ray: a lagging caller gets one message with
every step it has not read (`services.engine._merge`), and the loop's time accounting."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from services.engine import LoopTimes, _merge


def event(ids, finished=False, t=0.0, steps=1):
    return {"token_ids": ids, "finished": finished, "finish_reason": "length" if finished
            else None, "num_steps": steps, "accepted_at_depth": {}, "time": t}


def test_merge_joins_tokens_in_order_keeps_the_first_time_and_the_last_totals():
    a, b, c = event([1, 2], t=1.0), event([3], t=2.0, steps=2), event([4, 5], True, 3.0, 3)
    m = _merge(_merge(a, b), c)
    assert m["token_ids"] == [1, 2, 3, 4, 5]
    assert m["time"] == 1.0  # the router's delivery time counts from the oldest token
    assert m["finished"] and m["finish_reason"] == "length" and m["num_steps"] == 3
    assert a["token_ids"] == [1, 2]  # the inputs are not changed


def test_merge_an_error_wins():
    err = {"error": "UNAVAILABLE", "message": "a model shard failed", "finished": True}
    assert _merge(event([1]), err) is err


def test_loop_times_sum_per_step():
    t = LoopTimes()
    t.add(0.020, 0.001, 0.0002)
    t.add(0.030, 0.002, 0.0003)
    d = t.as_dict()
    assert d["loop_steps"] == 2 and d["loop_step_s"] == pytest.approx(0.05)
    assert d["loop_host_s"] == pytest.approx(0.003)
    assert d["loop_dispatch_s"] == pytest.approx(0.0005)
