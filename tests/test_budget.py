"""The cost-aware tree budget: choice, pruning, calibration, the gate, and losslessness."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import make_engine, random_prompts, run, tiny_target

from eagle2.budget import HEAD_ROWS, CostModel, SpeculationGate, choose_num_nodes, draft_key
from eagle2.calibration import Calibration, _pool_adjacent_violators, accepted_nodes
from eagle2.config import SamplingParams, TreeConfig
from eagle2.engine import Request
from eagle2.tree import HOST, build_tree, finish_tree, prune_tree

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
AUTO = TreeConfig("eagle2", total_tokens=16, depth=4, top_k=4)  # budget "auto"


def flat_costs(per_token: float = 0.0, base: float = 0.01) -> CostModel:
    """c(B, N) = base + per_token x B x N seconds; a draft level costs base / 1000 x B."""
    nodes, batches = (1, 2, 4, 8, 16, 32), (1, 2, 4, 8, 16)
    return CostModel(batches, nodes, tuple(tuple(base + per_token * b * n for n in nodes)
                                           for b in batches),
                     draft_batches=batches, draft_level_s=tuple(base / 1000 * b for b in batches))


# ----- choosing N ---------------------------------------------------------------------------
def test_choose_num_nodes_worked_example():
    costs = CostModel((1,), (1, 2, 3, 4), ((0.05, 0.052, 0.055, 0.07),))
    choice = choose_num_nodes(torch.tensor([[1.0, 0.9, 0.5, 0.1]]), costs, draft_s=0.01)
    assert choice.num_nodes == 3
    assert choice.expected_tokens == pytest.approx(2.4)
    assert choice.rate == pytest.approx(2.4 / 0.065)
    assert choice.plain_rate == pytest.approx(1 / 0.05) and choice.pays


def test_choose_num_nodes_plain_when_drafts_are_hopeless():
    costs = CostModel((1,), (1, 8), ((0.05, 0.2),))
    choice = choose_num_nodes(torch.tensor([[1.0, 0.05, 0.01, 0.0]]), costs, draft_s=0.02)
    assert choice.num_nodes == 1 and not choice.pays


def test_choose_num_nodes_respects_fixed_minimum_and_batch():
    costs = flat_costs(0.001)
    values = torch.tensor([[1.0, 0.9, 0.8, 0.0], [1.0, 0.2, 0.1, 0.0]])
    choice = choose_num_nodes(values, costs, 0.0, min_nodes=4)
    assert choice.num_nodes == 4


def test_cost_model_interpolates_and_round_trips():
    m = CostModel((1, 4), (1, 4), ((1.0, 4.0), (2.0, 8.0)))
    assert m(1, 2) == pytest.approx(2.0) and m(4, 4) == pytest.approx(8.0)
    assert m(2, 1) == pytest.approx(1 + 1 / 3)  # between batches 1 and 4
    assert m(1, 8) == pytest.approx(8.0)  # linear past the last point
    assert CostModel.from_json(m.to_json()) == m


def test_cost_model_reads_costs_at_the_batch_context():
    m = CostModel((1,), (1, 4), ((1.0, 2.0),), prefix=64, long_prefix=512,
                  long_seconds=((3.0, 4.0),))
    assert m(1, 1, 64) == pytest.approx(1.0) and m(1, 4, 512) == pytest.approx(4.0)
    assert m(1, 1, 288) == pytest.approx(2.0)  # halfway
    assert m(1, 1, 960) == pytest.approx(5.0)  # linear past the long grid
    assert m(1, 1, 0) == pytest.approx(0.714, abs=1e-3)  # and below the short one
    assert m(1, 4) == pytest.approx(2.0)  # no context: the short grid
    assert CostModel.from_json(m.to_json()) == m
    old = {k: v for k, v in m.to_json().items() if not k.startswith("long")}
    assert CostModel.from_json(old)(1, 1, 512) == pytest.approx(1.0)  # one grid: flat


def test_choice_follows_the_context():
    """Verifying 4 tokens costs 2x one token after a short context, 1.2x after a long one
    (the attention over the prefix is shared): the same tree pays only in the long one."""
    costs = CostModel((1,), (1, 2, 4), ((0.05, 0.08, 0.10),), prefix=64, long_prefix=512,
                      long_seconds=((0.10, 0.11, 0.12),))
    values = torch.tensor([[1.0, 0.5, 0.3, 0.2]])
    short, long = (choose_num_nodes(values, costs, 0.0, context=c) for c in (64, 512))
    assert not short.pays
    assert long.pays and long.num_nodes == 4 and long.rate == pytest.approx(2.0 / 0.12)


def test_speculation_pays_only_past_the_margin():
    from eagle2.budget import SPECULATION_MARGIN, BudgetChoice

    assert not BudgetChoice(4, 2.0, 10.0 * (1 + SPECULATION_MARGIN / 2), 10.0).pays
    assert BudgetChoice(4, 2.0, 10.0 * (1 + 2 * SPECULATION_MARGIN), 10.0).pays


def test_the_draft_cost_key_follows_a_swapped_drafter():
    """The engine computes the drafter's cost key once per drafter, not once for good."""
    engine = make_engine(tiny_target(seed=2), 0)
    assert engine._draft_key == draft_key(engine.drafter) != "remote"
    engine.drafter = object()  # e.g. a drafter another tool put in (no head: "remote")
    assert engine._draft_key == "remote"


def test_cost_model_measures_a_runner_without_touching_committed_entries():
    target = tiny_target()
    engine = make_engine(target, 0, max_batch=2, max_context=64)
    engine.runner.cache.lengths[:] = torch.tensor([5, 0])
    before = engine.runner.cache.k[:, 0, :, :5].clone()
    m = CostModel.measure(engine.runner, max_batch=2, max_nodes=4, prefix=8, long_prefix=32,
                          repeats=1)
    assert m.batches == (1, 2) and m.nodes == (1, 2, 3, 4) and m.long_prefix == 32
    for grid in (m.seconds, m.long_seconds):
        assert all(row[i] <= row[i + 1] for row in grid for i in range(3))
    assert all(a <= b for r, q in zip(m.seconds, m.long_seconds, strict=True)
               for a, b in zip(r, q, strict=True))
    assert engine.runner.cache.lengths.tolist() == [5, 0]
    assert torch.equal(engine.runner.cache.k[:, 0, :, :5], before)
    # the lm_head timed apart; this target has no greedy head (`GreedyArgmax` needs bf16)
    assert m.head_rows == HEAD_ROWS and not m.head_greedy_s and not engine.runner.greedy_argmax
    assert all(a <= b for a, b in zip(m.head_logits_s, m.head_logits_s[1:], strict=False))


