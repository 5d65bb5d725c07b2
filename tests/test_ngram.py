"""The n-gram store of the target's answers (docs/draft-tree.md "The n-gram store"): its
counts against a brute-force reference, its rates, its file, the choice between its chain and
prompt lookup's, and losslessness (greedy and sampled) with its chains verified."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace
from itertools import pairwise

import numpy as np
import pytest
import torch
from conftest import make_engine, random_prompts, run, tiny_target
from test_lookup import GREEDY, REPEATING, TREES, copy_prompts, sampled_counts, shut_gate_costs
from test_lossless_sampling import NUM_SAMPLES, chi_square_pvalue, exact_joint

from eagle2.budget import SpeculationGate
from eagle2.config import SamplingParams, TreeConfig
from eagle2.ext import ngram_ops
from eagle2.lookup import (
    LookupNode,
    LookupTable,
    TokenHistory,
    lookup_tree_row,
    propose_branches,
    propose_chain,
    propose_chains,
    rank_branches,
)
from eagle2.ngram import (
    FILE_NAME,
    MAX_ORDER,
    MIN_VALUE,
    NUM_CELLS,
    SHARE_BINS,
    TOTAL_EDGES,
    NgramStore,
    fit_rates,
)


# ----- the store against a brute-force reference -----------------------------------------------
def slow_next(answers, ctx: list[int], max_order: int, min_total: int):
    """(token, order, share, total) of the longest context ending ctx seen >= min_total times
    after a prompt tail or inside an answer; the most frequent next token, ties to the smallest
    id. Plain Counters over token tuples: no hashing."""
    for order in range(min(max_order, len(ctx)), 0, -1):
        want = tuple(ctx[-order:])
        nexts: Counter = Counter()
        for tail, answer in answers:
            seq = [*tail, *answer]
            for i in range(max(len(tail), order), len(seq)):
                if tuple(seq[i - order:i]) == want:
                    nexts[seq[i]] += 1
        total = sum(nexts.values())
        if total >= min_total:
            tok, count = min(nexts.items(), key=lambda kv: (-kv[1], kv[0]))
            return tok, order, count / total, total
    return None


def cell_of(order: int, share: float, total: int) -> int:
    sbin = min(int(share * SHARE_BINS), SHARE_BINS - 1)
    tbin = max(i for i, edge in enumerate(TOTAL_EDGES) if total >= edge)
    return ((order - 1) * SHARE_BINS + sbin) * len(TOTAL_EDGES) + tbin


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_store_equals_brute_force_counts(seed):
    rng = random.Random(seed)
    vocab = 6  # few tokens: contexts repeat, ties happen
    answers = [([rng.randrange(vocab) for _ in range(rng.randrange(0, 3))],
                 [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]) for _ in range(40)]
    rates = np.linspace(0.0, 1.0, NUM_CELLS)
    for max_order, min_total in [(MAX_ORDER, 2), (2, 3)]:
        store = NgramStore.build(answers, max_order, min_total, rates)
        for _ in range(200):
            ctx = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
            want = slow_next(answers, ctx, max_order, min_total)
            got = store.next(ctx)
            if want is None:
                assert got is None, ctx
            else:
                tok, order, share, total = want
                assert got == (tok, rates[cell_of(order, share, total)]), (ctx, want)


def test_chain_examples():
    """Every 'p 1 2 3 4' answer continues '1 2' with 3, so the chain after '9 1' is 2 3 4 with
    values the running product of the cells' rates; a value below MIN_VALUE ends it."""
    answers = [([7], [1, 2, 3, 4])] * 3 + [([7], [1, 2, 5])]
    store = NgramStore.build(answers, rates=np.full(NUM_CELLS, 0.5))
    assert store.next([9, 1]) == (2, 0.5)  # "1" then "2" 4 times of 4
    toks, values = store.propose([9, 1], 5)
    assert toks == [2, 3, 4] and values == [0.5, 0.25, 0.125]  # after "4" nothing is known
    assert store.propose([9, 1], 2) == ([2, 3], [0.5, 0.25])
    assert store.propose([8], 3) == ([], [])  # never seen
    low = store.with_rates(np.full(NUM_CELLS, 0.1))
    assert low.propose([9, 1], 5)[0] == [2] and 0.1 * 0.1 < MIN_VALUE
    with pytest.raises(ValueError):
        NgramStore.build([([1], [])])


