"""Prompt-lookup branches (docs/draft-tree.md "Prompt lookup"): the matcher against a brute-force
reference, the merge into the candidates, valid trees, and losslessness with lookup on."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from conftest import make_engine, random_prompts, run, tiny_target
from test_budget import flat_costs
from test_lossless_sampling import NUM_SAMPLES, chi_square_pvalue, exact_joint

from eagle2.budget import CostModel, SpeculationGate
from eagle2.calibration import Calibration
from eagle2.config import SamplingParams, TreeConfig
from eagle2.lookup import DEFAULT_RATES, Candidates, LookupTable, TokenHistory, add_chains
from eagle2.tree import build_tree

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
FIXED = TreeConfig("eagle2", total_tokens=16, depth=4, top_k=4, budget="fixed", lookup=8)
TREES = {
    "eagle2": FIXED,
    "eagle2-auto": TreeConfig("eagle2", total_tokens=16, depth=4, top_k=4, lookup=8),
    "static": TreeConfig("static", total_tokens=26, budget="fixed", lookup=8),
    "chain": TreeConfig("chain", depth=5, budget="fixed", lookup=8),
}


# ----- the matcher ------------------------------------------------------------------------------
def slow_propose(tokens: list[int], depth: int, max_ngram: int) -> tuple[list[int], int]:
    """The obvious version: for n = max_ngram..1, scan for the latest earlier occurrence of
    the last n tokens; copy what follows it, repeating the copied tokens past the end."""
    num_t = len(tokens)
    for n in range(min(max_ngram, num_t), 0, -1):
        suffix = tokens[num_t - n:]
        for end in range(num_t - 2, n - 2, -1):  # the occurrence ends at `end` < num_t - 1
            if tokens[end - n + 1:end + 1] == suffix:
                seq = list(tokens)
                for i in range(depth):
                    seq.append(seq[end + 1 + i])
                return seq[num_t:], n
    return [], 0


@pytest.mark.parametrize("max_ngram", [1, 3, 4])
def test_matcher_equals_brute_force_on_random_histories(max_ngram):
    g = torch.Generator().manual_seed(max_ngram)
    for trial in range(200):
        vocab = int(torch.randint(2, 12, (), generator=g))
        length = int(torch.randint(0, 60, (), generator=g))
        tokens = torch.randint(0, vocab, (length,), generator=g).tolist()
        hist = TokenHistory(max_ngram)
        cut = int(torch.randint(0, length + 1, (), generator=g))
        hist.extend(tokens[:cut])  # in two pieces, as the drafter's calls come
        hist.extend(tokens[cut:])
        for depth in (1, 5):
            assert hist.propose(depth) == slow_propose(tokens, depth, max_ngram), (trial, tokens)


def test_matcher_examples_and_truncate():
    hist = TokenHistory(4)
    hist.extend([5, 6, 7, 9, 5, 6])
    assert hist.propose(3) == ([7, 9, 5], 2)  # the docstring's example
    loop = TokenHistory(4)
    loop.extend([1, 2, 3, 1, 2])
    assert loop.propose(7) == ([3, 1, 2, 3, 1, 2, 3], 2)  # the copy repeats past the end
    assert TokenHistory().propose(4) == ([], 0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5, (80,), generator=g).tolist()
    full = TokenHistory()
    full.extend(tokens)
    for length in (79, 40, 3, 0):
        full.truncate(length)
        fresh = TokenHistory()
        fresh.extend(tokens[:length])
        assert full.tokens == fresh.tokens and full.index == fresh.index


# ----- values -----------------------------------------------------------------------------------
def test_lookup_table_values_fit_and_json():
    table = LookupTable()
    assert table.rates == DEFAULT_RATES
    assert table.value(9, 1) == table.value(4, 1)  # longer matches use the last row
    assert table.value(4, 10) == pytest.approx(DEFAULT_RATES[3][-1] * table.decay ** 2)
    counts = [[100, 100, 100], [0, 0, 0]]
    fitted = LookupTable.fit(counts, [[50, 60, 10], [0, 0, 0]])
    assert fitted.rates[0] == (0.5, 0.5, 0.1)  # made non-increasing
    assert fitted.rates[1] == DEFAULT_RATES[1]  # nothing measured: the default
    assert LookupTable.from_json(json.loads(json.dumps(fitted.to_json()))) == fitted
    with pytest.raises(ValueError, match="increase"):
        LookupTable(((0.1, 0.2),))


def test_calibration_files_with_and_without_a_lookup_table(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"edges": [-3.0, -1.0], "rates": [0.1, 0.5, 0.9]}))
    calib = Calibration.load(old)
    assert calib.lookup is None
    table = LookupTable(((0.6, 0.4),), num_samples=7)
    new = tmp_path / "new.json"
    Calibration(calib.edges, calib.rates, 5, table).save(new)
    assert Calibration.load(new).lookup == table
    # raw_for: a rate ranks in the first bin that reaches it
    rates = torch.tensor([0.05, 0.3, 0.5, 0.95, 0.0])
    raw = calib.raw_for(rates)
    assert raw[:4].tolist() == pytest.approx([math.exp(-3.5), math.exp(-2), math.exp(-2),
                                              math.exp(-0.5)])
    assert raw[4] == 0
    assert bool((calib(raw[:3]) >= rates[:3]).all())


# ----- merging into the candidates --------------------------------------------------------------
def candidates(tokens, parents, scores, depths) -> Candidates:
    t = torch.tensor([tokens])
    s = torch.tensor([scores])
    return Candidates(t, torch.tensor([parents]), s, torch.tensor([depths]), s.exp(),
                      torch.zeros_like(t, dtype=torch.bool))


def test_add_chains_reuses_what_the_head_proposed():
    # head: a=10, b=11 at depth 1; a0=20 under a at depth 2
    head = candidates([10, 11, 20], [-1, -1, 0], [-0.5, -1.0, -2.0], [1, 1, 2])
    chain = torch.tensor([[10, 30, 31]])  # a (head's), then x=30 under a, y=31 under x
    merged, fresh = add_chains(head, chain, torch.tensor([3]), torch.tensor([[-0.1, -0.2, -0.3]]),
                               torch.tensor([[0.9, 0.8, 0.7]]))
    assert fresh.tolist() == [[False, True, True]]
    # the chain's reused token leaves a non-candidate (-inf) in its column
    assert merged.scores[0].isinf().tolist() == [False, False, True, False, False, False]
    assert merged.tokens.tolist() == [[10, 11, 10, 20, 30, 31]]
    assert merged.parents.tolist() == [[-1, -1, -1, 0, 0, 4]]
    assert merged.depths.tolist() == [[1, 1, 1, 2, 2, 3]]
    assert merged.scores[0, 0] == pytest.approx(-0.1)  # the larger of the two
    assert merged.values[0, 0] == pytest.approx(0.9)
    assert merged.lookup.tolist() == [[False, False, False, False, True, True]]
    tree = build_tree(torch.tensor([1]), merged.tokens, merged.parents, merged.scores,
                      merged.depths, 8, merged.values, merged.lookup)
    assert tree.tokens.tolist() == [[1, 10, 11, 20, 30, 31]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 1, 4]]
    assert tree.values[0].tolist() == pytest.approx([1, 0.9, math.exp(-1), math.exp(-2),
                                                     0.8, 0.7])


def slow_merge(tokens, parents, scores, chain, chain_scores):
    """Lists: walk the chain, reuse (parent, token) matches, append the rest."""
    tokens, parents, scores = list(tokens), list(parents), list(scores)
    lookup = [False] * len(tokens)
    cur = -1
    for tok, score in zip(chain, chain_scores, strict=True):
        hit = [i for i in range(len(tokens)) if parents[i] == cur and tokens[i] == tok]
        if hit:
            scores[hit[0]] = max(scores[hit[0]], score)
            cur = hit[0]
        else:
            tokens.append(tok), parents.append(cur), scores.append(score), lookup.append(True)
            cur = len(tokens) - 1
    return tokens, parents, scores, lookup


def path_of(tokens: list[int], parents: list[int], i: int) -> tuple[int, ...]:
    """A candidate named by the tokens from the root down to it."""
    path = []
    while i >= 0:
        path.append(tokens[i])
        i = parents[i]
    return tuple(path[::-1])


def random_head(g, k: int, depth: int, vocab: int):
    tokens, parents, scores, depths = [], [], [], []
    level = [-1]
    for d in range(1, depth + 1):
        frontier = sorted(level, key=lambda i: -scores[i] if i >= 0 else 0)[:k]
        level = []
        for par in frontier:
            kids = torch.randperm(vocab, generator=g)[:k].tolist()
            for tok in kids:
                lp = -float(torch.rand((), generator=g)) * 2
                tokens.append(tok), parents.append(par), depths.append(d)
                scores.append((scores[par] if par >= 0 else 0.0) + lp)
                level.append(len(tokens) - 1)
    return tokens, parents, scores, depths


def check_tree(tree) -> None:
    """Parents before children, depth = parent depth + 1, the mask is the ancestor relation,
    values never grow down a path, every valid node lies on a retrieve path."""
    for b in range(tree.batch_size):
        n = int(tree.num_nodes[b])
        par, dep = tree.parents[b].tolist(), tree.depths[b].tolist()
        vals, mask = tree.values[b].tolist(), tree.tree_mask[b].tolist()
        assert par[0] == -1 and dep[0] == 0
        assert dep[:n] == sorted(dep[:n])  # depth order
        for i in range(1, n):
            assert 0 <= par[i] < i and dep[i] == dep[par[i]] + 1
            assert vals[i] <= vals[par[i]] + 1e-6
            anc, j = set(), i
            while j >= 0:
                anc.add(j)
                j = par[j]
            assert {j for j in range(n) if mask[i][j]} == anc
        on_paths = {x for p in tree.retrieve_indices[b].tolist() for x in p if x >= 0}
        assert on_paths == set(range(n))


@pytest.mark.parametrize("seed", range(10))
def test_merge_and_build_against_a_slow_reference(seed):
    g = torch.Generator().manual_seed(seed)
    vocab = 6  # few tokens: the chain often walks through the head's candidates
    rows = [random_head(g, 3, 3, vocab) for _ in range(2)]
    width = max(len(r[0]) for r in rows)
    pad = [[], [], [], []]
    for tokens, parents, scores, depths in rows:  # rows of equal width: pad with non-candidates
        extra = width - len(tokens)
        pad[0].append(tokens + [0] * extra)
        pad[1].append(parents + [-1] * extra)
        pad[2].append(scores + [float("-inf")] * extra)
        pad[3].append(depths + [3] * extra)
    t, p, s, d = (torch.tensor(x) for x in pad)
    cands = Candidates(t, p, s, d, s.exp(), torch.zeros_like(t, dtype=torch.bool))
    # chains longer than the head's 3 levels (walked, then added at once), of any length
    chain = torch.randint(0, vocab, (2, 7), generator=g)
    lengths = torch.tensor([7 if seed % 2 else 5, int(torch.randint(0, 8, (), generator=g))])
    chain_scores = torch.tensor([[-0.2, -0.5, -0.9, -1.4, -2.0, -2.1, -2.5]] * 2)
    merged, fresh = add_chains(cands, chain, lengths, chain_scores, chain_scores.exp())
    for b in range(2):
        n = len(rows[b][0])
        ref = slow_merge(*rows[b][:3], chain[b, :lengths[b]].tolist(),
                         chain_scores[b, :lengths[b]].tolist())
        real = merged.scores[b] > float("-inf")
        idx = real.nonzero().flatten().tolist()
        tok, par, sc, lk = (x[b].tolist() for x in (merged.tokens, merged.parents,
                                                     merged.scores, merged.lookup))
        got = sorted((path_of(tok, par, i), round(sc[i], 4), lk[i]) for i in idx)
        want = sorted((path_of(ref[0], ref[1], i), round(ref[2][i], 4), ref[3][i])
                      for i in range(len(ref[0])))
        assert got == want  # the same candidates, up to the depth-order renumbering
        assert int(fresh[b].sum()) == len(ref[0]) - n
    for num_nodes in (4, 12, 64):
        tree = build_tree(torch.tensor([1, 2]), merged.tokens, merged.parents, merged.scores,
                          merged.depths, num_nodes, merged.values, merged.lookup)
        check_tree(tree)
        assert tree.lookup[tree.values == 0].sum() == 0


# ----- the drafter's histories ------------------------------------------------------------------
def test_histories_follow_the_cache_through_rewind_and_release():
    target = tiny_target(seed=3)
    drafter = make_engine(target, 0).drafter
    feats = torch.randn(2, 6, target.config.hidden_size)
    toks = torch.tensor([[1, 2, 3, 1, 2, 0], [4, 5, 6, 7, 8, 9]])
    drafter.draft(["a", "b"], feats, toks, torch.tensor([5, 6]), FIXED)
    assert drafter.histories["a"].tokens == [1, 2, 3, 1, 2]
    assert drafter.histories["b"].tokens == [4, 5, 6, 7, 8, 9]
    tree = drafter.draft(["a"], feats[:1, :1], torch.tensor([[3]]), torch.tensor([1]), FIXED)
    assert drafter.histories["a"].tokens == [1, 2, 3, 1, 2, 3]
    assert bool(tree.lookup.any())  # "1 2 3" is followed by "1 2 3 ..."
    drafter.rewind("a", 2)
    assert drafter.histories["a"].tokens == [1, 2] and drafter.length("a") == 2
    drafter.draft(["a"], feats[:1, :2], torch.tensor([[7, 7]]), torch.tensor([2]), FIXED)
    assert drafter.histories["a"].tokens == [1, 2, 7, 7]
    drafter.release("a")
    assert "a" not in drafter.histories and "b" in drafter.histories
    drafter.draft(["a"], feats[:1, :1], torch.tensor([[5]]), torch.tensor([1]), FIXED)
    assert drafter.histories["a"].tokens == [5]  # a new sequence with that id starts afresh


def test_a_restart_drafts_as_a_fresh_head_over_the_last_positions():
    """More new pairs than catch_up: the head forgets its entries and runs over the last
    catch_up pairs from position 0, which is what a new sequence given only those pairs gets
    (the same trees, then and at the next call); the history keeps every token and a rewind
    counts head entries."""
    target = tiny_target(seed=3)
    drafter = make_engine(target, 0).drafter
    hidden = target.config.hidden_size
    feats, toks = torch.randn(1, 44, hidden), torch.randint(0, 64, (1, 44))
    capped = TreeConfig("eagle2", 16, 4, 4, budget="fixed", lookup=0, catch_up=16)
    whole = replace(capped, catch_up=0)
    drafter.draft(["a"], feats[:, :4], toks[:, :4], torch.tensor([4]), capped)
    got = drafter.draft(["a"], feats[:, 4:40], toks[:, 4:40], torch.tensor([36]), capped)
    want = drafter.draft(["b"], feats[:, 24:40], toks[:, 24:40], torch.tensor([16]), whole)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
    assert drafter.length("a") == 16 and drafter.histories["a"].tokens == toks[0, :40].tolist()
    nxt = [drafter.draft([sid], feats[:, 40:44], toks[:, 40:44], torch.tensor([4]), capped)
           for sid in ("a", "b")]
    assert torch.equal(nxt[0].tokens, nxt[1].tokens)
    assert torch.allclose(nxt[0].values, nxt[1].values)
    drafter.rewind("a", 10)  # 10 head entries: 24 skipped positions + 10
    assert drafter.length("a") == 10
    assert drafter.histories["a"].tokens == toks[0, :34].tolist()
    drafter.release("a")
    assert "a" not in drafter.skipped


def test_a_restart_keeps_the_skipped_tokens_for_lookup():
    target = tiny_target(seed=3)
    drafter = make_engine(target, 0).drafter
    pattern = [5, 9, 13, 17, 21, 25]
    toks = torch.tensor([pattern + list(range(30, 60)) + pattern[:3]])  # 39 pairs
    feats = torch.randn(1, 39, target.config.hidden_size)
    tree = drafter.draft(["a"], feats, toks, torch.tensor([39]), replace(FIXED, catch_up=16))
    assert drafter.length("a") == 16  # the head never saw the pattern's first occurrence
    proposed = tree.tokens[0][tree.lookup[0]].tolist()
    assert proposed[:3] == pattern[3:]  # lookup did: "5 9 13" is followed by "17 21 25"


def test_drafted_trees_take_both_lookup_branches():
    """With an n-gram store whose chain disagrees with prompt lookup's, a drafted tree holds
    lookup nodes of both (the head's candidates cannot outrank values of 0.9), and the
    calibration's log gets the prompt-lookup chain with its fresh flags."""
    import numpy as np

    from eagle2.ngram import NUM_CELLS, NgramStore

    target = tiny_target(seed=3)
    drafter = make_engine(target, 0).drafter
    drafter.ngram = NgramStore.build([([13], [40, 41, 42])] * 3, rates=np.full(NUM_CELLS, 0.9))
    drafter.lookup_table = LookupTable(((0.95, 0.9, 0.85),))
    drafter.lookup_log = []
    toks = torch.tensor([[5, 9, 13, 17, 21, 25, 30, 5, 9, 13]])  # prompt lookup: 17 21 25
    feats = torch.randn(1, 10, target.config.hidden_size)
    tree = drafter.draft(["a"], feats, toks, torch.tensor([10]), replace(FIXED, lookup=3))
    tokens, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()
    under_root = {t for t, p in zip(tokens, parents, strict=True) if p == 0}
    assert {17, 40} <= under_root and {21, 25, 41, 42} <= set(tokens)
    assert bool(tree.lookup[0].any())
    assert [(m, t) for _, _, m, t, _ in drafter.lookup_log] == [(3, [17, 21, 25])]


def test_lookup_off_and_other_modes_add_no_lookup_nodes():
    target = tiny_target(seed=3)
    drafter = make_engine(target, 0).drafter
    feats = torch.randn(1, 6, target.config.hidden_size)
    toks = torch.tensor([[1, 2, 3, 1, 2, 3]])
    for i, tree in enumerate([TreeConfig("eagle2", 16, 4, 4, budget="fixed", lookup=0),
                              TREES["static"], TREES["chain"]]):
        out = drafter.draft([f"s{i}"], feats, toks, torch.tensor([6]), tree)
        assert not bool(out.lookup.any()), tree.mode


# ----- losslessness -----------------------------------------------------------------------------
def copy_prompts(target, n: int, seed: int) -> list[list[int]]:
    """Prompts that contain the target's own greedy continuation (prompt + answer + prompt),
    so that lookup proposes what the target is about to say."""
    prompts = random_prompts(n, target.vocab_size, seed=seed)
    answers = run(make_engine(target, None), prompts, SamplingParams(max_tokens=12),
                  TreeConfig("vanilla"))
    return [p + a + p for p, a in zip(prompts, answers, strict=True)]


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_with_lookup_equals_vanilla_in_every_mode(seed):
    target = tiny_target(vocab=48, seed=30 + seed)
    prompts = copy_prompts(target, 6, seed) + random_prompts(2, 48, seed=seed + 5)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    for name, tree in TREES.items():
        engine = make_engine(target, seed)
        if tree.budget == "auto":
            engine._costs = flat_costs(0.0005)
        assert run(engine, prompts, GREEDY, tree) == vanilla, name
        if tree.mode == "eagle2":
            assert engine.stats.lookup_accepted > 0, name
            assert engine.stats.lookup_offered >= engine.stats.lookup_accepted
        else:
            assert engine.stats.lookup_offered == 0, name
    plain = make_engine(target, seed)
    run(plain, prompts, GREEDY, TreeConfig("eagle2", 16, 4, 4, budget="fixed", lookup=0))
    with_lookup = make_engine(target, seed)
    run(with_lookup, prompts, GREEDY, FIXED)
    assert with_lookup.stats.steps < plain.stats.steps  # the copies are accepted


def shut_gate_costs(per_token: float) -> CostModel:
    """Forward c(B, N) = 0.01 + per_token x B x N s, and a draft level of 1 s: drafting never
    pays, so after their first probe the requests run without draft calls."""
    costs = flat_costs(per_token)
    return replace(costs, draft_level_s=tuple(1.0 for _ in costs.draft_batches))


@pytest.mark.parametrize("seed", [0, 1])
def test_lookup_chains_without_draft_calls_equal_vanilla(seed):
    """The gate shut (drafts cost 1 s a level): greedy auto requests still verify the chains
    prompt lookup proposes where they pay (`Engine._lookup_trees`), with no draft call, and
    their outputs are vanilla's token for token; where a longer forward costs too much for
    what the chains are worth, no chain is verified."""
    target = tiny_target(vocab=48, seed=30 + seed)
    prompts = copy_prompts(target, 6, seed) + random_prompts(2, 48, seed=seed + 5)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    steps = {}
    for name, per_token, alone in [("cheap", 0.0001, True), ("off", 0.0001, False),
                                   ("dear", 0.05, True)]:
        engine = make_engine(target, seed)
        engine._costs = shut_gate_costs(per_token)
        engine.lookup_alone = alone
        calls = []
        draft = engine.drafter.draft
        engine.drafter.draft = lambda *a, calls=calls, draft=draft, **k: (
            calls.append(1) or draft(*a, **k))
        assert run(engine, prompts, GREEDY, TREES["eagle2-auto"]) == vanilla, name
        stats = engine.stats
        steps[name] = stats.steps
        assert stats.skipped_drafts > len(calls), name  # the gate was shut on most steps
        if name == "cheap":
            assert stats.lookup_steps > 0 and stats.lookup_step_accepted > 0
            assert stats.lookup_accepted >= stats.lookup_step_accepted
        else:
            assert stats.lookup_steps == 0 and stats.lookup_step_accepted == 0, name
    assert steps["cheap"] < steps["off"]  # the copies were accepted without the head


def test_lookup_chains_left_out_where_they_lost_lately():
    """Greedy batches whose steps with lookup chains delivered fewer tokens a second than
    their plain steps at that batch size (`Engine._lookup_vetoed`) verify no chains and
    propose none, though the costs say chains pay; outputs stay vanilla's. Without that
    record the same engine takes chains."""
    from eagle2.budget import RealizedRates

    target = tiny_target(vocab=48, seed=30)
    prompts = copy_prompts(target, 4, 0)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    for losing in (False, True):
        engine = make_engine(target, 0)
        engine._costs, engine._timed = shut_gate_costs(0.0001), True
        if losing:
            for size in range(1, len(prompts) + 1):
                record = engine.lookup_realized[size] = RealizedRates(decay=1.0)
                for chains in [True] * 8 + [False] * 8:
                    record.observe(chains, 2 if chains else 1, 0.04 if chains else 0.01)
        proposed = []
        propose = engine._proposals
        engine._proposals = lambda seqs, propose=propose, proposed=proposed: (
            proposed.append(1) or propose(seqs))
        assert run(engine, prompts, GREEDY, TREES["eagle2-auto"]) == vanilla
        stats = engine.stats
        if losing:
            assert stats.lookup_vetoes > 0 and not proposed
            assert stats.lookup_steps == 0  # (drafted trees keep their lookup branches)
        else:
            assert stats.lookup_vetoes == 0 and proposed and stats.lookup_steps > 0


def test_lookup_chains_without_draft_calls_for_sampled_requests_too():
    """Sampled auto requests verify chains on steps without a draft call (reproducibly per
    seed); fixed budgets and lookup=0 get none."""
    target = tiny_target(vocab=48, seed=31)
    prompts = copy_prompts(target, 2, 0)
    sampled = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    outs = []
    for _ in range(2):
        engine = make_engine(target, 0)
        engine._costs = shut_gate_costs(0.0001)
        outs.append(run(engine, prompts, sampled, TREES["eagle2-auto"], seeds=[3, 4]))
        assert engine.stats.lookup_steps > 0 and engine.stats.skipped_drafts > 0
    assert outs[0] == outs[1]
    engine = make_engine(target, 0)
    engine._costs = shut_gate_costs(0.0001)
    run(engine, prompts, GREEDY, replace(TREES["eagle2-auto"], lookup=0))
    assert engine.stats.lookup_steps == 0 and engine.stats.lookup_offered == 0


def test_lookup_over_the_draft_worker_equals_vanilla():
    """The drafter in a DraftService (gRPC on localhost): its histories live in the worker,
    the lookup flags cross the wire."""
    from services.draft_client import RemoteDrafter
    from services.draft_worker import DraftServicer, start_server

    target = tiny_target(vocab=48, seed=33)
    prompts = copy_prompts(target, 4, 3)
    engine = make_engine(target, 0)
    servicer = DraftServicer(engine.drafter, "lookup-test")
    server, port = start_server(servicer, 0)
    try:
        engine.drafter = RemoteDrafter(f"127.0.0.1:{port}")
        got = run(engine, prompts, GREEDY, FIXED)
        assert servicer.draft_requests >= 1
        assert not servicer.drafter.histories  # released with the sequences
    finally:
        server.stop(grace=None)
    assert got == run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    assert engine.stats.lookup_accepted > 0


def test_tree_spec_and_response_keep_old_peers_working():
    """TreeSpec.lookup is optional (an older engine's spec gets the default) and an older
    worker's DraftResponse has no lookup flags (none of its nodes are lookup nodes)."""
    from services import convert
    from services.protos import draft_pb2

    off = TreeConfig(lookup=0)
    assert convert.tree_from_spec(convert.tree_to_spec(off)) == off
    old_spec = draft_pb2.TreeSpec(mode="eagle2", total_tokens=8, depth=2, top_k=2,
                                  draft_window=64, budget="fixed")
    assert convert.tree_from_spec(old_spec).lookup == TreeConfig.lookup
    assert convert.tree_from_spec(old_spec).catch_up == TreeConfig.catch_up
    capped = TreeConfig(catch_up=0)
    assert convert.tree_from_spec(convert.tree_to_spec(capped)) == capped
    head = candidates([10, 11], [-1, -1], [-0.5, -1.0], [1, 1])
    merged, _ = add_chains(head, torch.tensor([[12]]), torch.tensor([1]),
                           torch.tensor([[-0.1]]), torch.tensor([[0.9]]))
    tree = build_tree(torch.tensor([1]), merged.tokens, merged.parents, merged.scores,
                      merged.depths, 8, merged.values, merged.lookup)
    msg = convert.draft_tree_to_proto(tree)
    assert convert.draft_tree_from_proto(msg).lookup.tolist() == tree.lookup.tolist()
    msg.ClearField("lookup")
    assert not bool(convert.draft_tree_from_proto(msg).lookup.any())


VOCAB = 8
REPEATING = [1, 4, 6, 2, 1, 4, 6, 2, 1, 4]  # lookup proposes "6 2 1 ..." after "4"


def sampled_counts(engine, params: SamplingParams, tree: TreeConfig, first_seed: int) -> dict:
    """NUM_SAMPLES sequences after REPEATING, 500 at a time with seeds first_seed, ...: how
    many start with each 3 tokens."""
    counts: dict = {}
    for start in range(0, NUM_SAMPLES, 500):
        seeds = list(range(first_seed + start, first_seed + start + 500))
        for o in run(engine, [REPEATING] * 500, params, tree, seeds=seeds):
            counts[tuple(o[:3])] = counts.get(tuple(o[:3]), 0) + 1
    return counts


@pytest.fixture(scope="module")
def sampling_target():
    return tiny_target(vocab=VOCAB, hidden=32, heads=4, kv_heads=2, seed=21, logit_scale=8.0)


def test_sampling_with_lookup_matches_target_distribution(sampling_target, monkeypatch):
    import test_lossless_sampling as harness

    monkeypatch.setattr(harness, "PROMPT", REPEATING)  # what exact_joint enumerates after
    tree = TreeConfig("eagle2", total_tokens=8, depth=2, top_k=3, budget="fixed", lookup=4)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=3, ignore_eos=True)
    probs = exact_joint(sampling_target, 0.8, 0.95)
    engine = make_engine(sampling_target, head_seed=0, max_batch=500, max_context=64)
    counts = sampled_counts(engine, params, tree, 30000)
    assert engine.stats.lookup_accepted > 100  # lookup nodes took part in the acceptance
    assert chi_square_pvalue(counts, probs, NUM_SAMPLES) > 1e-3