def test_greedy_costs_trade_the_logits_of_every_row_for_the_argmax_of_a_few():
    costs = CostModel((1, 2), (1, 8), ((0.010, 0.030), (0.020, 0.060)), head_rows=(1, 4, 16),
                      head_logits_s=(0.001, 0.004, 0.016), head_greedy_s=(0.0005, 0.002, 0.008))
    # 1 x 8: 30 ms less the logits of 8 rows (8 ms), plus the argmax of 2 rows (1 ms)
    assert costs.greedy(1, 8) == pytest.approx(0.030 - 0.008 + 0.001)
    assert costs.greedy(1, 1) == pytest.approx(0.010 - 0.001 + 0.0005)
    assert costs.greedy(2, 8) == pytest.approx(0.060 - 0.016 + 0.002)  # 16 rows, then 4
    # a first round of up to 16 rows (`GreedyArgmax.first_rows`): 8 of 1 x 8, 16 of 2 x 8
    assert costs.greedy(1, 8, first_rows=16) == pytest.approx(0.030 - 0.008 + 0.004)
    assert costs.greedy(2, 8, first_rows=16) == pytest.approx(0.060 - 0.016 + 0.008)
    assert costs.greedy(1, 1, first_rows=16) == costs.greedy(1, 1)
    assert CostModel.from_json(costs.to_json()) == costs
    without = replace(costs, head_greedy_s=())
    assert without.greedy(2, 8) == without(2, 8) == costs(2, 8)


def test_the_engine_prices_greedy_batches_without_logits_where_the_runner_takes_them():
    """The budget and the measured scales read `CostModel.greedy` for batches the runner
    verifies through its greedy argmax, and the grid's costs for any other batch."""
    engine = make_engine(tiny_target(seed=3), 0, max_batch=2, max_context=64)
    costs = replace(flat_costs(0.001), head_rows=(1, 64), head_logits_s=(0.0005, 0.032),
                    head_greedy_s=(0.0002, 0.0128))
    engine._costs = costs
    engine.add(Request("g", (1, 2, 3), GREEDY, AUTO))
    engine.step()
    assert engine._forward_costs(costs) == costs  # no greedy head: the logits are computed
    engine.runner.target.backend.greedy_head = object()  # what a bf16 target's `fuse` sets
    assert engine._forward_costs(costs) == costs.greedy
    assert engine._timed_costs(costs)(1, 8) == pytest.approx(costs.greedy(1, 8))
    # a greedy head whose first round takes 16 rows: priced so
    engine.runner.target.backend.greedy_head = SimpleNamespace(first_rows=16)
    assert engine._forward_costs(costs)(1, 8) == costs.greedy(1, 8, first_rows=16)
    assert costs.greedy(1, 8, first_rows=16) > costs.greedy(1, 8)
    engine.add(Request("s", (4, 5), SamplingParams(temperature=1.0, seed=1, max_tokens=4), AUTO))
    engine.runner.target.backend.greedy_head = None
    engine.step()
    engine.runner.target.backend.greedy_head = object()
    assert len(engine.seqs) == 2 and engine._forward_costs(costs) == costs  # one is sampled


def test_cached_costs_without_a_long_grid_are_measured_again(tmp_path):
    target = tiny_target()
    engine = make_engine(target, 0, max_batch=1, max_context=64)
    path = tmp_path / "costs.json"
    CostModel((1,), (1, 2), ((0.5, 0.6),), prefix=8).save(path)
    same = CostModel.cached(engine.runner, 1, path, prefix=8)
    assert same.seconds == ((0.5, 0.6),)  # no long grid wanted: read as it is
    fresh = CostModel.cached(engine.runner, 1, path, prefix=8, long_prefix=32)
    assert fresh.long_prefix == 32 and fresh.seconds[0][0] < 0.5
    assert CostModel.from_json(__import__("json").loads(path.read_text())) == fresh


def test_gate_backs_off_and_resets():
    gate = SpeculationGate(max_backoff=8)
    verdicts = []
    for pays in (False, False, False, False, True):
        while not gate.should_draft():
            verdicts.append("skip")
        gate.record(pays)
        verdicts.append(pays)
    assert verdicts == [False, "skip", "skip", False] + ["skip"] * 4 + [False] + ["skip"] * 8 \
        + [False] + ["skip"] * 8 + [True]
    assert gate.should_draft() and gate.backoff == 0


def test_a_failed_probe_backs_off_until_its_price_is_a_small_share():
    """The docstring's example: a batch-8 step predicted to lose 19.6 ms against plain steps of
    61.6 ms backs off 16 steps (2% of them pays for it), not 2; a step that gains (or loses
    nothing) keeps the doubling; the gate takes the larger of the two."""
    from eagle2.budget import PROBE_BUDGET, BudgetChoice, probe_backoff

    plain_s = 0.0616
    plain = 8 / plain_s
    expected = 11.28
    rate = 1 / (1 / plain + 0.0196 / expected)  # E / rate - E / plain = 19.6 ms
    lossy = BudgetChoice(2, expected, rate, plain, plain_s)
    assert lossy.price == pytest.approx(0.0196) and not lossy.pays
    assert probe_backoff(lossy) == math.ceil(0.0196 / (PROBE_BUDGET * plain_s)) == 16
    assert probe_backoff(BudgetChoice(2, expected, plain * 1.02, plain, plain_s)) == 0
    # pruned to the root: the price is the draft time, 5 ms against 61.6 -> 5 steps
    root = BudgetChoice(1, 8.0, 8 / (plain_s + 0.005), plain, plain_s)
    assert root.price == pytest.approx(0.005) and probe_backoff(root) == 5
    # the measured draft call replaces the predicted levels (5 ms): 35 ms with the head's
    # catch-up over the plain steps' backlog -> 29 steps
    root = replace(root, draft_s=0.005)
    assert probe_backoff(root, draft_call_s=0.035) == math.ceil(
        0.035 / (PROBE_BUDGET * plain_s) - 1e-9) == 29
    assert probe_backoff(root, draft_call_s=0.001) == 5  # never below the predicted price
    capped = SpeculationGate(max_backoff=8)
    capped.record(False, 20)
    assert capped.backoff == 20  # the price's minimum passes max_backoff ...
    capped.record(False, 100)
    assert capped.backoff == 32  # ... up to 4x
    gate = SpeculationGate()
    gate.record(False, probe_backoff(lossy))
    assert gate.backoff == 16
    gate.record(False, 3)
    assert gate.backoff == 32  # doubling beats the minimum
    choice = choose_num_nodes(torch.tensor([[1.0, 0.01, 0.0]]), CostModel((1,), (1, 2, 3), (
        (0.05, 0.07, 0.09),)), draft_s=0.004)
    assert choice.plain_s == pytest.approx(0.05) and choice.num_nodes == 1
    assert probe_backoff(choice) == math.ceil(0.004 / (PROBE_BUDGET * 0.05))