@pytest.mark.parametrize("seed", [0, 1])
def test_a_batch_of_chains_equals_the_walk_context_by_context(seed, monkeypatch):
    """`propose_many` (csrc/ngram.cpp: one call for a batch) gives each context the tokens and
    values of `propose`'s Python walk, bit for bit: contexts shorter than the longest order,
    empty, unknown; chains cut by depth and by MIN_VALUE (rates from 0.05 to 1). Without the
    native operators it walks in Python, to the same."""
    assert ngram_ops() is not None  # built here: a C++ compiler is part of the set-up
    rng = random.Random(seed)
    vocab = 12
    answers = [([rng.randrange(vocab) for _ in range(rng.randrange(0, 4))],
                 [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]) for _ in range(60)]
    store = NgramStore.build(answers, min_total=1,
                             rates=np.random.default_rng(seed).uniform(0.05, 1.0, NUM_CELLS))
    contexts = [[rng.randrange(vocab + 3) for _ in range(rng.randrange(0, 9))]
                for _ in range(300)]
    long_chains = 0
    for depth in (0, 1, 3, 12):
        want = [store.propose(c, depth) for c in contexts]
        assert store.propose_many(contexts, depth) == want, depth
        long_chains += sum(len(t) >= 3 for t, _ in want)
    assert long_chains > 50  # the chains walk several contexts
    monkeypatch.setattr("eagle2.ngram.ngram_ops", lambda: None)
    assert store.propose_many(contexts, 12) == [store.propose(c, 12) for c in contexts]


def test_fit_rates_cells_fallbacks_and_monotone_shares():
    cells, hits = [], []
    share_cells = [cell_of(2, s / 10 + 0.05, 10) for s in range(SHARE_BINS)]
    for i, cell in enumerate(share_cells):  # rate i/20 with 200 samples each, but bin 5 low
        rate = 0.05 if i == 5 else i / 20
        cells += [cell] * 200
        hits += [True] * round(rate * 200) + [False] * (200 - round(rate * 200))
    cells += [cell_of(3, 0.95, 2)] * 5  # too few: order 3's fallback
    hits += [True] * 5
    rates = fit_rates(np.array(cells), np.array(hits)).reshape(MAX_ORDER, SHARE_BINS, -1)
    measured = rates[1, :, 2]
    assert measured[9] == pytest.approx(0.45)
    assert all(b >= a for a, b in pairwise(measured))  # running max
    assert measured[5] == measured[4]  # the low bin lifted to the one below it
    assert rates[2, 9, 0] == pytest.approx(1.0)  # order 3's overall rate (5 of 5)
    assert rates[0].max() == 0.0  # no sample of order 1


def test_file_round_trip_and_bad_files(tmp_path):
    answers = [([1], [2, 3, 4, 2, 3, 5])] * 2
    store = NgramStore.build(answers).with_rates(np.full(NUM_CELLS, 0.3), {"note": "x"})
    store.save(tmp_path / FILE_NAME)
    back = NgramStore.of_head(tmp_path)
    assert back is not None and back.info["note"] == "x"
    for name in ("keys", "tokens", "cells", "rates"):
        assert np.array_equal(getattr(back, name), getattr(store, name))
    assert back.propose([1], 4) == store.propose([1], 4)
    assert NgramStore.of_head(tmp_path / "nowhere") is None and NgramStore.of_head(None) is None
    np.savez(tmp_path / "bad.npz", keys=store.keys, tokens=store.tokens, cells=store.cells,
             rates=store.rates[:3], max_order=np.int64(4))
    with pytest.raises(ValueError, match="rates"):
        NgramStore.load(tmp_path / "bad.npz")


