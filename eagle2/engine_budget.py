"""How much each engine step drafts and verifies (docs/draft-tree.md "Choosing the tree size
each step"): the speculation gate per batch size, the measured forward and draft costs, the
auto budget that keeps the tree nodes worth their cost, and the prompt-lookup and n-gram
chains verified on steps without a draft call. `TreeBudget` is part of `eagle2.engine.Engine`
(a mixin over its state).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from eagle2.budget import (
    DRAFT_NARROW_TOP_K,
    DRAFT_PROBE_TOP_K,
    SPECULATION_MARGIN,
    CostModel,
    MeasuredScales,
    SpeculationGate,
    choose_num_nodes,
    draft_key,
    measure_draft_levels,
    probe_backoff,
)
from eagle2.config import TreeConfig
from eagle2.lookup import (
    LookupNode,
    TokenHistory,
    lookup_tree_row,
    propose_branches,
    rank_branches,
)
from eagle2.sequence import SeqState
from eagle2.tree import HOST, DraftTree, prune_tree, root_only, tree_from_rows
from eagle2.verify import Verified


class TreeBudget:
    """The engine's per-step tree budget (`Engine`'s state: `seqs`, `runner`, `drafter`, the
    gates, costs, scales and realized rates it keeps)."""

    @property
    def gate(self) -> SpeculationGate:
        """The speculation gate of the current batch size. A size met for the first time while
        the engine is busy starts from the last size's back-off (a copy): a request finishing
        is no reason to probe the whole batch (newcomers probe by themselves: `_draft`)."""
        size = len(self.seqs)
        if size not in self.gates:
            last = self._last_gate
            self.gates[size] = (SpeculationGate() if last is None
                                else replace(last, history=[]))
        self._last_gate = self.gates[size]
        return self._last_gate

    @property
    def scales(self) -> MeasuredScales:
        """The measured scales of the current batch size (`MeasuredScales`): how a step's time
        compares with the cost grid depends on the batch (at batch 8 a step that verifies
        chains takes a second argmax round of 8 rows, ~1.9 ms on the AVX-512 Xeon, which the
        grid leaves to the scales; at batch 1 a second round is one row). A size met for the
        first time starts from the last size's (a copy); an idle engine reads the last one."""
        size = len(self.seqs) if self.scales_per_batch else 0
        if not size:
            return self._last_scales
        if size not in self.scales_of:
            self.scales_of[size] = replace(self._last_scales)
        self._last_scales = self.scales_of[size]
        return self._last_scales

    @property
    def costs(self) -> CostModel:
        """The target's forward costs (measured or read once; draft costs may follow)."""
        if not isinstance(self._costs, CostModel):
            # two contexts: a cost is read at the batch's mean context (`_context`)
            short, long = min(64, self.max_context // 4), min(512, self.max_context // 2)
            if self._cost_path is not None:
                head = None if self.drafter is None else self._draft_key
                self._costs = CostModel.cached(self.runner, self.max_batch, self._cost_path,
                                               short, long, draft_head=head)
            else:
                self._costs = CostModel.measure(self.runner, self.max_batch, prefix=short,
                                                long_prefix=long)
            self._timed = True
        return self._costs

    def _context(self) -> float:
        """Committed tokens per running request, mean over the batch (what the forward's
        attention reads; costs depend on it)."""
        lengths = self.runner.lengths[: len(self.seqs)].tolist()
        return sum(lengths) / len(lengths) if lengths else float("nan")

    @property
    def known_costs(self) -> CostModel | None:
        """The costs measured or read so far (draft costs included once measured); None
        before the first auto-budget step. Never measures."""
        return self._costs if isinstance(self._costs, CostModel) else None

    @property
    def _draft_key(self) -> str:
        """`draft_key` of the drafter, computed once per drafter (computing it took ~0.1 ms,
        and the budget asks for it several times a step; a tool may swap the drafter)."""
        if self._draft_key_of is None or self._draft_key_of[0] is not self.drafter:
            self._draft_key_of = (self.drafter, draft_key(self.drafter))
        return self._draft_key_of[1]

    def _sampled_costs(self, costs: CostModel) -> CostModel:
        """What a batch with a sampled request decides by: the costs of the thread count the
        load follower began at, whatever count it has switched to since (`follow_load`), so a
        seeded request samples the same on a machine that got busy as on a quiet one (its
        trees, so its sample, depend on the costs; each count has its own). The current
        costs for greedy batches, or while that count's costs (with a drafter: its draft
        costs too) are not known."""
        first = self._first_count
        if first is None or first == torch.get_num_threads() \
                or all(s.req.params.greedy for s in self.seqs):
            return costs
        ref = self._timing_of.get(first, (None,))[0]
        if isinstance(ref, CostModel) and (self.drafter is None or ref.draft_batches):
            return ref
        return costs

    def _draft_costs(self) -> CostModel:
        """The costs with the drafter's per-level time (measured once, on first need); a
        sampled batch's those of the first thread count (`_sampled_costs`)."""
        costs = self.costs
        if self.drafter is None or not self.seqs:
            return self._sampled_costs(costs)
        # the probe runs on free draft slots (an in-process drafter says how many); batches
        # beyond them are extrapolated, and measured once more slots are free
        free = (len(self.drafter.free) if hasattr(self.drafter, "free") else
                self.max_batch - len(self.seqs))
        wanted = [b for b in costs.batches if b <= min(free, self.max_batch)]
        key = self._draft_key
        measured = max(costs.draft_batches, default=0)
        if self._cost_path is not None and (costs.draft_head != key or not costs.draft_narrow_s):
            # the cache holds no draft costs for this head (given ones are kept), or only
            # those of wide levels (written before narrow levels were measured)
            measured = 0
        if wanted and max(wanted) > measured:
            feats = self.seqs[0].pending_feats
            levels = measure_draft_levels(self.drafter, wanted, feats.shape[-1], feats.dtype)
            wide, narrow = levels[DRAFT_PROBE_TOP_K], levels[DRAFT_NARROW_TOP_K]
            self._costs = costs = replace(costs, draft_batches=tuple(wide),
                                          draft_level_s=tuple(wide.values()),
                                          draft_narrow_s=tuple(narrow.values()), draft_head=key)
            if self._cost_path is not None:
                costs.save(self._cost_path)
        return self._sampled_costs(costs)

    def _timed_costs(self, costs: CostModel):
        """The forward cost function the budget decides by: scaled by the measured step times
        (`MeasuredScales`) when every request is greedy (a tree's size cannot change their
        outputs) and the costs were measured or read by the engine, else the cost model's own
        (seeded sampling stays reproducible)."""
        forward = self._forward_costs(costs)
        return self.scales.costs(forward) if self._greedy_timed() else forward

    def _forward_costs(self, costs: CostModel):
        """c(B, N, context) of the current batch's verification: without the logits where
        the runner takes greedy argmaxes so (`CostModel.greedy`), else the grid's."""
        if (costs.head_greedy_s and getattr(self.runner, "greedy_argmax", False)
                and all(s.req.params.greedy for s in self.seqs)):
            first = getattr(self.runner, "greedy_first_rows", 0)
            return functools.partial(costs.greedy, first_rows=first) if first else costs.greedy
        return costs

    def _greedy_timed(self) -> bool:
        return self._timed and all(s.req.params.greedy for s in self.seqs)

    def _draft_scale(self) -> float:
        return self.scales.draft if self._greedy_timed() else 1.0

    def _observe(self, tree: DraftTree, context: float, draft_s: float, verify_s: float) -> None:
        """Compare this step's measured times with the cost model's predictions."""
        costs = self.known_costs
        if costs is None or not costs.batches or not self._timed:
            return
        num_n = int(tree.tokens.shape[1])
        self.scales.observe("plain" if num_n == 1 else "tree", verify_s,
                            self._forward_costs(costs)(tree.batch_size, num_n, context))
        if self._predicted_draft > 0:
            self.scales.observe("draft", draft_s, self._predicted_draft)

    def _could_pay(self, drafting: int) -> bool:
        """Whether a step in which `drafting` of the batch's requests draft could beat plain
        decoding at all: if each of their n - 1 draft nodes were certain to be accepted,
        (B + drafting x (n - 1)) / (two narrow draft levels + c(B, n)) must beat B / c(B, 1)
        by SPECULATION_MARGIN for some n. Trees are padded to the largest, so a lone newcomer
        in a batch of 4 on a CPU without AMX never can (c(4, 2) = 1.42 c(4, 1) here): its
        probe would only cost (its prompt through the head, then a wider forward).
        For greedy batches a tree's accepted tokens are bounded by what kept trees have
        accepted lately (`_typical_accepted`) rather than by its size: at batch 8 on an AVX2
        CPU certain drafts would pay (16 tokens for c(8, 2) = 1.34 c(8, 1)), the accepted
        ones (~0.5 a tree) did not, and the probe of every batch of newcomers cost ~2% of
        their decoding (the prompts through the head, then a wider forward)."""
        costs = self._draft_costs()
        forward = self._timed_costs(costs)
        num_b, context = len(self.seqs), self._context()
        plain = num_b / forward(num_b, 1, context) * (1 + SPECULATION_MARGIN)
        draft = 2 * costs.draft_level(drafting, DRAFT_NARROW_TOP_K) * self._draft_scale()
        most = max(s.req.tree.num_nodes for s in self.seqs if s.auto)
        typical = self._typical_accepted() if self._greedy_timed() else None
        accepted = [n - 1 if typical is None else min(n - 1, typical) for n in range(most + 1)]
        return any((num_b + drafting * accepted[n]) / (draft + forward(num_b, n, context)) > plain
                   for n in range(2, most + 1))

    ACCEPTED_DECAY = 0.98  # per kept tree: about the last 50
    ACCEPTED_MIN_TREES = 8.0  # (decayed) kept trees before `_typical_accepted` says anything

    def _typical_accepted(self) -> float | None:
        """Draft tokens accepted per kept auto tree (a request's tree of more than the root),
        decayed over the engine's life (this head, the texts lately); None before
        ACCEPTED_MIN_TREES of them."""
        total, trees = self._accepted_sums
        return total / trees if trees >= self.ACCEPTED_MIN_TREES else None

    def _catch_up_cap(self, num_b: int) -> int:
        """Positions a request's head may catch up on in an auto draft call of a batch: as
        many as the time of one plain step buys (`CostModel.catch_up`, at least 16; 0 without
        draft costs). A long prompt or a probe's backlog then costs at most about a plain step
        (at batch 8 on the AVX2 EPYC each batch of newcomers' prompts had cost two), for a
        shorter context in the head (TreeConfig.catch_up). Not at batch 1, where drafting
        usually pays and the head's context is worth its pass: capped there (~80 positions
        on that CPU) HumanEval's tau fell from 1.56 to 1.41."""
        costs = self._draft_costs()
        if num_b <= 1 or not costs.draft_batches:
            return 0
        per_row = costs.catch_up(num_b, DRAFT_NARROW_TOP_K + 1) * self._draft_scale()
        if per_row <= 0:
            return 0
        plain = self._timed_costs(costs)(num_b, 1, self._context())
        return max(16, DRAFT_NARROW_TOP_K + int(plain / per_row))

    def _min_gain(self, num_b: int, width: int) -> float:
        """Expected accepted tokens one more tree level (of `width` nodes a request) must
        promise to be worth drafting: its draft time, and the verification of one more node a
        request beyond the largest tree kept in the last 8 steps (root and one draft at
        least), which its nodes would need to be kept. E.g. batch 1 on an AVX2 CPU: a level
        2.2 ms, a third node 6.3 ms (c(1, 2) = c(1, 1)), so at 55 tokens/s a level must
        promise 0.47 tokens, not 0.12 (the level below the kept trees, drafted to look ahead,
        cost ~2 ms of a ~9 ms draft call and was rarely kept)."""
        costs = self._draft_costs()
        forward, context = self._timed_costs(costs), self._context()
        rate = max(self._rate, num_b / forward(num_b, 1, context))
        size = max([2, *self._sizes_used])  # (the last 8 steps' sizes)
        verify = max(forward(num_b, size + 1, context) - forward(num_b, size, context), 0.0)
        return rate * (costs.draft_level(num_b, width) * self._draft_scale() + verify)

    def _choose_budget(self, tree: DraftTree, drafted: bool, drafted_s: float) -> DraftTree:
        """Cut the auto-budget trees to the size that pays best this step (eagle2.budget).
        drafted_s: the measured seconds of this step's draft call."""
        self.stats.auto_steps += 1
        auto = torch.tensor([s.auto for s in self.seqs], device=HOST)  # [B] (trees are here)
        if not drafted:  # lookup chains, if any, are already cut (`_lookup_trees`)
            self.stats.skipped_drafts += 1
            return tree
        costs = self._draft_costs()
        num_b = len(self.seqs)
        levels = (tree.head_depth() + 1) * costs.draft_level(num_b, self._width)
        # what the call cost is compared with: the levels and the head's first pass over the
        # pairs it had not seen (the backlog of plain steps: at batch 8 after a back-off ~37
        # positions a request; a newcomer's prompt). That pass is spent once the tree is
        # drafted, so the tree is chosen by what the levels cost, as a next step would pay
        self._predicted_draft = levels + costs.catch_up(num_b, self._caught_up)
        draft_s = levels * self._draft_scale()
        fixed = tree.num_nodes[~auto]
        values = tree.values[auto]
        scale = torch.tensor([self._acceptance_scale(s) for s in self.seqs if s.auto],
                             device=HOST)
        values = torch.cat([values[:, :1], (values[:, 1:] * scale[:, None]).clamp(max=1)], 1)
        choice = choose_num_nodes(values, self._timed_costs(costs), draft_s,
                                  int(fixed.max()) if len(fixed) else 1, context=self._context())
        # a verdict the realized rates contradict is overruled (greedy batches); a failed probe
        # backs off by its draft call: measured where timing cannot change an output (greedy
        # batches), else predicted (levels and catch-up)
        greedy, pays = self._greedy_timed(), choice.pays
        realized = self.realized.get(num_b) if greedy else None
        advantage = realized.advantage() if realized is not None else None
        if pays and advantage is not None and advantage < 1.0:
            pays = False
            self.stats.realized_vetoes += 1
        undrafted = self._undrafted_rate() if pays else None
        if undrafted is not None and choice.rate <= undrafted * (1 + SPECULATION_MARGIN):
            pays = False  # the chains alone would have done as well without the draft call
        self.gate.record(pays, probe_backoff(
            choice, draft_call_s=drafted_s if greedy else self._predicted_draft))
        self._rate = choice.rate
        self.stats.nodes_chosen[choice.num_nodes] += 1
        self.stats.predicted_accepted += choice.expected_tokens - int(auto.sum())
        keep = torch.where(auto, choice.num_nodes, tree.num_nodes)
        pruned = prune_tree(tree, keep)
        promised = pruned.values[:, 1:].float().clamp(0, 1).sum(1).tolist()
        for s, value in zip(self.seqs, promised, strict=True):
            s.kept_value = value
        self._depths_used = [*self._depths_used[-7:], pruned.select(auto).head_depth()]
        self._sizes_used = [*self._sizes_used[-7:], choice.num_nodes]
        return pruned

    ACCEPTANCE_DECAY = 0.9  # per step: the scale follows about the last 10 steps
    ACCEPTANCE_PRIOR = 2.0  # draft tokens of trust in the calibration before any step

    def _acceptance_scale(self, s: SeqState) -> float:
        """How this request's drafts fare against the calibration: accepted / promised over
        its recent steps, pulled toward 1 by a prior. The calibration is fitted on a mix of
        texts, and a head is better at some (code, quoting) than at others (open chat): a
        request whose drafts are accepted less often than the values promise gets smaller
        trees (or none), one whose drafts do better gets bigger ones. It depends only on the
        request's own accepted lengths, so seeded runs stay reproducible."""
        return self._scale(s.got, s.promised)

    def _scale(self, got: float, promised: float) -> float:
        """Accepted / promised draft tokens, pulled toward 1 by ACCEPTANCE_PRIOR tokens."""
        return (got + self.ACCEPTANCE_PRIOR) / (promised + self.ACCEPTANCE_PRIOR)

    def _count_lookup(self, tree: DraftTree, verified: Verified) -> None:
        if not bool(tree.lookup.any()):
            return
        flags = tree.lookup.tolist()
        accepted = [sum(flags[b][n] for n in nodes) for b, nodes in enumerate(verified.nodes)]
        self.stats.lookup_offered += sum(map(sum, flags))
        self.stats.lookup_accepted += sum(accepted)
        if self._lookup_only:
            self.stats.lookup_step_accepted += sum(accepted)
            self.stats.ngram_chains += len(self._ngram_rows)
            self.stats.ngram_accepted += sum(accepted[b] for b in self._ngram_rows)

    def _lookup_trees(self, idx: list[int]) -> DraftTree:
        """Trees of the requests in idx, which no draft call serves this step: the root, and
        for an auto-budget request with prompt lookup the chains lookup proposes after
        it as one tree (the longest earlier match of its last tokens and what followed,
        `TokenHistory`, valued by the lookup table, and the n-gram store's continuation:
        `_proposals`; no model runs). When no request of the batch drafts, every tree is cut
        here to its best n nodes, one n for the batch, the n that pays best
        (`_lookup_length`); otherwise the budget weighs them with the drafted trees
        (`_choose_budget`). Where the head's drafts
        do not pay (the gate is shut), text that repeats itself (code, quoted input) still
        gets multi-token steps for the verification of a few more tokens (on a CPU c(1, 2)
        is about c(1, 1)). Sampled requests too: verification takes a lookup token as a
        one-hot proposal, accepted with the target's probability of it (lossless as any
        draft); the table's rates, fitted on greedy decoding, stand in for that probability
        (they overstate it where the target is unsure, which the cut then pays for), and a
        chain depends only on the request's own tokens, the cut on the untimed costs when a
        request samples, so a seeded request reproduces."""
        seqs = [self.seqs[i] for i in idx]
        roots = [int(s.pending_tokens[-1]) for s in seqs]
        if len(idx) == len(self.seqs) and self._lookup_vetoed():
            self.stats.lookup_vetoes += 1
            return root_only(torch.tensor(roots, device=HOST))
        proposed = self._proposals(seqs) if self.lookup_alone else []
        if not any(proposed):
            return root_only(torch.tensor(roots, device=HOST))
        values = [self._chain_values(s, [n.value for n in nodes])
                  for s, nodes in zip(seqs, proposed, strict=True)]
        if len(idx) == len(self.seqs):
            # ranked by value (`rank_branches`): the best n nodes of a row are its first n
            length = self._lookup_length(values)[0]
            if length == 0:
                return root_only(torch.tensor(roots, device=HOST))
            values = [v[:length] for v in values]
            for s, kept in zip(seqs, values, strict=True):
                s.chain_value = sum(kept)
            self._lookup_only = True
            self._ngram_rows = [b for b, (nodes, kept) in enumerate(zip(proposed, values,
                                                                        strict=True))
                                if any(n.store for n in nodes[: len(kept)])]
            self.stats.lookup_steps += 1
        return tree_from_rows([lookup_tree_row(root, nodes, kept)
                               for root, nodes, kept in zip(roots, proposed, values, strict=True)],
                              HOST)

    # the largest batch whose lookup trees take both chains: in one process (engine_ab,
    # one-branch against shipped), 40 + 40 prompts, two threads on the AVX-512 Xeon, trees of
    # both against the chain worth more read batch 1 +2.9% / +1.5% (x 256 tokens), batch 4
    # -4.2% / +8.2%, batch 8 -5.7% / -2.3%, -3.8% / +0.3% and -5.0% / -2.5% (x 128; MT-bench /
    # HumanEval): at batch 8 a fork's node costs 8 rows of a compute-bound forward, and the
    # steps it tips into verifying chains lose
    LOOKUP_FORK_BATCH = 4

    def _proposals(self, seqs: list[SeqState]) -> list[list[LookupNode]]:
        """Per request, the tree of the chains lookup proposes after its last token (prompt
        lookup's and the n-gram store's, `lookup.propose_branches`, the store's for all of
        them in one call; each at most its tree's lookup length; the one worth more alone at
        batches above LOOKUP_FORK_BATCH) as nodes ranked by value
        (`lookup.rank_branches`, at most its tree's draft nodes); [] for requests that take
        none. Histories catch up on their requests' new tokens first."""
        takes = [s.auto and s.req.tree.mode == "eagle2" and s.req.tree.lookup > 0 for s in seqs]
        takers = [s for s, t in zip(seqs, takes, strict=True) if t]
        for s in takers:
            if s.history is None:
                s.history = TokenHistory()
                s.history.extend(list(s.req.prompt_ids))
            known = len(s.history) - len(s.req.prompt_ids)
            if known < len(s.output):
                s.history.extend(s.output[known:])
        branches = iter(propose_branches([s.history for s in takers],
                                         [min(s.req.tree.lookup, s.req.tree.num_nodes - 1)
                                          for s in takers], self.lookup_table, self.ngram))
        most = self.lookup_branches if len(self.seqs) <= self.LOOKUP_FORK_BATCH else 1
        return [rank_branches(next(branches)[:most], s.req.tree.num_nodes - 1)
                if t else []
                for s, t in zip(seqs, takes, strict=True)]

    def _chain_scale(self, s: SeqState) -> float:
        """How a sampled request's lookup chains on steps without a draft call fare against
        their values: accepted / promised over its recent such steps, pulled toward 1 by a
        prior (as `_acceptance_scale` for drafts); 1 for greedy requests. The values are
        fitted on held-out greedy answers; a sampled request's chains are accepted with the
        target's probability of each token, often far less (MT-bench at T = 1: 0.43 tokens a
        chain step, and eagle2 decoded 8% slower than plain decoding; scaled: 3%). Greedy
        requests read within the spread either way (batch 1 +1.5% / +0.4%, batch 2 -2.9% /
        -1.4%). It depends only on the request's own accepted lengths, so seeded runs stay
        reproducible."""
        if s.req.params.greedy:
            return 1.0
        return self._scale(s.chain_got, s.chain_promised)

    def _chain_values(self, s: SeqState, values: list[float]) -> list[float]:
        """A chain's values as the budget weighs them: times s's `_chain_scale`, at most 1."""
        scale = self._chain_scale(s)
        return [min(v * scale, 1.0) for v in values]

    def _lookup_length(self, values: list[list[float]]) -> tuple[int, float]:
        """The node count n (0: none) that maximises predicted tokens per second over the
        whole batch, every request's lookup tree cut to its best n nodes (values: each row's,
        highest first): (B + sum of the kept values) / c(B, 1 + n), against plain decoding's
        B / c(B, 1) (`budget.choose_num_nodes` without a draft call), trying more nodes
        until two counts in a row gain nothing; and that rate.
        The gate is not told: no draft call was made."""
        num_b, context = len(self.seqs), self._context()
        forward = self._timed_costs(self._sampled_costs(self.costs))
        best, length = num_b / forward(num_b, 1, context), 0
        expected = float(num_b)
        for n in range(1, max(map(len, values), default=0) + 1):
            expected += sum(v[n - 1] for v in values if len(v) >= n)
            rate = expected / forward(num_b, n + 1, context)
            if rate > best:
                best, length = rate, n
            elif n >= length + 2:  # values fall and costs rise: two lengths without a gain end it
                break
        return length, best

    def _undrafted_rate(self) -> float | None:
        """Predicted tokens per second of this step had no request drafted: the lookup chains
        alone, cut to the best length (`_lookup_trees`); None where the batch would not take
        them (chains off, or a request with a fixed tree). A draft call pays only if it beats
        this: where the chains are good (an n-gram store, text that repeats) the step gets
        them without one."""
        if not self.lookup_alone or not all(s.auto for s in self.seqs):
            return None
        if self._lookup_vetoed():  # they would not be verified: a plain step
            return self._lookup_length([])[1]
        return self._lookup_length([self._chain_values(s, [n.value for n in nodes])
                                    for s, nodes in zip(self.seqs, self._proposals(self.seqs),
                                                        strict=True)])[1]

    def _lookup_vetoed(self) -> bool:
        """Whether steps without a draft call should leave lookup chains out (and not propose
        them: ~0.7 ms a step at batch 8): where their realized rates at this batch size say
        such steps with chains delivered fewer tokens per second than those without (greedy
        batches; `budget.RealizedRates`, whose evidence fades, so chains are tried again
        now and then). E.g. batch 8 on the AVX-512 Xeon, MT-bench: chains cut to pay by the
        table and the cost grid still lost 1-2% against plain steps, and proposing them cost
        another 2.5%."""
        if not self._greedy_timed():
            return False
        rates = self.lookup_realized.get(len(self.seqs))
        advantage = rates.advantage() if rates is not None else None
        return advantage is not None and advantage < 1.0

    def _expansions(self, config: TreeConfig) -> TreeConfig:
        """An auto tree expands one level past the deepest node kept in the last 8 steps: the
        levels below it cost draft time and were not chosen (e.g. where verifying a third
        token costs far more than a second, trees stay shallow and so does the drafting).

        Likewise its levels are at most as wide as the largest tree kept in those steps
        (root included, so one node more than that tree's drafts; at least 2): a tree of m
        draft nodes keeps each level's best nodes, which a frontier of top_k >= m finds
        (a node outside its level's top m has m better ones before it), and the level's cost
        grows with its width (B x top_k rows through the head and its vocabulary: at batch
        8 a level of 2 nodes a request cost 8 ms here, of 8 nodes 21 ms)."""
        if config.budget != "auto" or not self._depths_used:
            return config
        return replace(config, depth=min(config.depth, max(1, *self._depths_used)),
                       top_k=min(config.top_k, max(DRAFT_NARROW_TOP_K, *self._sizes_used)))