@pytest.mark.parametrize("certain_drafts_could_pay", [True, False])
def test_a_join_probes_the_newcomer_only(certain_drafts_could_pay):
    """With the gate backed off (no tree pays: 50 ms a token), a request that joins the batch
    is drafted for at its first step, the others are not, where certain drafts of its alone
    could pay at that batch (a 50 ms step and 2 ms a token); where even they could not
    (50 ms a token), it is not drafted for either. Output stays plain decoding's."""
    from eagle2.engine import Request

    target = tiny_target(seed=6)
    prompts = random_prompts(3, 64, seed=9)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    vanilla = run(make_engine(target, None), prompts, params, TreeConfig("vanilla"))
    engine = make_engine(target, 0)
    engine._costs = flat_costs(0.05)
    drafted: list[list[str]] = []
    draft = engine.drafter.draft

    def recording(seq_ids, *args, **kwargs):
        drafted.append(list(seq_ids))
        return draft(seq_ids, *args, **kwargs)

    engine.drafter.draft = recording
    out = {f"s{i}": [] for i in range(3)}
    for i in range(2):
        engine.add(Request(f"s{i}", tuple(prompts[i]), params, AUTO))
    steps = 0
    while engine.has_work():
        if steps == 12:  # the gate of batch 2 is backed off by now; so is batch 3's
            assert engine.gate.skip_left > 0
            engine.gates[3] = SpeculationGate(backoff=64, skip_left=64)
            engine.add(Request("s2", tuple(prompts[2]), params, AUTO))
            before = len(drafted)
            if certain_drafts_could_pay:
                engine._costs = flat_costs(0.002, base=0.05)
                assert engine._could_pay(1)
            else:
                assert not engine._could_pay(1)
        for ev in engine.step():
            out[ev.seq_id].extend(ev.token_ids)
        steps += 1
        if steps == 14:  # 13: s2's prefill; 14: its first step, a probe of s2 alone
            assert drafted[before:] == ([["s2"]] if certain_drafts_could_pay else [])
    assert [out[f"s{i}"] for i in range(3)] == vanilla


def test_a_shrinking_batch_keeps_its_back_off():
    """No tree pays and the gate of batch 3 is backed off: when requests finish and the batch
    shrinks to 2 and 1, the new sizes' gates start from that back-off instead of probing the
    whole batch again; output stays plain decoding's."""
    from eagle2.engine import Request

    target = tiny_target(seed=7)
    prompts = random_prompts(3, 64, seed=10)
    lengths = (8, 16, 40)
    ref = [run(make_engine(target, None), [p], SamplingParams(max_tokens=n, ignore_eos=True),
               TreeConfig("vanilla"))[0] for p, n in zip(prompts, lengths, strict=True)]
    engine = make_engine(target, 0)
    engine._costs = flat_costs(0.05)
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add(Request(f"s{i}", tuple(p), SamplingParams(max_tokens=n, ignore_eos=True),
                           AUTO))
    out = {f"s{i}": [] for i in range(3)}

    def step():
        for ev in engine.step():
            out[ev.seq_id].extend(ev.token_ids)

    step()  # the prefill of all three
    step()  # their first step: newcomers, drafted
    engine.gates[3] = SpeculationGate(backoff=64, skip_left=64)
    calls = []
    draft = engine.drafter.draft
    engine.drafter.draft = lambda ids, *a, **k: calls.append(list(ids)) or draft(ids, *a, **k)
    while engine.has_work():
        step()
    assert calls == []  # sizes 2 and 1 inherited the back-off: nothing probed
    assert [out[f"s{i}"] for i in range(3)] == ref
    assert set(engine.gates) == {1, 2, 3}


# ----- pruning -------------------------------------------------------------------------------
def slow_prune(tree, keep: int):
    """List-based reference: root + the best keep - 1 nodes by value (ties: lower index)."""
    out = []
    for b in range(tree.batch_size):
        n = int(tree.num_nodes[b])
        vals = tree.values[b, :n].tolist()
        order = sorted(range(1, n), key=lambda i: (-vals[i], i))[: max(keep, 1) - 1]
        kept = [0] + sorted(order)
        pos = {old: new for new, old in enumerate(kept)}
        parents = [-1] + [pos[int(tree.parents[b, i])] for i in kept[1:]]
        out.append(([int(tree.tokens[b, i]) for i in kept], parents))
    return out


def test_prune_matches_slow_reference_on_random_trees():
    g = torch.Generator().manual_seed(3)
    for trial in range(30):
        num_b, k = 3, 3
        # two levels of candidates: k at depth 1, k * k at depth 2
        s1 = -torch.rand(num_b, k, generator=g) * 3
        s2 = (s1[:, :, None] - torch.rand(num_b, k, k, generator=g) * 3).reshape(num_b, -1)
        if trial % 5 == 0:
            s2[:, :2] = s1[:, :1]  # ties between a parent and its children
        toks = torch.randint(0, 50, (num_b, k + k * k), generator=g)
        parents = torch.cat([torch.full((num_b, k), -1), torch.arange(k).repeat_interleave(k)
                             .expand(num_b, -1)], 1)
        depths = torch.cat([torch.ones(num_b, k), torch.full((num_b, k * k), 2)], 1).long()
        tree = build_tree(torch.tensor([7, 8, 9]), toks, parents, torch.cat([s1, s2], 1),
                          depths, num_nodes=10)
        keep = 1 + trial % 10
        pruned = prune_tree(tree, torch.full((num_b,), keep))
        ref = slow_prune(tree, keep)
        for b in range(num_b):
            n = int(pruned.num_nodes[b])
            assert (pruned.tokens[b, :n].tolist(), pruned.parents[b, :n].tolist()) == ref[b]
        assert pruned.size == min(keep, 10)
        # the mask and paths are rebuilt: every kept node sees exactly its ancestors
        for b in range(num_b):
            for i in range(1, int(pruned.num_nodes[b])):
                p = int(pruned.parents[b, i])
                assert pruned.tree_mask[b, i, p] and pruned.depths[b, i] == pruned.depths[b, p] + 1


def test_prune_keeps_per_tree_sizes_and_padding():
    a = finish_tree(torch.tensor([[5, 6, 8, 7]]), torch.tensor([[-1, 0, 0, 1]]),
                    torch.tensor([[0, 1, 1, 2]]), values=torch.tensor([[1.0, 0.9, 0.4, 0.3]]))
    b = finish_tree(torch.tensor([[3, 4]]), torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]),
                    values=torch.tensor([[1.0, 0.5]]))
    pruned = prune_tree(type(a).concat([a, b]), torch.tensor([3, 3]))
    assert pruned.tokens.tolist() == [[5, 6, 8], [3, 4, 0]]
    assert pruned.parents.tolist() == [[-1, 0, 0], [-1, 0, -1]]
    assert pruned.num_nodes.tolist() == [3, 2]
    assert pruned.values[0].tolist() == pytest.approx([1.0, 0.9, 0.4])


# ----- calibration ---------------------------------------------------------------------------
def test_pool_adjacent_violators_hand_made():
    # rates 0/2, 1/2, 0/2, 2/2: bins 2 and 3 fall, so they pool to 1/4 each
    assert _pool_adjacent_violators([0, 1, 0, 2], [2, 2, 2, 2]) == [0.0, 0.25, 0.25, 1.0]