def test_propose_chain_keeps_the_chain_expected_to_go_further():
    history = TokenHistory()
    history.extend([5, 6, 7, 8, 6])  # prompt lookup: "6" once before, followed by 7 8 6
    table = LookupTable(((0.2, 0.1, 0.05),))
    store = NgramStore.build([([6], [9, 9, 9])] * 3, rates=np.full(NUM_CELLS, 0.9))
    assert propose_chain(history, 3, table) == ([7, 8, 6], [0.2, 0.1, 0.05], 1)
    toks, values, match = propose_chain(history, 3, table, store)
    assert toks == [9, 9, 9] and match == 0 and values[0] == pytest.approx(0.9)
    weak = store.with_rates(np.full(NUM_CELLS, 0.03))  # 0.03 + 0.0009 < 0.35
    assert propose_chain(history, 3, table, weak) == ([7, 8, 6], [0.2, 0.1, 0.05], 1)
    assert propose_chain(history, 0, table, store)[:2] == ([], [])
    # a batch: each history's chain as alone, whatever the others' depths
    other = TokenHistory()
    other.extend([1, 2, 3, 1, 2])
    batch = propose_chains([history, other, history], [3, 4, 0], table, store)
    assert batch == [propose_chain(history, 3, table, store), propose_chain(other, 4, table, store),
                     propose_chain(history, 0, table, store)]
    assert batch[1] == ([3, 1, 2, 3], [0.2, 0.1, 0.05, 0.05 * 0.85], 2)


def test_branches_are_both_chains_the_one_worth_more_first():
    history = TokenHistory()
    history.extend([5, 6, 7, 8, 6])
    table = LookupTable(((0.2, 0.1, 0.05),))
    store = NgramStore.build([([6], [9, 9, 9])] * 3, rates=np.full(NUM_CELLS, 0.9))
    prompt = ([7, 8, 6], [0.2, 0.1, 0.05], 1)
    (first, second), = propose_branches([history], [3], table, store)
    assert first[0] == [9, 9, 9] and first[2] == 0 and second == prompt
    weak = store.with_rates(np.full(NUM_CELLS, 0.03))
    assert propose_branches([history], [3], table, weak)[0][0] == prompt
    assert propose_branches([history], [3], table)[0] == [prompt]
    fresh = TokenHistory()
    fresh.extend([1, 2, 3])  # no earlier match, no known context: no branch at all
    assert propose_branches([fresh, history], [3, 0], table, store) == [[], []]
    # propose_chains is each sequence's first branch
    batch = propose_branches([history, history], [3, 2], table, store)
    assert [b[0] for b in batch] == propose_chains([history, history], [3, 2], table, store)


def test_rank_branches_merges_shared_tokens_and_ranks_by_value():
    # [a=1, b=2] (0.6, 0.3) and [a=1, c=3] (0.5, 0.4): a once (0.6), then c, then b
    nodes = rank_branches([([1, 2], [0.6, 0.3], 2), ([1, 3], [0.5, 0.4], 0)], 8)
    assert nodes == [LookupNode(1, -1, 1, 0.6, False), LookupNode(3, 0, 2, 0.4, True),
                     LookupNode(2, 0, 2, 0.3, False)]
    assert rank_branches([([1, 2], [0.6, 0.3], 2), ([1, 3], [0.5, 0.4], 0)], 2) == nodes[:2]
    # two roots' children; a tie goes to the shallower node, then the earlier branch
    nodes = rank_branches([([4, 5], [0.5, 0.5], 1), ([6], [0.5], 0)], 8)
    assert [(n.token, n.parent) for n in nodes] == [(4, -1), (6, -1), (5, 0)]
    assert lookup_tree_row(9, nodes, [0.5, 0.5, 0.5]) == (
        [9, 4, 6, 5], [-1, 0, 0, 1], [0, 1, 1, 2], [1.0, 0.5, 0.5, 0.5],
        [False, True, True, True])
    assert lookup_tree_row(9, nodes, [0.5]) == ([9, 4], [-1, 0], [0, 1], [1.0, 0.5],
                                               [False, True])
    assert rank_branches([], 4) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_prefix_of_a_ranking_is_a_tree(seed):
    """Random branches (values falling along each): every prefix of the ranking keeps each
    node's parent, and the first n nodes are the n of highest value."""
    rng = random.Random(seed)
    for _ in range(200):
        branches = []
        for _ in range(rng.randint(0, 3)):
            length = rng.randint(1, 6)
            values = sorted((rng.random() for _ in range(length)), reverse=True)
            branches.append(([rng.randint(0, 3) for _ in range(length)], values,
                             rng.randint(0, 2)))
        nodes = rank_branches(branches, 64)
        assert all(n.parent < i for i, n in enumerate(nodes))
        assert [n.value for n in nodes] == sorted((n.value for n in nodes), reverse=True)
        assert len({(n.parent, n.token) for n in nodes}) == len(nodes)
        for n in nodes:
            assert n.depth == (1 if n.parent < 0 else nodes[n.parent].depth + 1)