def test_sampled_lookup_chains_without_draft_calls_match_target_distribution(sampling_target,
                                                                            monkeypatch):
    """The gate shut on every step (no draft call, not even a newcomer's probe): every step
    verifies lookup's chain alone, and the sampled sequences still follow the target's
    distribution."""
    import test_lossless_sampling as harness

    monkeypatch.setattr(harness, "PROMPT", REPEATING)
    monkeypatch.setattr(SpeculationGate, "should_draft", lambda self: False)
    tree = TreeConfig("eagle2", total_tokens=8, depth=2, top_k=3, lookup=4)  # auto budget
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=3, ignore_eos=True)
    probs = exact_joint(sampling_target, 0.8, 0.95)
    engine = make_engine(sampling_target, head_seed=0, max_batch=500, max_context=64)
    engine._costs = shut_gate_costs(0.0)
    draft = engine.drafter.draft
    engine.drafter.draft = lambda *a, **k: pytest.fail("a draft call")
    counts = sampled_counts(engine, params, tree, 40000)
    assert engine.stats.lookup_step_accepted > 100  # chains verified alone were accepted
    assert engine.stats.lookup_steps == engine.stats.steps  # every step after the prefills
    engine.drafter.draft = draft
    assert chi_square_pvalue(counts, probs, NUM_SAMPLES) > 1e-3


def test_sampling_with_lookup_is_reproducible_per_seed(sampling_target):
    """Lookup values come from the sequence's own tokens and the table: a seeded request gives
    the same tokens run after run (auto budget), and beside another request (fixed trees)."""
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    auto = TreeConfig("eagle2", total_tokens=8, depth=2, top_k=3, lookup=4)
    outs = []
    for _ in range(2):
        engine = make_engine(sampling_target, 0)
        engine._costs = flat_costs(0.0005)
        outs.append(run(engine, [REPEATING] * 3, params, auto, seeds=[5, 6, 7]))
        assert engine.stats.lookup_offered > 0
    assert outs[0] == outs[1] and outs[0][0] != outs[0][1]
    fixed = replace(auto, budget="fixed")
    alone = run(make_engine(sampling_target, 0), [REPEATING], params, fixed, seeds=[5])
    beside = run(make_engine(sampling_target, 0), [REPEATING, [3, 5, 7, 3, 5]], params, fixed,
                 seeds=[5, 9])
    assert beside[0] == alone[0]