def test_calibration_fit_is_monotone_and_tracks_the_true_rate():
    g = torch.Generator().manual_seed(0)
    raw = torch.rand(20000, generator=g) ** 3  # most values small, as in real trees
    true_rate = raw.sqrt()  # acceptance is higher than the raw value says
    acc = torch.rand(20000, generator=g) < true_rate
    cal = Calibration.fit(raw, acc, num_bins=20)
    assert list(cal.rates) == sorted(cal.rates) and len(cal.rates) >= 15
    probe = torch.tensor([0.001, 0.05, 0.3, 0.8])
    torch.testing.assert_close(cal(probe), probe.sqrt(), atol=0.08, rtol=0)
    assert cal(torch.tensor([0.0])).item() == 0.0
    with pytest.raises(ValueError, match="non-decreasing"):
        Calibration((0.0,), (0.5, 0.4))
    with pytest.raises(ValueError, match="at least"):
        Calibration.fit(raw[:10], acc[:10])


def test_accepted_nodes_follow_the_greedy_path():
    # root 0 -> 1 (tok 4) -> 3 (tok 6); root -> 2 (tok 5); target argmax: root 4, node1 7
    tree = finish_tree(torch.tensor([[9, 4, 5, 6]]), torch.tensor([[-1, 0, 0, 1]]),
                       torch.tensor([[0, 1, 1, 2]]))
    argmax = torch.tensor([[4, 7, 0, 0]])
    acc = accepted_nodes(tree.tokens, tree.parents, tree.tree_mask, tree.num_nodes, argmax)
    assert acc.tolist() == [[False, True, False, False]]
    argmax = torch.tensor([[4, 6, 0, 0]])
    acc = accepted_nodes(tree.tokens, tree.parents, tree.tree_mask, tree.num_nodes, argmax)
    assert acc.tolist() == [[False, True, False, True]]


# ----- the engine with auto budgets stays lossless -------------------------------------------
# a forward of 100 s whatever its size: drafting time is negligible and every node pays;
# 50 ms per token: no tree pays, so the engine decodes plainly and probes now and then
@pytest.mark.parametrize("costs, expect_skips", [(flat_costs(0.0, base=100.0), False),
                                                 (flat_costs(0.05), True)])
def test_auto_budget_greedy_equals_vanilla(costs, expect_skips):
    target = tiny_target(seed=1)
    prompts = random_prompts(4, 64, seed=5)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    engine = make_engine(target, 0)
    engine._costs = costs
    # (without chains on undrafted steps a draft call competes with plain decoding alone:
    # `test_a_draft_call_must_beat_the_chains_alone`)
    engine.lookup_alone = False
    assert run(engine, prompts, GREEDY, AUTO) == vanilla
    stats = engine.stats
    assert stats.auto_steps > 0
    assert (stats.skipped_drafts > 0) == expect_skips
    if not expect_skips:  # free verification: always the biggest tree
        assert set(stats.nodes_chosen) == {AUTO.total_tokens}


def test_a_draft_call_must_beat_the_chains_alone():
    """Free verification (100 s a forward of any size) and an untrained head, whose trees add
    little to the lookup chain merged into them: where that chain would be verified without a
    draft call (`Engine._undrafted_rate`), such trees do not pay and the gate skips draft calls
    (which plain decoding alone could never make it do here); outputs stay vanilla's."""
    target = tiny_target(seed=1)
    prompts = random_prompts(4, 64, seed=5)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    skipped = {}
    for alone in (True, False):
        engine = make_engine(target, 0)
        engine._costs = flat_costs(0.0, base=100.0)
        engine.lookup_alone = alone
        assert run(engine, prompts, GREEDY, AUTO) == vanilla
        skipped[alone] = engine.stats.skipped_drafts
    assert skipped[True] > 0 and skipped[False] == 0


def test_auto_budget_alone_and_in_a_batch_with_fixed_trees():
    target = tiny_target(seed=2)
    prompts = random_prompts(3, 64, seed=6)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    engine = make_engine(target, 1)
    engine._costs = flat_costs(0.0005)
    from eagle2.engine import Request

    fixed = TreeConfig("eagle2", total_tokens=6, depth=2, top_k=2, budget="fixed")
    for i, (p, tree) in enumerate(zip(prompts, (AUTO, fixed, TreeConfig("chain", depth=3)),
                                      strict=True)):
        engine.add(Request(f"s{i}", tuple(p), GREEDY, tree))
    out = {f"s{i}": [] for i in range(3)}
    while engine.has_work():
        for ev in engine.step():
            out[ev.seq_id].extend(ev.token_ids)
    assert [out[f"s{i}"] for i in range(3)] == vanilla


def test_min_gain_stops_the_expansion():
    target = tiny_target(seed=3)
    engine = make_engine(target, 0)
    drafter = engine.drafter
    drafter.keep_candidates = True  # one entry per drafted level
    feats = torch.randn(1, 3, target.config.hidden_size)
    toks = torch.tensor([[1, 2, 3]])
    drafter.draft(["a"], feats, toks, torch.tensor([3]), AUTO)
    assert len(drafter.last_candidates) == AUTO.depth + 1
    drafter.rewind("a", 0)
    shallow = drafter.draft(["a"], feats, toks, torch.tensor([3]), AUTO, min_gain=math.inf)
    assert len(drafter.last_candidates) == 1  # the root step only: no expansion paid
    assert int(shallow.depths.max()) == 1


def test_sampling_with_auto_budget_is_reproducible_and_mixes_with_greedy():
    target = tiny_target(seed=4)
    prompts = random_prompts(3, 64, seed=7)
    params = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    outs = []
    for _ in range(2):
        engine = make_engine(target, 0)
        engine._costs = flat_costs(0.0005)
        outs.append(run(engine, prompts, params, AUTO, seeds=[1, 2, 3]))
    assert outs[0] == outs[1]


def test_costs_are_measured_once_and_cached_with_the_draft_levels(tmp_path):
    target = tiny_target(seed=5)
    path = tmp_path / "costs.json"
    engine = make_engine(target, 0, max_batch=2, max_context=64)
    engine._costs, engine._cost_path = path, path
    prompts = random_prompts(2, 64, seed=8)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    assert run(engine, prompts, GREEDY, AUTO) == vanilla
    saved = CostModel.from_json(__import__("json").loads(path.read_text()))
    assert saved.batches == (1, 2) and saved.draft_batches == (1, 2)
    assert len(saved.draft_level_s) == 2
    assert saved == engine.costs  # what the engine used is what was saved
    again = make_engine(target, 0, max_batch=2, max_context=64)
    again._costs, again._cost_path = path, path
    assert again.known_costs is None  # not read before the first need, nor by asking
    assert again.costs == saved  # read, not measured again
    assert again.known_costs == saved