# ----- in the engine ----------------------------------------------------------------------------
def answers_of(target, prompts) -> list[list[int]]:
    return run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_with_ngram_chains_equals_vanilla(seed):
    """A store built from the target's own greedy answers to these prompts (what the shipped
    one is, for other prompts): with the gate shut its chains are verified on steps without a
    draft call and accepted, and with drafted trees they join the rerank; outputs equal
    vanilla decoding token for token, in fewer steps than prompt lookup alone."""
    target = tiny_target(vocab=48, seed=40 + seed)
    prompts = random_prompts(6, 48, seed=seed + 11)
    vanilla = answers_of(target, prompts)
    store = NgramStore.build([(p[-MAX_ORDER:], a) for p, a in zip(prompts, vanilla,
                                                                   strict=True)],
                             min_total=1, rates=np.full(NUM_CELLS, 0.9))
    steps = {}
    for name, tree, costs, ngram in [("alone", TREES["eagle2-auto"], "shut", store),
                                     ("alone-off", TREES["eagle2-auto"], "shut", None),
                                     ("drafted", TREES["eagle2"], None, store)]:
        engine = make_engine(target, seed)
        engine.ngram = engine.drafter.ngram = ngram
        if costs:
            engine._costs = shut_gate_costs(0.0001)
        assert run(engine, prompts, GREEDY, tree) == vanilla, name
        stats = engine.stats
        steps[name] = stats.steps
        if ngram is not None:
            assert stats.lookup_accepted > 0, name
        if name == "alone":
            assert 0 < stats.ngram_accepted <= stats.lookup_step_accepted
            assert 0 < stats.ngram_chains <= stats.lookup_steps * len(prompts)
        else:
            assert stats.ngram_chains == 0, name  # off, or drafted (counted as lookup nodes)
    assert steps["alone"] < steps["alone-off"]


@pytest.mark.parametrize("seed", [0, 1])
def test_trees_of_both_branches_equal_vanilla(seed):
    """A store of another target's answers, so that its chains and prompt lookup's disagree:
    with the gate shut, steps verify trees of both (a lookup node with two children under
    one parent) while the batch is at most LOOKUP_FORK_BATCH (6 requests, then fewer as they
    finish), and outputs equal vanilla decoding; with one branch a request, never."""
    target = tiny_target(vocab=48, seed=50 + seed)
    prompts = copy_prompts(target, 6, seed)
    vanilla = answers_of(target, prompts)
    other = tiny_target(vocab=48, seed=60 + seed)
    store = NgramStore.build([(p[-MAX_ORDER:], a) for p, a in zip(
        prompts, answers_of(other, prompts), strict=True)], min_total=1,
        rates=np.full(NUM_CELLS, 0.9))
    for branches in (1, 2):
        engine = make_engine(target, seed)
        engine.ngram = engine.drafter.ngram = store
        engine.lookup_branches = branches
        engine._costs = shut_gate_costs(0.0001)
        forks = []
        lookup_trees = engine._lookup_trees

        def record(idx, lookup_trees=lookup_trees, forks=forks, engine=engine):
            tree = lookup_trees(idx)
            for row in tree.parents.tolist():
                kids = Counter(p for p in row if p >= 0)
                if max(kids.values(), default=0) > 1:
                    forks.append(len(engine.seqs))
            return tree

        engine._lookup_trees = record
        assert run(engine, prompts, GREEDY, TREES["eagle2-auto"]) == vanilla, branches
        assert engine.stats.lookup_steps > 0 and engine.stats.lookup_step_accepted > 0
        assert bool(forks) == (branches == 2), branches
        assert max(forks, default=0) <= engine.LOOKUP_FORK_BATCH  # one chain at larger batches


