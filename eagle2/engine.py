"""The batched speculative decoding loop: prefill, draft, verify, commit.

See docs/kv-cache.md. The engine's parts: how requests start (admission, preemption, chunked
prefill: `eagle2.engine_admission`), how much each step drafts and verifies (the speculation
gate, costs and auto budget, lookup chains: `eagle2.engine_budget`), what it keeps per request
(`eagle2.sequence`).

Continuous batching: requests join between steps (their prompts are prefilled together) and
leave when finished. Target-cache slots are kept compact (a finished request's slot takes the
last one's), so the target reads its cache through views. Each step:
  1. draft: the drafter gets each sequence's newly committed (feature, next token) pairs and
     returns its tree (vanilla sequences get the one-node tree);
  2. verify: one target forward over all trees (padded), then greedy or sampling acceptance;
  3. commit: the accepted path's K/V move to the end of each prefix; its features and the new
     tokens become the next step's drafter input.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch

from eagle2.budget import (
    DRAFT_PROBE_TOP_K,
    CostModel,
    MeasuredScales,
    RealizedRates,
    SpeculationGate,
)
from eagle2.config import TreeConfig
from eagle2.engine_admission import Admission, Chunked
from eagle2.engine_budget import TreeBudget
from eagle2.lookup import LookupTable
from eagle2.ngram import NgramStore
from eagle2.paging import Paging
from eagle2.runner import PromptBatch, TargetRunner
from eagle2.sequence import Event, Request, SeqState, fold_seed, pad_pending
from eagle2.tree import HOST, DraftTree, to_device
from eagle2.verify import TokenLogprobs, Verified

__all__ = ["DrafterLike", "Engine", "EngineStats", "Event", "Request", "fold_seed"]


class DrafterLike(Protocol):
    """What the engine needs from a drafter (in-process `Drafter` or a remote draft worker)."""

    def draft(self, seq_ids: list[str], features: torch.Tensor, tokens: torch.Tensor,
              counts: torch.Tensor, config: TreeConfig, min_gain: float = 0.0) -> DraftTree: ...

    def release(self, seq_id: str) -> None: ...


@dataclass
class EngineStats:
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    other_s: float = 0.0
    steps: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    auto_steps: int = 0  # steps with auto-budget requests
    skipped_drafts: int = 0  # of those, steps decoded plainly because speculation did not pay
    # of those, the gate's re-probes left out: not even the typical acceptance could pay
    skipped_probes: int = 0
    nodes_chosen: Counter = field(default_factory=Counter)  # auto budget: tree size -> steps
    # auto budget, drafted steps: accepted draft tokens the calibrated values promised (times
    # each request's acceptance scale), and how many verification accepted (the check)
    predicted_accepted: float = 0.0
    accepted: int = 0
    # drafted steps whose predicted gain the realized rates at their batch size overruled
    # (`budget.RealizedRates`)
    realized_vetoes: int = 0
    # prompt-lookup nodes (proposed by lookup alone) in the verified trees, and how many of
    # them verification accepted (docs/draft-tree.md "Prompt lookup")
    lookup_offered: int = 0
    lookup_accepted: int = 0
    # steps that verified prompt-lookup chains without a draft call (auto budget, where the
    # head's drafts did not pay: `Engine._lookup_trees`), and the tokens they accepted
    lookup_steps: int = 0
    lookup_step_accepted: int = 0
    # of those steps' chains, the ones the n-gram store proposed (`eagle2.ngram`) and the
    # tokens of theirs verification accepted
    ngram_chains: int = 0
    ngram_accepted: int = 0
    # steps without a draft call that verified no lookup chains, and proposed none, because
    # such steps had lately delivered fewer tokens per second at this batch size than plain
    # ones (`Engine._lookup_vetoed`)
    lookup_vetoes: int = 0
    # torch thread counts the engine switched to while other processes took or freed cores
    # (`Engine.threads`, `eagle2.threads.LoadFollower`), in order
    thread_switches: list[int] = field(default_factory=list)
    # paged cache (docs/kv-cache.md "Paged cache"): prompt tokens (a preempted request's
    # prompt and output) looked up in the prefix cache, and of those the ones found cached;
    # tokens the prefills computed; requests preempted because blocks ran out
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    # steps whose verification forward also read prompts: newcomers', a chunk
    # (`Engine.mix_prompts`)
    mixed_steps: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens whose K/V came from the prefix cache, over those looked up."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens \
            else 0.0


class Engine(TreeBudget, Admission):
    """Runs many requests through one target (and one drafter) in lockstep batches."""

    tree_margin = 130  # cache entries past max_context for the tree being verified

    def __init__(self, runner: TargetRunner, drafter: DrafterLike | None, max_batch: int = 8,
                 max_context: int = 2048, tree_margin: int | None = None,
                 costs: CostModel | Path | None = None, lookup_alone: bool = True,
                 lookup_table: LookupTable | None = None, ngram: NgramStore | None = None,
                 max_running: int | None = None, prefix_caching: bool = True):
        """runner: a target with max_batch cache slots of max_context + tree_margin entries.
        max_running: the most requests a step runs (the runner's slots; max_batch is its
        older name, used where this is None). Where the runner's cache is paged
        (`LocalRunner.paged`), requests start only when blocks are free for them, the newest is
        preempted when blocks run out (and recomputed later), and with prefix_caching a
        request reuses the cached blocks of its prompt's longest cached prefix
        (docs/kv-cache.md "Paged cache").
        costs: this machine's forward and draft costs (auto budgets): a CostModel, a cache
        file (read, or measured once and written there), or None (measured, kept in memory).
        Measured at the first auto-budget step unless `costs` is touched before.
        lookup_alone: on steps where an auto-budget request is not drafted, verify the chain
        prompt lookup proposes for it where the budget says it pays (`_lookup_trees`).
        lookup_table: what such a chain's nodes are worth (default: the in-process drafter's
        fitted table, else the conservative default).
        ngram: the n-gram store whose chains compete with prompt lookup's on those steps
        (default: the in-process drafter's, where its head ships one; `eagle2.ngram`)."""
        max_batch = max_running if max_running is not None else max_batch
        if max_batch < 1:
            raise ValueError(f"max_running (max_batch) must be >= 1, got {max_batch}")
        self.runner, self.drafter = runner, drafter
        self.max_batch, self.max_context = max_batch, max_context
        self.tree_margin = tree_margin or Engine.tree_margin
        self.seqs: list[SeqState] = []  # index = cache slot
        self.waiting: list[Request] = []
        # paged cache: block tables, admission and preemption by blocks, prefix caching
        self.paging = (Paging(runner, max_context + self.tree_margin, prefix_caching)
                       if getattr(runner, "paged", None) else None)
        self.preempted: list[SeqState] = []  # to resume (recomputed), oldest admitted first
        # the tokens a prefill runs through the layers stay within this (one request always
        # goes): right-padded, requests x the longest, which also bounds its [B, W, W] mask;
        # one group a prompt (`_varlen`), their sum
        self.prefill_budget = 8192
        # while requests run, the prompt tokens a step reads beside their trees: the chunked
        # prompt's next piece first, then newcomers whole while they fit, then the next one's
        # first piece (`_admit_within`; without mixing: a longer prompt is read this many
        # tokens a step, `_prefill_chunk`)
        self.prefill_chunk = 256
        # False: newcomers' whole prompts are read outside that budget (up to
        # prefill_budget), a prompt longer than prefill_chunk chunked alone (the policy
        # before, for A/B: a burst of arrivals is then one long step for the running ones)
        self.newcomers_in_budget = True
        self.chunking: Chunked | None = None
        # newcomers' prompts and the chunk ride in the running requests' verification forward
        # (one pass over the weights for all) where the runner can (`mixed_step`); False: a
        # prefill is a step of its own, a chunk a forward of its own
        self.mix_prompts = True
        self._admitted = 0  # requests admitted so far (`SeqState.order`)
        self.stats = EngineStats()
        self._costs = costs
        self._cost_path = costs if isinstance(costs, Path) else None
        # one gate per batch size: whether speculation pays depends on it, and what was learnt
        # at a batch size holds for the next requests that run at that size while the engine
        # stays busy, and across idle periods for greedy requests (cleared when a sampled
        # request joins an idle engine: `_prefill`)
        self.gates: dict[int, SpeculationGate] = {}
        # per batch size, what drafting and plain steps delivered (greedy batches only, where
        # timing cannot change an output; so, unlike the gates, kept when the engine idles)
        self.realized: dict[int, RealizedRates] = {}
        # ... and what steps without a draft call delivered with lookup chains ("spec") and
        # without ("plain"), per batch size (`_lookup_vetoed`)
        self.lookup_realized: dict[int, RealizedRates] = {}
        self._last_gate: SpeculationGate | None = None  # the gate of the last step's batch size
        self._rate = 0.0  # tokens/s predicted for the last speculative step
        self._depths_used: list[int] = []  # deepest kept node of recent auto trees
        self._sizes_used: list[int] = []  # nodes kept per auto tree (root included), recent
        self._width = DRAFT_PROBE_TOP_K  # top_k of this step's auto-budget drafts
        # measured step times / predicted per batch size, for costs the engine measured or
        # read itself (a CostModel given to it is taken as it is): `scales`
        self.scales_of: dict[int, MeasuredScales] = {}
        self._last_scales = MeasuredScales()
        self.scales_per_batch = True  # False: one scale for every batch size (for A/B)
        self._timed = False
        self._predicted_draft = 0.0  # this step's draft call, predicted (0: none)
        # draft tokens accepted by kept auto trees and how many trees, decayed sums
        # (`_typical_accepted`; like `realized`, kept when the engine idles)
        self._accepted_sums = (0.0, 0.0)
        self._caught_up = 1  # new positions per sequence the drafter ran over this step
        self._draft_key_of: tuple[object, str] | None = None  # (drafter, its `draft_key`)
        self.lookup_alone = lookup_alone
        # lookup branches a request's tree on such steps may take at batches up to
        # LOOKUP_FORK_BATCH: prompt lookup's and the n-gram store's (1: the one worth more)
        self.lookup_branches = 2
        self._lookup_only = False  # this step verifies lookup chains without a draft call
        self._ngram_rows: list[int] = []  # ... and these rows' chains are the n-gram store's
        self.lookup_table: LookupTable = (lookup_table or getattr(drafter, "lookup_table", None)
                                          or LookupTable())
        self.ngram: NgramStore | None = ngram or getattr(drafter, "ngram", None)
        # CPU: follows other processes' load with the torch thread count (`follow_load`)
        self.threads = None
        self._cost_path_of = None
        self._timing_of: dict[int, tuple] = {}  # thread count -> its timing state
        self._first_count: int | None = None  # the count the follower began at
        for store in (self.ngram, getattr(drafter, "ngram", None)):
            if store is not None:
                store.check_vocab(runner.vocab_size)

    def follow_load(self, follower, cost_path_of) -> None:
        """Before each step, switch the torch thread count to what `follower.poll()` says
        (`eagle2.threads.LoadFollower`: fewer threads while other processes take cores).
        cost_path_of(): the cost cache of the current count. What the engine measured at a
        count (its forward and draft costs, the measured/predicted step-time scales, the
        realized rates of drafting and plain steps) is kept per count: times at another count
        would mislead the budget, and a count met again takes up its own."""
        self.threads, self._cost_path_of = follower, cost_path_of

    def _follow_load(self) -> None:
        if self._first_count is None:
            self._first_count = torch.get_num_threads()
        count = self.threads.poll()
        if count is None or count == torch.get_num_threads():
            return
        self._timing_of[torch.get_num_threads()] = (
            self._costs, self._cost_path, self.scales_of, self._last_scales, self._timed,
            self.realized, self.lookup_realized)
        torch.set_num_threads(count)
        if count in self._timing_of:
            (self._costs, self._cost_path, self.scales_of, self._last_scales, self._timed,
             self.realized, self.lookup_realized) = self._timing_of.pop(count)
        else:
            self._costs = self._cost_path = self._cost_path_of()
            self.scales_of, self._last_scales, self._timed = {}, MeasuredScales(), False
            self.realized, self.lookup_realized = {}, {}
        self.stats.thread_switches.append(count)

    # ----- admission --------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        if not req.prompt_ids:
            raise ValueError("empty prompt: give at least one token")
        if len(req.prompt_ids) >= self.max_context:
            raise ValueError(f"prompt has {len(req.prompt_ids)} tokens; the context is "
                             f"{self.max_context} (prompt + at least one new token)")
        if any(not 0 <= t < self.runner.vocab_size for t in req.prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.runner.vocab_size})")
        if req.tree.num_nodes > self.tree_margin - 1:
            raise ValueError(f"tree of {req.tree.num_nodes} nodes exceeds this engine's "
                             f"margin ({self.tree_margin - 1})")
        if req.tree.mode != "vanilla" and self.drafter is None:
            raise ValueError(f"mode {req.tree.mode!r} needs a draft head; this engine has none")
        if req.seq_id in self.ids():
            raise ValueError(f"sequence id {req.seq_id!r} is already running")

    def add(self, req: Request) -> None:
        self.validate(req)
        self.waiting.append(req)

    def ids(self) -> set[str]:
        chunking = {self.chunking.req.seq_id} if self.chunking is not None else set()
        return ({s.req.seq_id for s in self.seqs + self.preempted}
                | {r.seq_id for r in self.waiting} | chunking)

    def has_work(self) -> bool:
        return bool(self.seqs or self.waiting or self.preempted or self.chunking)

    def cancel(self, seq_id: str) -> None:
        self.waiting = [r for r in self.waiting if r.seq_id != seq_id]
        self.preempted = [s for s in self.preempted if s.req.seq_id != seq_id]
        if self.chunking is not None and self.chunking.req.seq_id == seq_id:
            self._drop_chunk()
            return
        for i, s in enumerate(self.seqs):
            if s.req.seq_id == seq_id:
                self._remove(i)
                return

    # ----- the step ---------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Admit waiting requests (prefill) or run one draft-verify-commit step for all."""
        if self.threads is not None:
            self._follow_load()
        # newcomers and a long prompt's chunks ride in the running requests' verification
        # forward where the runner can (`_mixing`: admitted after the trees took their blocks,
        # `_admit_within`); else a prefill is a step of its own and a chunk runs now in a
        # forward of its own
        mixing = bool(self.seqs) and self._mixing()
        if not mixing and self._can_admit():
            how = self._admission()
            if how == "prefill":
                return self._prefill()
            if how == "chunk":
                self._start_chunking()
        chunked = self._prefill_chunk() if self.chunking is not None and not mixing else []
        if not self.seqs:
            return chunked
        t0 = time.perf_counter()
        num_b, auto, greedy = len(self.seqs), any(s.auto for s in self.seqs), self._greedy_timed()
        draft_auto = self.gate.should_draft() if auto else True
        if draft_auto and auto and self.gate.backoff and not self._could_pay(num_b):
            # a re-probe of a batch size that backed off, where not even its typical
            # acceptance could pay (`_could_pay`): the probe would only cost
            self.gate.record(False)
            self.stats.skipped_probes += 1
            draft_auto = False
        self._predicted_draft = 0.0
        self._lookup_only = False  # set where the step verifies lookup chains alone
        self._ngram_rows = []
        tree = self._draft(draft_auto)
        drafted_s = time.perf_counter() - t0
        drafted = any(s.drafted for s in self.seqs if s.auto)
        if auto:
            tree = self._choose_budget(tree, drafted, drafted_s)
        if self.paging is not None:
            tree = self._reserve(tree)
            if not self.seqs:  # all preempted beside a chunked prefill's blocks
                # (without mixing its chunk already ran this step: `chunked`)
                return chunked + (self._prefill_chunk() if mixing and self.chunking is not None
                                  else [])
        t1 = time.perf_counter()
        context = self._context()
        # the chunked prompt's next piece, newcomers and a new chunked prompt's first piece
        # start in this forward (their blocks taken after the trees')
        old, batch, new = self._admit_within() if mixing else (None, [], None)
        newcomers = self._prefill_inputs(batch) if batch else []
        chunks = [c for c in (old, new) if c is not None]
        prompts = newcomers + [self._next_chunk(c) for c in chunks]
        verified, features, read = self._verify(tree, prompts)
        self._count_lookup(tree, verified)
        t2 = time.perf_counter()
        mixed = bool(prompts)
        if not mixed:  # (a mixed step's time is not its trees': the cost model learns none)
            self._observe(tree, context, drafted_s, t2 - t1)
        events = self._advance(verified, features, drop=False)
        if batch:  # the newcomers' rows follow the running ones
            events += self._prefill_done(batch, newcomers, read[:len(newcomers)])
        for ch, done in zip(chunks, read[len(newcomers):], strict=True):
            events += self._chunk_done(ch, *done)
        if new is not None:
            self._chunk_on(new)
        self._drop_finished(events)
        self.stats.mixed_steps += mixed
        t3 = time.perf_counter()
        if auto and greedy and not mixed:
            committed = sum(map(len, verified.tokens))
            self.realized.setdefault(num_b, RealizedRates()).observe(drafted, committed, t3 - t0)
            if not drafted:
                self.lookup_realized.setdefault(num_b, RealizedRates()).observe(
                    self._lookup_only, committed, t3 - t0)
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += t2 - t1
        self.stats.other_s += t3 - t2
        self.stats.steps += 1
        return chunked + events

    def _draft(self, draft_auto: bool = True) -> DraftTree:
        """One tree per sequence; auto-budget ones get the one-node tree if not draft_auto,
        unless they just joined (a probe of the newcomers only: their text may suit the head
        where the others' did not, and drafting for the whole batch is what a probe costs)."""
        groups: dict[TreeConfig | None, list[int]] = {}
        probes = sum(s.probe and s.auto for s in self.seqs)
        if not draft_auto and probes and not self._could_pay(probes):
            probes = 0  # not even certain drafts for the newcomers could pay at this batch
        for i, s in enumerate(self.seqs):
            s.drafted = s.req.tree.mode != "vanilla" and (
                draft_auto or not s.auto or (s.probe and probes > 0))
            s.probe = False
            groups.setdefault(s.req.tree if s.drafted else None, []).append(i)
        parts: list[tuple[list[int], DraftTree]] = []
        for config, idx in groups.items():
            if config is None:
                parts.append((idx, self._lookup_trees(idx)))
                continue
            feats, toks, counts = pad_pending([self.seqs[i].take_backlog() for i in idx])
            if config.budget == "auto":
                cap = self._catch_up_cap(len(self.seqs))
                if cap and (not config.catch_up or cap < config.catch_up):
                    config = replace(config, catch_up=cap)
            # positions the head runs over first (at most catch_up: Drafter._restart)
            self._caught_up = min(int(counts.max()), config.catch_up or int(counts.max()))
            ids = [self.seqs[i].req.seq_id for i in idx]
            config = self._expansions(config)
            gain = 0.0
            if config.budget == "auto":
                self._width = config.top_k
                gain = self._min_gain(len(self.seqs), config.top_k)
            # the head's device (in-process), or the wire's (a worker) -> the engine's
            tree = to_device(self.drafter.draft(ids, feats, toks, counts, config, gain), HOST)
            parts.append((idx, tree))
        if len(parts) == 1:
            return parts[0][1]
        order = [i for idx, _ in parts for i in idx]
        tree = DraftTree.concat([t for _, t in parts])
        inverse = torch.empty(len(order), dtype=torch.long, device=HOST)
        inverse[torch.tensor(order, device=HOST)] = torch.arange(len(order), device=HOST)
        return tree.select(inverse)

    def _verify(self, tree: DraftTree, prompts: list[PromptBatch]):
        """One target forward over all trees (and prompts: `LocalRunner.mixed_step`) and
        acceptance, where the logits are (the runner). -> (Verified, accepted nodes' features
        [B, A, H], each prompt batch's `prefill_step` result)."""
        dev = self.runner.device
        num_b = tree.batch_size
        slots = torch.arange(num_b, device=dev)
        positions = self.runner.lengths[:num_b, None] + to_device(tree.depths, dev)
        self.stats.batch_sizes.append(num_b)
        params, gens = [s.req.params for s in self.seqs], [s.generator for s in self.seqs]
        if prompts:
            return self.runner.mixed_step(tree, positions, slots, params, gens, prompts)
        return (*self.runner.verify_step(tree, positions, slots, params, gens), [])

    def _advance(self, verified: Verified, features: torch.Tensor,
                 drop: bool = True) -> list[Event]:
        """Commit the accepted paths; their features [B, A, H] feed the next draft. drop:
        finished requests leave their rows now (else the caller drops them)."""
        dev = self.runner.device
        features = to_device(features, dev)  # from the runner (rank 0's copy: the driver's)
        width = max(len(n) for n in verified.nodes)
        # on the host, where the cache reads them (`KVCache.commit`)
        node_idx = torch.tensor([n + [0] * (width - len(n)) for n in verified.nodes],
                                device=HOST)
        kept = torch.tensor([len(n) for n in verified.nodes], device=HOST)
        slots = torch.arange(len(self.seqs), device=dev)
        self.runner.commit(slots, node_idx, kept)
        events = []
        for b, s in enumerate(self.seqs):
            n = len(verified.nodes[b])
            new_feats = features[b, :n]
            new_tokens = torch.tensor(verified.tokens[b], device=HOST)  # (`SeqState`)
            if s.auto and not s.drafted:  # the drafter has not seen the pending pairs yet
                s.backlog.append((s.pending_feats, s.pending_tokens))
            s.pending_feats, s.pending_tokens = new_feats, new_tokens
            if s.auto and s.drafted:
                self.stats.accepted += n - 1
                if s.kept_value > 0:  # a tree was kept for it
                    total, trees = self._accepted_sums
                    self._accepted_sums = (self.ACCEPTED_DECAY * total + n - 1,
                                           self.ACCEPTED_DECAY * trees + 1)
                decay = self.ACCEPTANCE_DECAY
                s.promised = decay * s.promised + s.kept_value
                s.got = decay * s.got + (n - 1)
            elif s.auto:  # a plain step: the evidence fades, so a text that changes is retried
                s.promised *= self.ACCEPTANCE_DECAY
                s.got *= self.ACCEPTANCE_DECAY
                # ... its lookup chain's promise and what was accepted of it: none where the
                # step verified no chain cut for it alone (`_lookup_trees`; in a step with
                # drafted requests the budget weighs it with their trees), the evidence fading
                got = n - 1 if s.chain_value > 0 else 0
                s.chain_promised = self.ACCEPTANCE_DECAY * s.chain_promised + s.chain_value
                s.chain_got = self.ACCEPTANCE_DECAY * s.chain_got + got
            s.chain_value = 0.0
            s.num_steps += 1
            s.accepted_at_depth[n - 1] += 1
            events.append(self._emit(s, verified.tokens[b], verified.logprobs[b]
                                     if verified.logprobs is not None else None))
        if self.paging is not None and self.paging.blocks.prefix_caching:
            # full blocks become shareable (kept after a request ends, e.g. the next turn's)
            for s, length in zip(self.seqs, self.runner.lengths[: len(self.seqs)].tolist(),
                                 strict=True):
                self.paging.commit(s.req.seq_id, length, s.tokens)
        if drop:
            self._drop_finished(events)
        return events

    def _emit(self, s: SeqState, new_tokens: list[int],
              logprobs: list[TokenLogprobs] | None = None) -> Event:
        """Append tokens up to EOS / max_tokens / context end and say whether s is done;
        logprobs: the tokens' TokenLogprobs (the event carries those of the tokens taken)."""
        reason = None
        take = []
        for t in new_tokens:
            take.append(t)
            if t in s.req.eos_ids and not s.req.params.ignore_eos:
                reason = "stop"
                break
            if len(s.output) + len(take) >= s.req.params.max_tokens:
                reason = "length"
                break
        s.output.extend(take)
        if reason is None and len(s.req.prompt_ids) + len(s.output) >= self.max_context:
            reason = "length"
        return Event(s.req.seq_id, take, reason is not None, reason, s.num_steps,
                     dict(s.accepted_at_depth),
                     logprobs[:len(take)] if logprobs is not None else None)

    def _drop_finished(self, events: list[Event]) -> None:
        done = {e.seq_id for e in events if e.finished}
        for i in reversed(range(len(self.seqs))):
            if self.seqs[i].req.seq_id in done:
                self._remove(i)

    def _remove(self, i: int) -> None:
        s = self.seqs[i]
        last = len(self.seqs) - 1
        if i != last:
            self.runner.copy_slot(last, i)
            self.seqs[i] = self.seqs[last]
        self.seqs.pop()
        dev = self.runner.device
        self.runner.set_lengths(torch.tensor([last], device=dev), torch.tensor([0], device=dev))
        if self.paging is not None:
            self.paging.free(s.req.seq_id, i, last)
        if self.drafter is not None and s.req.tree.mode != "vanilla":
            self.drafter.release(s.req.seq_id)