def test_cached_draft_costs_of_another_head_are_measured_again(tmp_path, monkeypatch):
    """A cache written with an EAGLE-2 head is not trusted for an EAGLE-3 head's draft levels
    (its own lm_head and 2H-wide projections cost differently); the target costs are kept,
    and so are the first head's draft costs: a third engine with it measures nothing."""
    from eagle2.budget import draft_key

    target = tiny_target(seed=5, layers=4)
    path = tmp_path / "costs.json"
    first = make_engine(target, 0, max_batch=2, max_context=64)
    first._costs, first._cost_path = path, path
    prompts = random_prompts(2, 64, seed=8)
    run(first, prompts, GREEDY, AUTO)
    saved = CostModel.from_json(__import__("json").loads(path.read_text()))
    assert saved.draft_head == draft_key(first.drafter) and saved.draft_head.startswith("eagle2|")
    other = make_engine(target, 0, max_batch=2, max_context=64, head_kind="eagle3")
    other._costs, other._cost_path = path, path
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    target.set_feature_layers(other.drafter.head.feature_layers(4))
    assert run(other, prompts, GREEDY, AUTO) == vanilla
    target.set_feature_layers(None)
    data = __import__("json").loads(path.read_text())
    resaved = CostModel.from_json(data)
    assert resaved.draft_head == draft_key(other.drafter)
    assert resaved.draft_head.startswith("eagle3|")
    assert (resaved.batches, resaved.seconds) == (saved.batches, saved.seconds)
    assert set(data["drafts"]) == {saved.draft_head, resaved.draft_head}

    third = make_engine(target, 0, max_batch=2, max_context=64)
    third._costs, third._cost_path = path, path
    measured = []
    monkeypatch.setattr("eagle2.engine_budget.measure_draft_levels",
                        lambda *a, **k: measured.append(a))
    assert run(third, prompts, GREEDY, AUTO) == vanilla
    assert measured == []
    assert third.known_costs.draft_level_s == saved.draft_level_s


def test_lower_envelope_removes_one_sided_noise_and_never_goes_below_the_truth():
    """Timing noise only adds time; the envelope of a noisy grid lies between the truth and
    the measurement, and a slow first cell of a row (a shape's first calls) does not raise
    the larger cells as a running maximum did."""
    from eagle2.budget import lower_envelope

    gen = torch.Generator().manual_seed(0)
    batches, nodes = 4, 10
    truth = [[0.05 + 0.002 * b + 0.001 * n * (b + 1) for n in range(nodes)]
             for b in range(batches)]
    for _ in range(20):
        noisy = [[t * (1 + float(torch.rand(1, generator=gen)) *
                       (1.0 if float(torch.rand(1, generator=gen)) < 0.3 else 0.02))
                  for t in row] for row in truth]
        env = lower_envelope(noisy)
        for b in range(batches):
            for n in range(nodes):
                assert truth[b][n] <= env[b][n] <= noisy[b][n]
                if n + 1 < nodes:
                    assert env[b][n] <= env[b][n + 1]
                if b + 1 < batches:
                    assert env[b][n] <= env[b + 1][n]
    spiked = [list(row) for row in truth]
    spiked[0][0] = 0.09  # the observed failure: +40 ms on the first cell of a row
    env = lower_envelope(spiked)[0]
    assert env[0] == truth[0][1] and list(env[1:]) == truth[0][1:]
    running_max = [max(spiked[0][: i + 1]) for i in range(nodes)]
    assert running_max[3] == 0.09  # what the old envelope priced 4 tokens at


class RecordingRunner:
    """A TargetRunner stand-in that records which of its methods a caller uses: every call
    as (method, its arguments)."""

    def __init__(self, greedy_argmax: bool, num_slots: int = 4):
        self.device = torch.device("cpu")
        self.vocab_size = 8
        self.greedy_argmax = greedy_argmax
        self._lengths = torch.zeros(num_slots, dtype=torch.long)
        self.calls: list[tuple[str, tuple, dict]] = []

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    def set_lengths(self, slots, values) -> None:
        self.calls.append(("set_lengths", (slots, values), {}))
        self._lengths[slots] = values

    def forward(self, *args, **kwargs):
        self.calls.append(("forward", args, kwargs))
        tokens = args[0]
        return torch.zeros(*tokens.shape, 4), torch.zeros(*tokens.shape, self.vocab_size)

    def verify_step(self, tree, positions, slots, params, generators, **kwargs):
        from eagle2.verify import Verified

        self.calls.append(("verify_step", (tree, positions, slots, params, generators), kwargs))
        num_b = tree.batch_size
        return Verified([[0]] * num_b, [[0]] * num_b), torch.zeros(num_b, 1, 4)


@pytest.mark.parametrize("greedy_argmax", [False, True])
def test_the_cost_grid_is_timed_through_the_steps_verify_step(greedy_argmax):
    """The grid times what a step calls (`Engine._verify`: runner.verify_step, a tree from
    the host, greedy rows), never runner.forward, whose full logits a sharded target sends
    from rank 0 (no step does). Where greedy steps skip the logits, the grid asks for them
    (`CostModel.greedy` prices the argmax apart)."""
    from eagle2.budget import time_grid

    runner = RecordingRunner(greedy_argmax)
    runner._lengths[:] = torch.tensor([3, 0, 20, 0])
    grid = time_grid(runner, (1, 2), (1, 4), prefix=8, passes=2)
    assert len(grid) == 2 and all(len(row) == 2 for row in grid)
    methods = [name for name, _, _ in runner.calls]
    assert "forward" not in methods
    steps = [(args, kwargs) for name, args, kwargs in runner.calls if name == "verify_step"]
    assert len(steps) == 2 * (1 + 4)  # each sweep: an untimed call, then one per cell
    shapes = set()
    for (tree, positions, slots, params, gens), kwargs in steps:
        num_b, num_n = tree.tokens.shape
        shapes.add((num_b, num_n))
        assert tree.tokens.device == HOST  # where the engine's trees come from
        assert torch.equal(tree.parents[0], torch.arange(num_n) - 1)  # a chain
        assert torch.equal(positions, torch.tensor([8, 8])[:num_b, None] + torch.arange(num_n))
        assert slots.tolist() == list(range(num_b)) and gens == [None] * num_b
        assert all(p.greedy for p in params) and len(params) == num_b
        assert kwargs == ({"logits": True} if greedy_argmax else {})
    assert shapes == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert runner.lengths.tolist() == [3, 0, 20, 0]  # restored
    m = CostModel.measure(runner, max_batch=2, max_nodes=4, prefix=8, repeats=0)
    assert m.nodes == (1, 2, 3, 4) and "forward" not in [name for name, _, _ in runner.calls]