def test_chains_a_sampled_request_keeps_failing_are_verified_less():
    """A store built from answers the target does not write (random ones, rated 0.9): its
    chains promise much and are rarely accepted. Each sampled request learns that from its
    own chain steps (`Engine._chain_scale`) and verifies chains on fewer steps than an
    engine that takes the store's word, reproducibly per seed; greedy requests take the
    store's word (its rates are fitted on greedy answers)."""
    target = tiny_target(vocab=48, seed=44)
    prompts = random_prompts(4, 48, seed=12)
    rng = random.Random(3)
    answers = [(p[-MAX_ORDER:], [rng.randrange(48) for _ in range(40)]) for p in prompts]
    store = NgramStore.build(answers * 3, min_total=1, rates=np.full(NUM_CELLS, 0.9))
    sampled = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True)
    steps, outs = {}, {}
    for name in ("scaled", "again", "trusting", "greedy", "greedy-trusting"):
        engine = make_engine(target, 0)
        engine.ngram = engine.drafter.ngram = store
        engine._costs = shut_gate_costs(0.002)  # a chain token pays from ~0.45 accepted
        if name.endswith("trusting"):
            engine._chain_scale = lambda s: 1.0
        params = GREEDY if name.startswith("greedy") else sampled
        outs[name] = run(engine, prompts, params, TREES["eagle2-auto"], seeds=[1, 2, 3, 4])
        steps[name] = engine.stats.lookup_steps
    assert outs["scaled"] == outs["again"]
    assert 0 < steps["scaled"] < steps["trusting"], steps
    assert steps["greedy"] == steps["greedy-trusting"] > 0
    assert outs["greedy"] == outs["greedy-trusting"]


def test_sampled_ngram_chains_without_draft_calls_match_target_distribution(monkeypatch):
    """Every step verifies the store's chain alone (gate shut, store rated above prompt
    lookup), and the sampled sequences still follow the target's distribution."""
    import test_lossless_sampling as harness

    target = tiny_target(vocab=8, hidden=32, heads=4, kv_heads=2, seed=21, logit_scale=8.0)
    monkeypatch.setattr(harness, "PROMPT", REPEATING)
    monkeypatch.setattr(SpeculationGate, "should_draft", lambda self: False)
    tree = TreeConfig("eagle2", total_tokens=8, depth=2, top_k=3, lookup=4)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=3, ignore_eos=True)
    probs = exact_joint(target, 0.8, 0.95)
    greedy = answers_of(target, [REPEATING])[0]
    store = NgramStore.build([(REPEATING[-MAX_ORDER:], greedy)], min_total=1,
                             rates=np.full(NUM_CELLS, 0.95))
    proposed = []
    real = NgramStore.propose_many
    monkeypatch.setattr(NgramStore, "propose_many", lambda self, contexts, depth: (
        proposed.append(1) or real(self, contexts, depth)))
    engine = make_engine(target, head_seed=0, max_batch=500, max_context=64)
    engine.ngram = store
    engine._costs = shut_gate_costs(0.0)
    engine.drafter.draft = lambda *a, **k: pytest.fail("a draft call")
    counts = sampled_counts(engine, params, tree, 50000)
    assert proposed and engine.stats.ngram_accepted > 100
    assert engine.stats.lookup_steps == engine.stats.steps
    assert chi_square_pvalue(counts, probs, NUM_SAMPLES) > 1e-3


