"""Sampling is lossless: EAGLE-2 draws exact samples of the target's processed distribution.

On a tiny model with an 8-token vocabulary the exact joint distribution of the first three
new tokens is enumerated (8^3 outcomes) with an independent numpy implementation of
temperature + top-p, and compared with 4000 EAGLE-2 samples by a chi-square test. The first
token comes from the prefill; tokens 2 and 3 come from tree verification, where acceptance,
rejection, the residual and the bonus token all occur. A verifier that draws the bonus token
from the unprocessed softmax (the reference's old bug) must fail the same test.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import make_engine, run, tiny_target

import eagle2.runner
from eagle2.config import SamplingParams, TreeConfig
from eagle2.verify import draw, verify_batch

VOCAB = 8
PROMPT = [1, 4, 6, 2]
NUM_SAMPLES = 4000
SEED_BASE = 20000
TREE = TreeConfig("eagle2", total_tokens=6, depth=2, top_k=3, budget="fixed")


def processed(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, dtype=bool)
    keep[order[before < top_p]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def exact_joint(target, temperature: float, top_p: float, length: int = 3) -> dict:
    """P(x1..xn) by enumeration with HF full forwards (no cache, no trees)."""
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=length):
        ids = torch.tensor([PROMPT + list(seq[:-1])])
        with torch.no_grad():
            logits = target.hf(ids).logits[0, -length:].numpy()
        p = 1.0
        for i, tok in enumerate(seq):
            p *= processed(logits[i], temperature, top_p)[tok]
        probs[seq] = p
    return probs


def chi_square_pvalue(counts: dict, probs: dict, n: int) -> float:
    from scipy.stats import chi2

    cells = sorted(probs, key=lambda s: -probs[s])
    stat, dof, rest_e, rest_o = 0.0, 0, 0.0, 0
    for s in cells:
        e = probs[s] * n
        if e >= 5:
            stat += (counts.get(s, 0) - e) ** 2 / e
            dof += 1
        else:
            rest_e += e
            rest_o += counts.get(s, 0)
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        dof += 1
    return float(chi2.sf(stat, dof - 1))


def sample_counts(target, params: SamplingParams,
                  head_kind: str = "eagle2") -> tuple[dict, list[int]]:
    engine = make_engine(target, head_seed=0, max_batch=500, max_context=64, head_kind=head_kind)
    counts: dict = {}
    for start in range(0, NUM_SAMPLES, 500):
        seeds = list(range(SEED_BASE + start, SEED_BASE + start + 500))
        outs = run(engine, [PROMPT] * 500, params, TREE, seeds=seeds)
        for o in outs:
            counts[tuple(o[:3])] = counts.get(tuple(o[:3]), 0) + 1
    return counts, engine.stats.batch_sizes


def test_draw_follows_the_distribution_and_never_picks_a_zero(monkeypatch):
    """`draw` (one uniform through the inverse cumulative sum) against the exact frequencies of
    an unnormalised p with zeros inside and at both ends; where u x total rounds up to the
    total it takes the last token of positive p."""
    from scipy.stats import chisquare

    p = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 1e-3, 2.5, 0.0, 0.0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    counts = np.bincount([draw(p, gen) for _ in range(20000)], minlength=len(p))
    assert counts[p.numpy() == 0].sum() == 0
    keep = p.numpy() > 0
    expected = p.numpy()[keep] / p.sum().item() * counts.sum()
    assert chisquare(counts[keep], expected).pvalue > 1e-3
    assert draw(torch.tensor([0.0, 0.0, 2.0, 0.0], dtype=torch.float64), gen) == 2
    # u = 1 (beyond torch.rand's range): as if u x total had rounded up to the total
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert draw(p, gen) == 6  # the last token of positive p, not the zeros after it


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=VOCAB, hidden=32, heads=4, kv_heads=2, seed=21, logit_scale=8.0)


@pytest.mark.parametrize("temperature, top_p", [(0.7, 0.95), (1.0, 0.9)])
def test_eagle2_sampling_matches_target_distribution(target, temperature, top_p):
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=3, ignore_eos=True)
    probs = exact_joint(target, temperature, top_p)
    counts, _ = sample_counts(target, params)
    assert sum(counts.values()) == NUM_SAMPLES
    assert chi_square_pvalue(counts, probs, NUM_SAMPLES) > 1e-3


def test_eagle3_head_sampling_matches_target_distribution(target):
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=3, ignore_eos=True)
    probs = exact_joint(target, 0.7, 0.95)
    counts, _ = sample_counts(target, params, head_kind="eagle3")
    target.set_feature_layers(None)
    assert sum(counts.values()) == NUM_SAMPLES
    assert chi_square_pvalue(counts, probs, NUM_SAMPLES) > 1e-3


def test_wrong_bonus_distribution_is_caught(target, monkeypatch):
    def buggy(*args, **kwargs):
        # only in tree verification (not the prefill's one-node draw) and only at accepted
        # non-root leaves (`verify_sampling`), so the test proves that it examines the bonus
        # token of accepted paths
        return verify_batch(*args, **kwargs, bonus_from_raw=True)

    monkeypatch.setattr(eagle2.runner, "verify_batch", buggy)  # where the runner calls it
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=3, ignore_eos=True)
    probs = exact_joint(target, 0.7, 0.95)
    counts, _ = sample_counts(target, params)
    assert chi_square_pvalue(counts, probs, NUM_SAMPLES) < 1e-5


def test_sampling_is_reproducible_per_seed(target):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a = run(make_engine(target, 0), [PROMPT] * 3, params, TREE, seeds=[5, 6, 7])
    b = run(make_engine(target, 0), [PROMPT] * 3, params, TREE, seeds=[5, 6, 7])
    assert a == b and a[0] != a[1]


def test_greedy_and_sampling_requests_share_a_batch(target):
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = run(make_engine(target, 0), [PROMPT], greedy, TREE)[0]
    engine = make_engine(target, 0)
    from eagle2.engine import Request

    engine.add(Request("g", tuple(PROMPT), greedy, TREE))
    engine.add(Request("s", tuple(PROMPT), SamplingParams(temperature=1.0, seed=1, max_tokens=12,
                                                          ignore_eos=True), TREE))
    out = {"g": [], "s": []}
    while engine.has_work():
        for ev in engine.step():
            out[ev.seq_id].extend(ev.token_ids)
    assert out["g"] == alone