def test_a_slow_phase_of_the_machine_spoils_no_cell():
    """A few seconds of a busy core (here: calls 4-11 of the sweep made 30 ms slower, on a
    real runner) cover every sample of two cells when cells are timed back to back; the
    grid's sweeps spread each cell's samples over time, so every cell keeps a quiet one."""
    import time as _time

    from eagle2.budget import time_grid

    target = tiny_target()
    engine = make_engine(target, 0, max_batch=2, max_context=64)
    runner = engine.runner
    calls = [0]
    real = runner.target_forward  # (what every step's forward goes through)

    def slow_phase(*args, **kwargs):
        calls[0] += 1
        if 4 <= calls[0] < 12:
            _time.sleep(0.03)
        return real(*args, **kwargs)

    runner.target_forward = slow_phase
    grid = time_grid(runner, (1, 2), (1, 2, 4), prefix=8, passes=4)
    assert calls[0] == 4 * (1 + 6)  # each sweep: an untimed call first (kept key blocks)
    assert max(max(row) for row in grid) < 0.03  # no cell kept a slow sample


def test_acceptance_scale_stops_drafting_that_promises_but_is_never_accepted(monkeypatch):
    """A random head without prompt lookup: verification accepts none of its drafts, while
    its tree values (x 4 here, at most 1) promise several tokens a step. Without the scale
    the engine verifies promising trees every step; with it each request learns from its
    own steps that the promise does not hold and decodes plainly on most steps. Outputs
    stay those of plain decoding."""
    from eagle2.engine import Engine

    target = tiny_target(seed=3)
    prompts = random_prompts(3, 64, seed=4)
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    vanilla = run(make_engine(target, None), prompts, params, TreeConfig("vanilla"))
    stats = {}
    for name, prior in (("scaled", Engine.ACCEPTANCE_PRIOR), ("unscaled", 1e12)):
        monkeypatch.setattr(Engine, "ACCEPTANCE_PRIOR", prior)
        engine = make_engine(target, 0)
        engine._costs = flat_costs(0.002)  # a token costs a fifth of a step
        real = engine.drafter.draft

        def overpromising(*args, _real=real, **kwargs):
            tree = _real(*args, **kwargs)
            values = tree.values.clone()
            values[:, 1:] = (values[:, 1:] * 4).clamp(max=1)
            return dataclasses.replace(tree, values=values)

        engine.drafter.draft = overpromising
        assert run(engine, prompts, params, replace(AUTO, lookup=0)) == vanilla
        stats[name] = engine.stats
    scaled, unscaled = stats["scaled"], stats["unscaled"]
    assert scaled.accepted == unscaled.accepted == 0
    assert unscaled.skipped_drafts <= 0.1 * unscaled.auto_steps
    assert scaled.skipped_drafts >= 0.6 * scaled.auto_steps
    assert scaled.predicted_accepted < 0.2 * unscaled.predicted_accepted


def test_a_seeded_request_samples_the_same_whatever_ran_before_it():
    """The engine's learnt state about the batch (the last step's predicted rate, which sets
    how far the head expands; the depths recently kept) starts over when requests join, so
    a seeded request's trees, and therefore its sample, do not depend on earlier requests."""
    target = tiny_target(seed=5)
    prompts = random_prompts(3, 64, seed=11)
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    costs = CostModel((1, 2, 4), (1, 2, 4, 8, 16), tuple(
        tuple(0.02 + 0.004 * b * n ** 1.5 for n in (1, 2, 4, 8, 16)) for b in (1, 2, 4)),
        draft_batches=(1, 2, 4), draft_level_s=(0.004, 0.005, 0.006))
    outs = []
    for before in ([], [prompts[1]], [prompts[2], prompts[1]]):
        engine = make_engine(target, 0)
        engine._costs = costs
        for p in before:
            run(engine, [p], params, AUTO, seeds=[99])
        outs.append(run(engine, [prompts[0]], params, AUTO, seeds=[7]))
    assert outs[0] == outs[1] == outs[2]


def test_an_auto_draft_catches_up_on_what_one_plain_step_buys():
    """A prompt longer than one plain step's worth of head rows restarts the head from its
    last rows (outputs stay plain decoding's)."""
    target = tiny_target(seed=6)
    prompts = random_prompts(2, 64, seed=3, lo=60, hi=70)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    engine = make_engine(target, 0)
    # plain step 20 ms at batch 2; a narrow level 2 ms, a wide one 8 ms: 1 ms a row -> 22 rows
    engine._costs = CostModel((1, 2), (1, 2, 4), ((0.02, 0.02, 0.03), (0.02, 0.022, 0.03)),
                              draft_batches=(1, 2), draft_level_s=(0.008, 0.008),
                              draft_narrow_s=(0.002, 0.002))
    keeps = []
    restart = engine.drafter._restart
    engine.drafter._restart = lambda *a: keeps.append(a[-1]) or restart(*a)
    assert run(engine, prompts, GREEDY, AUTO) == vanilla
    assert keeps and keeps[0] == 22


def test_gates_outlive_an_idle_engine_for_greedy_newcomers_only():
    engine = make_engine(tiny_target(seed=5), 0)
    engine._costs = flat_costs()
    run(engine, [[1, 2, 3]], GREEDY, AUTO)
    engine.gates[1] = SpeculationGate(backoff=64, skip_left=50)
    engine.add(Request("g", (4, 5, 6), GREEDY, AUTO))
    engine.step()  # the prefill of a greedy request at an idle engine
    assert engine.gates[1].skip_left == 50  # what the gate learnt still holds
    engine.cancel("g")
    engine.add(Request("s", (4, 5, 6), SamplingParams(temperature=1.0, seed=3, max_tokens=8),
                       AUTO))
    engine.step()
    assert 1 not in engine.gates  # a sampled newcomer: the gates start over


# ----- draft width --------------------------------------------------------------------------
def test_draft_level_cost_follows_the_width_and_round_trips():
    costs = CostModel((1,), (1,), ((0.01,),), draft_batches=(1, 2), draft_level_s=(0.004, 0.006),
                      draft_narrow_s=(0.002, 0.003))
    assert costs.draft_level(1) == pytest.approx(0.004)  # default: the wide level
    assert costs.draft_level(1, 8) == pytest.approx(0.004)
    assert costs.draft_level(1, 2) == pytest.approx(0.002)
    assert costs.draft_level(1, 4) == pytest.approx(0.002 + 0.002 * 2 / 6)  # the docstring's
    assert costs.draft_level(2, 5) == pytest.approx(0.003 + 0.003 * 3 / 6)
    assert CostModel.from_json(costs.to_json()) == costs
    wide_only = replace(costs, draft_narrow_s=())  # a cache written before: every width is wide
    assert wide_only.draft_level(1, 2) == pytest.approx(0.004)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_tree_of_m_drafts_is_the_same_from_levels_m_wide(seed):
    """What `Engine._expansions` relies on when it narrows the levels to the largest tree kept
    recently: the best m draft nodes of a width-8 draft are those of a width-m draft (random
    heads, several depths; lookup off, so only the head proposes)."""
    target = tiny_target(seed=10 + seed)
    drafter = make_engine(target, seed).drafter
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(2, 5, target.config.hidden_size, generator=g)
    toks = torch.randint(0, 64, (2, 5), generator=g)
    counts = torch.tensor([5, 3])
    for m in (1, 2, 3, 5):
        for depth in (1, 3):
            trees = []
            for k in (8, max(m, 2)):
                config = TreeConfig("eagle2", total_tokens=m + 1, depth=depth, top_k=k,
                                    budget="fixed", lookup=0)
                trees.append(drafter.draft(["a", "b"], feats, toks, counts, config))
                drafter.rewind("a", 0)
                drafter.rewind("b", 0)
            wide, narrow = trees
            assert torch.equal(wide.tokens, narrow.tokens), (m, depth)
            assert torch.equal(wide.parents, narrow.parents), (m, depth)