def test_a_store_of_another_vocabulary_is_refused():
    """A store whose ids the target has no embedding for (built for another tokenizer) is
    refused when the engine is made, given to it or carried by its drafter."""
    from eagle2.drafter import Drafter
    from eagle2.engine import Engine

    engine = make_engine(tiny_target(vocab=48, seed=45), 0)
    store = NgramStore.build([([1], [2, 300, 4])] * 2)
    with pytest.raises(ValueError, match=r"up to 300, but the target's vocabulary has 48"):
        Engine(engine.runner, None, ngram=store)
    engine.drafter.ngram = store
    with pytest.raises(ValueError, match="another tokenizer"):
        Engine(engine.runner, engine.drafter)
    with pytest.raises(ValueError, match="another tokenizer"):  # the drafter's is checked too
        Engine(engine.runner, engine.drafter, ngram=NgramStore.build([([1], [2, 3, 4])] * 2))
    engine.drafter.head.ngram = store
    with pytest.raises(ValueError, match="another tokenizer"):
        Drafter(engine.drafter.head, engine.drafter.embed, None, max_slots=1, max_len=16)


def test_the_shipped_head_loads_its_store():
    from eagle2.api import shipped_head_dir
    from eagle2.head import load_head
    from eagle2.target import EMBEDDED_NAME

    path = shipped_head_dir(EMBEDDED_NAME)
    head = load_head(path)
    assert isinstance(head.ngram, NgramStore) and len(head.ngram) > 100_000
    checked = head.ngram.info["held_out"]
    assert checked["covered"] > 100_000
    assert abs(checked["hit_rate"] - checked["predicted"]) < 0.03  # rates fit held-out answers


def test_build_ngram_command(tmp_path, capsys):
    """`eagle2 build-ngram` over a data directory: a held-out fit, the store in the head
    directory, the report in its info."""
    from eagle2.cli import main

    rng = random.Random(0)
    phrases = [[rng.randrange(100) for _ in range(6)] for _ in range(5)]
    convs = [{"prompt": "p", "prompt_ids": [1, 2, 3], "temperature": 0.0,
              "answer_ids": [t for _ in range(4) for t in rng.choice(phrases)]}
             for _ in range(60)]
    (tmp_path / "data" / "conversations").mkdir(parents=True)
    (tmp_path / "data" / "conversations" / "chunk_00000.json").write_text(json.dumps(convs))
    head = tmp_path / "head"
    head.mkdir()
    assert main(["build-ngram", "--data", str(tmp_path / "data"), "--out", str(head),
                 "--holdout", "5"]) == 0
    store = NgramStore.of_head(head)
    assert store is not None and store.info["conversations"] == 60
    assert store.info["held_out"]["covered"] > 0
    assert "wrote" in capsys.readouterr().out
    toks, values = store.propose(phrases[0][:4], 2)
    assert toks == phrases[0][4:6] and values[0] > 0.5  # inside a phrase the next is certain
    with pytest.raises(SystemExit):
        main(["build-ngram", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "no")])


def test_the_tensor_values_reach_the_tree():
    """Chains from the store join a drafted tree with their own values."""
    target = tiny_target(vocab=48, seed=44)
    engine = make_engine(target, 0)
    store = NgramStore.build([([1], [2, 3, 4])] * 2, rates=np.full(NUM_CELLS, 0.99))
    engine.drafter.ngram = store
    feats = torch.randn(1, 2, target.config.hidden_size)
    tree = engine.drafter.draft(["x"], feats, torch.tensor([[9, 1]]), torch.tensor([2]),
                                replace(TREES["eagle2"], total_tokens=8))
    looked = tree.tokens[0][tree.lookup[0]].tolist()
    assert looked[:1] == [2] or 2 in tree.tokens[0].tolist()
    values = dict(zip(tree.tokens[0].tolist(), tree.values[0].tolist(), strict=True))
    assert values[2] == pytest.approx(0.99, abs=1e-3)
