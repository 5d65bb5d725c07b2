"""The measured default thread count (eagle2.threads): the choice, the cache, what sets it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import save_tiny_target, tiny_target

from eagle2 import threads as thr


def test_choose_prefers_fewer_threads_unless_more_are_clearly_faster():
    assert thr.choose({1: 0.030, 2: 0.029}) == 1  # within GAIN: fewer threads
    assert thr.choose({1: 0.030, 2: 0.020}) == 2
    assert thr.choose({1: 0.030, 2: 0.031, 4: 0.020}) == 4
    assert thr.choose({1: 0.020, 2: 0.030}) == 1
    assert thr.candidates(1) == [1] and thr.candidates(2) == [1, 2]
    assert thr.candidates(6) == [1, 2, 4, 6] and thr.candidates(8) == [1, 2, 4, 8]


def test_an_explicit_count_in_the_environment_wins(monkeypatch):
    monkeypatch.delenv("EAGLE2_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert thr.requested() is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert thr.requested() == 3
    monkeypatch.setenv("EAGLE2_THREADS", "1")
    assert thr.requested() == 1
    monkeypatch.setenv("EAGLE2_THREADS", "auto")  # not a count: the next source
    assert thr.requested() == 3


def test_auto_threads_are_measured_once_cached_and_set_before_the_next_load(tmp_path,
                                                                           monkeypatch):
    """A real load of a saved model: the first measures every candidate count with real
    decode steps and caches the fastest; the next reads it (no measuring) and sets it; an
    explicit count and threads=None are left as given. Output is the same at any count."""
    from eagle2.api import Eagle2
    from eagle2.config import SamplingParams

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("EAGLE2_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    model = save_tiny_target(tiny_target(seed=3), tmp_path / "m")
    before = torch.get_num_threads()
    measured = []
    real = thr.measure

    def spy(llm, counts, rounds=thr.ROUNDS):
        timings = real(llm, counts, rounds)
        measured.append(timings)
        return timings

    monkeypatch.setattr(thr, "measure", spy)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    try:
        first = Eagle2.load(model, "untrained", dtype="float32", device="cpu")
        assert len(measured) == 1 and set(measured[0]) == set(thr.candidates(before))
        assert all(0 < s < 1 for s in measured[0].values())
        chosen = thr.choose(measured[0])
        assert torch.get_num_threads() == chosen
        saved = json.loads(thr.cache_path(first.target).read_text())
        assert saved["threads"] == chosen and set(saved["step_ms"]) == {
            str(n) for n in thr.candidates(before)}
        assert first.engine.stats.steps == 0  # the probe's steps were not kept
        out = first.generate_ids([first.request([1, 2, 3], params)])[0].token_ids

        torch.set_num_threads(before)
        second = Eagle2.load(model, "untrained", dtype="float32", device="cpu")
        assert len(measured) == 1 and torch.get_num_threads() == chosen
        assert second.generate_ids([second.request([1, 2, 3], params)])[0].token_ids == out

        torch.set_num_threads(before)
        Eagle2.load(model, "untrained", dtype="float32", device="cpu", threads=None)
        assert torch.get_num_threads() == before and len(measured) == 1
        Eagle2.load(model, "untrained", dtype="float32", device="cpu", threads=1)
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("EAGLE2_THREADS", str(before))
        torch.set_num_threads(1)
        Eagle2.load(model, "untrained", dtype="float32", device="cpu")
        assert torch.get_num_threads() == before and len(measured) == 1
        with pytest.raises(ValueError, match="threads must be >= 1"):
            Eagle2.load(model, "untrained", dtype="float32", device="cpu", threads=0)
    finally:
        torch.set_num_threads(before)