def test_auto_trees_are_drafted_no_wider_than_the_largest_tree_kept():
    """With verification so dear that small trees are kept, the head is asked for narrow
    levels (at least 2 nodes, at most the largest tree of the last steps), the output still
    equals plain decoding, and the draft cost is read at that width."""
    target = tiny_target(seed=6)
    prompts = random_prompts(2, 64, seed=9)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    engine = make_engine(target, 0)
    nodes, batches = (1, 2, 3, 4, 8, 16), (1, 2, 4, 8)
    engine._costs = CostModel(batches, nodes, tuple(tuple(0.01 * (1 + 0.4 * (n - 1)) * b
                                                          for n in nodes) for b in batches),
                              draft_batches=batches, draft_level_s=(1e-5,) * 4,
                              draft_narrow_s=(1e-6,) * 4)
    widths, reads = [], []
    draft, level = engine.drafter.draft, CostModel.draft_level

    def spy_draft(ids, feats, toks, counts, config, min_gain=0.0):
        widths.append((config.top_k, max(engine._sizes_used, default=None)))
        return draft(ids, feats, toks, counts, config, min_gain)

    def spy_level(self, num_b, width=0):
        reads.append(width)
        return level(self, num_b, width)

    engine.drafter.draft = spy_draft
    CostModel.draft_level = spy_level
    try:
        assert run(engine, prompts, GREEDY, AUTO) == vanilla
    finally:
        CostModel.draft_level = level
    assert widths[0] == (AUTO.top_k, None)  # nothing kept yet: the configured width
    later = [(k, kept) for k, kept in widths if kept is not None]
    assert later and all(k == min(AUTO.top_k, max(2, kept)) for k, kept in later)
    assert any(k < AUTO.top_k for k, _ in later)
    assert set(reads) - {0} <= {k for k, _ in widths}


def test_a_level_must_pay_for_its_draft_and_for_verifying_its_nodes():
    """min_gain: the tokens a level's time and one more verified node a request (beyond the
    largest tree kept lately, at least root + 1) cost at the current rate."""
    engine = make_engine(tiny_target(seed=6), 0)
    batches = (1, 2)
    engine._costs = CostModel(batches, (1, 2, 3, 4), ((0.02, 0.02, 0.03, 0.05),
                                                      (0.03, 0.03, 0.05, 0.08)),
                              draft_batches=batches, draft_level_s=(0.002, 0.003),
                              draft_narrow_s=(0.002, 0.003))
    engine.add(Request("a", (1, 2, 3), GREEDY, AUTO))
    engine.step()  # the prefill
    assert engine._min_gain(1, 2) == pytest.approx(50 * (0.002 + 0.01))  # a third node
    engine._sizes_used = [2, 3]
    assert engine._min_gain(1, 2) == pytest.approx(50 * (0.002 + 0.02))  # a fourth


def test_realized_rates_compare_drafting_and_plain_steps():
    from eagle2.budget import RealizedRates

    rates = RealizedRates(decay=1.0, min_steps=2)
    rates.observe(False, 2, 0.02)
    rates.observe(True, 3, 0.04)
    rates.observe(False, 2, 0.02)
    assert rates.advantage() is None  # one drafting step: too little
    rates.observe(True, 3, 0.04)
    # drafting: 6 tokens in 0.08 s (75/s); plain: 4 in 0.04 s (100/s)
    assert rates.advantage() == pytest.approx(75 / 100)
    rates.decay = 0.5
    rates.observe(False, 2, 0.02)
    assert rates.advantage() is None  # the drafting evidence faded: the verdict is retried


def test_realized_losses_overrule_a_predicted_gain():
    """Greedy batches whose drafting steps delivered fewer tokens a second than their plain
    steps stop drafting although the costs predict a gain; outputs stay plain decoding's."""
    from eagle2.budget import RealizedRates

    target = tiny_target(seed=6)
    prompts = random_prompts(2, 64, seed=9)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    engine = make_engine(target, 0)
    engine._costs, engine._timed = flat_costs(), True  # trees cost nothing more: all pay
    losing = RealizedRates(decay=1.0)
    for drafted in [True] * 8 + [False] * 8:
        losing.observe(drafted, 2, 0.04 if drafted else 0.01)
    engine.realized[2] = losing
    drafted = []
    draft = engine.drafter.draft
    engine.drafter.draft = lambda *a, **k: drafted.append(1) or draft(*a, **k)
    assert run(engine, prompts, GREEDY, AUTO) == vanilla
    assert engine.stats.realized_vetoes >= 1
    steps = engine.stats.auto_steps
    assert len(drafted) < steps / 2  # backed off, not drafting every step


def test_newcomers_are_probed_where_typical_acceptance_could_pay():
    """Greedy batches bound a newcomer's accepted tokens by what kept trees accepted lately:
    where 0.2 a tree cannot pay for the draft and a wider forward, no probe, though certain
    drafts could; 0.9 could."""
    engine = make_engine(tiny_target(seed=6), 0)
    engine._costs = CostModel((1, 2), (1, 2, 4), ((0.02, 0.022, 0.03), (0.03, 0.034, 0.05)),
                              draft_batches=(1, 2), draft_level_s=(0.0005, 0.0006),
                              draft_narrow_s=(0.0005, 0.0006))
    engine._timed = True
    engine.add(Request("a", (1, 2, 3), GREEDY, AUTO))
    engine.add(Request("b", (4, 5, 6), GREEDY, AUTO))
    engine.step()  # the prefill
    assert engine._typical_accepted() is None and engine._could_pay(1)  # certain drafts pay
    engine._accepted_sums = (0.2 * 10, 10.0)
    assert engine._typical_accepted() == pytest.approx(0.2) and not engine._could_pay(1)
    engine._accepted_sums = (0.9 * 10, 10.0)
    assert engine._could_pay(1)
    engine.seqs[0].req = replace(engine.seqs[0].req, params=SamplingParams(
        temperature=1.0, seed=1, max_tokens=24))
    engine._accepted_sums = (0.2 * 10, 10.0)
    assert engine._could_pay(1)  # sampled batches: certain drafts (reproducible trees)


@pytest.mark.parametrize("typical,probes", [(0.2, False), (0.9, True)])
def test_a_backed_off_gate_reprobes_only_where_typical_acceptance_could_pay(typical, probes):
    """A batch size whose gate backed off probes again after the back-off only if the typical
    acceptance could pay there (else the gate backs off further, no draft call); where it
    could, the probe drafts. Outputs stay plain decoding's either way."""
    target = tiny_target(seed=6)
    prompts = random_prompts(2, 64, seed=8)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    engine = make_engine(target, 0)
    engine._costs = CostModel((1, 2), (1, 2, 4), ((0.02, 0.022, 0.03), (0.03, 0.034, 0.05)),
                              draft_batches=(1, 2), draft_level_s=(0.0005, 0.0006),
                              draft_narrow_s=(0.0005, 0.0006))
    engine._timed = True
    engine._accepted_sums = (typical * 10, 10.0)
    engine.gates[2] = SpeculationGate(backoff=2, skip_left=0)  # its back-off just ran out
    drafted = []
    draft = engine.drafter.draft
    engine.drafter.draft = lambda *a, **k: drafted.append(1) or draft(*a, **k)
    out = {"a": [], "b": []}
    engine.add(Request("a", tuple(prompts[0]), GREEDY, AUTO))
    engine.add(Request("b", tuple(prompts[1]), GREEDY, AUTO))
    for ev in engine.step():  # the prefill
        out[ev.seq_id].extend(ev.token_ids)
    for s in engine.seqs:
        s.probe = False  # no newcomers' probe: the gate's alone
    for ev in engine.step():
        out[ev.seq_id].extend(ev.token_ids)
    assert bool(drafted) == probes
    assert engine.stats.skipped_probes == (0 if probes else 1)
    if not probes:
        assert engine.gates[2].backoff == 4 and engine.gates[2].skip_left == 4
    while engine.has_work():
        for ev in engine.step():
            out[ev.seq_id].extend(ev.token_ids)
    assert [out["a"], out["b"]] == vanilla


def test_measured_scales_follow_step_times_and_clip_outliers():
    from eagle2.budget import MeasuredScales

    scales = MeasuredScales(decay=0.5)
    scales.observe("tree", 0.03, 0.02)  # 1.5x the prediction
    assert scales.tree == pytest.approx(1.25) and scales.plain == scales.draft == 1.0
    scales.observe("plain", 10.0, 0.01)  # a stall: clipped to 4x
    assert scales.plain == pytest.approx(2.5)
    scales.observe("draft", 0.0, 0.01)  # nothing measured: ignored
    assert scales.draft == 1.0
    costs = flat_costs(0.001)
    scaled = scales.costs(costs)
    assert scaled(2, 1) == pytest.approx(costs(2, 1) * 2.5)
    assert scaled(2, 4) == pytest.approx(costs(2, 4) * 1.25)


def test_step_times_scale_the_budget_of_greedy_batches_only():
    """Costs the engine measured itself are corrected by its measured step times (plain
    steps, verified trees, draft calls), and only where the batch is greedy: a sampled
    request's trees, and so its draws, follow the cost model alone. Costs given to the engine
    are used as they are."""
    target = tiny_target(seed=4)
    prompts = random_prompts(2, 64, seed=5)
    engine = make_engine(target, 0, max_batch=2, max_context=64)
    engine._costs = None  # measured by the engine, as a served engine does
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    assert run(engine, prompts, GREEDY, AUTO) == vanilla
    assert engine._timed
    scales = engine.scales
    assert (scales.plain, scales.tree, scales.draft) != (1.0, 1.0, 1.0)  # steps were observed
    costs = engine.costs
    engine.add(Request("s", (1, 2, 3), SamplingParams(temperature=0.7, max_tokens=4), AUTO))
    engine.step()  # prefill
    assert engine._timed_costs(costs) is costs and engine._draft_scale() == 1.0
    given = make_engine(target, 0, max_batch=2, max_context=64)
    given._costs = flat_costs(0.001)
    run(given, prompts, GREEDY, AUTO)
    assert not given._timed and (given.scales.plain, given.scales.tree) == (1.0, 1.0)


def test_step_times_are_scaled_per_batch_size():
    """Each batch size keeps its own measured scales (a batch's later verification rounds
    cost what the grid does not say, more at batch 8 than at 1); a size met for the first time
    starts from the last size's, and an idle engine reads the last one. With
    `scales_per_batch` off every size shares one."""
    target = tiny_target(seed=4)
    prompts = random_prompts(2, 64, seed=5)
    for per_batch in (True, False):
        engine = make_engine(target, 0, max_batch=2, max_context=64)
        engine._costs = None
        engine.scales_per_batch = per_batch
        # two requests together, then the longer one alone (however many tokens a step took)
        for i, (prompt, tokens) in enumerate(zip(prompts, (2, 40), strict=True)):
            engine.add(Request(f"r{i}", tuple(prompt), SamplingParams(max_tokens=tokens,
                                                                      ignore_eos=True), AUTO))
        while engine.has_work():
            engine.step()
        if per_batch:
            assert set(engine.scales_of) == {1, 2}
            one, two = engine.scales_of[1], engine.scales_of[2]
            assert one is not two and (one.plain, one.tree) != (two.plain, two.tree)
            assert engine.scales is engine._last_scales
        else:
            assert not engine.scales_of
    engine = make_engine(target, 0, max_batch=2, max_context=64)
    engine.scales.observe("plain", 0.03, 0.01)  # idle: the last scales
    engine.add(Request("a", (1, 2, 3), GREEDY, AUTO))
    engine.step()  # prefill: batch 1 starts from the last scales, a copy
    assert engine.scales.plain == engine._last_scales.plain > 1.0
    first = engine.scales
    engine.add(Request("b", (4, 5, 6), GREEDY, AUTO))
    engine.step()
    assert engine.scales is not first and engine.scales.plain == first.plain


def test_the_lm_head_is_timed_after_text_where_the_target_has_a_tokenizer():
    """`runner.timing_tokens`: the timing text's tokens, repeated to the length asked, where
    the target has a tokenizer (the greedy argmax costs less after text than after random
    tokens); seeded random tokens where it has none."""
    from types import SimpleNamespace

    from eagle2.runner import TIMING_TEXT, timing_tokens

    words = TIMING_TEXT.split()
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    target = SimpleNamespace(tokenizer=lambda text: {"input_ids": [vocab[w] for w in text.split()]},
                             vocab_size=100)
    tokens = timing_tokens(target, 2 * len(words) + 3)
    assert tokens.shape == (1, 2 * len(words) + 3)
    expected = [vocab[w] for w in words] * 3
    assert tokens[0].tolist() == expected[: 2 * len(words) + 3]
    target.tokenizer = None
    again = timing_tokens(target, 40)
    assert torch.equal(again, timing_tokens(target, 40)) and int(again.max()) < 100
