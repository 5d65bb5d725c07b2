"""The batched speculative decoding loop: prefill, draft, verify, commit.

See docs/kv-cache.md.

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

import functools
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch

from eagle2.attention import causal_mask
from eagle2.budget import (
    DRAFT_NARROW_TOP_K,
    DRAFT_PROBE_TOP_K,
    SPECULATION_MARGIN,
    CostModel,
    MeasuredScales,
    RealizedRates,
    SpeculationGate,
    choose_num_nodes,
    draft_key,
    measure_draft_levels,
    probe_backoff,
)
from eagle2.config import SamplingParams, TreeConfig
from eagle2.lookup import (
    LookupNode,
    LookupTable,
    TokenHistory,
    lookup_tree_row,
    propose_branches,
    rank_branches,
)
from eagle2.ngram import NgramStore
from eagle2.paging import Paging
from eagle2.runner import PromptBatch, TargetRunner
from eagle2.tree import HOST, DraftTree, prune_tree, root_only, to_device, tree_from_rows
from eagle2.verify import TokenLogprobs, Verified


class DrafterLike(Protocol):
    """What the engine needs from a drafter (in-process `Drafter` or a remote draft worker)."""

    def draft(self, seq_ids: list[str], features: torch.Tensor, tokens: torch.Tensor,
              counts: torch.Tensor, config: TreeConfig, min_gain: float = 0.0) -> DraftTree: ...

    def release(self, seq_id: str) -> None: ...


@dataclass(frozen=True)
class Request:
    seq_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    tree: TreeConfig
    eos_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Event:
    """What one step produced for one request."""

    seq_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" (EOS), "length"
    num_steps: int  # target forwards that produced this request's output so far
    accepted_at_depth: dict[int, int]  # steps that accepted exactly d draft tokens
    # token_ids' TokenLogprobs where the request asked (SamplingParams.logprobs), else None
    logprobs: list[TokenLogprobs] | None = None


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


@dataclass
class _Seq:
    req: Request
    generator: torch.Generator
    pending_feats: torch.Tensor  # [A, H] features of the positions committed last
    pending_tokens: torch.Tensor  # [A] the token after each of them (last = next root)
    # earlier pending pairs the drafter has not seen (plain steps of an auto request), joined
    # in front of the pending ones only when it drafts: a plain step then costs what it costs
    # in vanilla mode (copying the growing backlog every step cost 2 ms a step at batch 4)
    backlog: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    num_steps: int = 1  # target forwards that produced output (prefill counted)
    accepted_at_depth: Counter = field(default_factory=Counter)
    drafted: bool = False  # the drafter consumed the pending pairs this step
    probe: bool = True  # just joined: draft for it at its first step even if the gate skips
    # auto budget: decayed sums of the draft tokens its kept trees' calibrated values
    # promised and of those verification accepted (`Engine._acceptance_scale`)
    promised: float = 0.0
    got: float = 0.0
    kept_value: float = 0.0  # this step's promise (sum of the kept nodes' values)
    # the same for its lookup chains on steps without a draft call (`Engine._chain_scale`)
    chain_promised: float = 0.0
    chain_got: float = 0.0
    chain_value: float = 0.0  # this step's chain's promise (its kept nodes' values)
    # prompt lookup for steps without a draft call (`Engine._lookup_trees`): the request's
    # tokens so far (prompt and output) and their n-gram index, built on first need
    history: TokenHistory | None = None
    order: int = 0  # admission order (paged cache: the newest is preempted first)

    def tokens(self) -> list[int]:
        return list(self.req.prompt_ids) + self.output

    @property
    def auto(self) -> bool:
        return self.req.tree.mode != "vanilla" and self.req.tree.budget == "auto"

    def take_backlog(self) -> _Seq:
        """Join the backlog in front of the pending pairs (the drafter is about to see them)."""
        if self.backlog:
            feats, tokens = zip(*self.backlog, strict=True)
            self.pending_feats = torch.cat([*feats, self.pending_feats])
            self.pending_tokens = torch.cat([*tokens, self.pending_tokens])
            self.backlog.clear()
        return self


@dataclass
class _Chunked:
    """A long prompt (or a preempted request's tokens) prefilled one chunk per step while the
    running requests keep decoding (`Engine._prefill_chunk`), in the cache's top row."""

    req: Request
    resumed: _Seq | None
    tokens: list[int]
    start: int  # its cached prefix (prefix caching): entries [0, start) were there
    done: int  # entries written so far
    row: int
    generator: torch.Generator | None
    feats: list[torch.Tensor] = field(default_factory=list)  # [chunk, H] each
    piece: int = 0  # tokens this step reads of it (`Engine._next_chunk`)

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done


class Engine:
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
        self.seqs: list[_Seq] = []  # index = cache slot
        self.waiting: list[Request] = []
        # paged cache: block tables, admission and preemption by blocks, prefix caching
        self.paging = (Paging(runner, max_context + self.tree_margin, prefix_caching)
                       if getattr(runner, "paged", None) else None)
        self.preempted: list[_Seq] = []  # to resume (recomputed), oldest admitted first
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
        self.chunking: _Chunked | None = None
        # newcomers' prompts and the chunk ride in the running requests' verification forward
        # (one pass over the weights for all) where the runner can (`mixed_step`); False: a
        # prefill is a step of its own, a chunk a forward of its own
        self.mix_prompts = True
        self._admitted = 0  # requests admitted so far (`_Seq.order`)
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
        ch = self.chunking
        if ch is not None and ch.req.seq_id == seq_id:
            self.chunking = None
            self._clear_row(ch.row)
            if self.paging is not None:
                self.paging.free(seq_id, ch.row, ch.row)
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
                return chunked + (self._prefill_chunk() if self.chunking is not None else [])
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

    def _acceptance_scale(self, s: _Seq) -> float:
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

    def _proposals(self, seqs: list[_Seq]) -> list[list[LookupNode]]:
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

    def _chain_scale(self, s: _Seq) -> float:
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

    def _chain_values(self, s: _Seq, values: list[float]) -> list[float]:
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
            feats, toks, counts = _pad([self.seqs[i].take_backlog() for i in idx])
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
        node_idx = torch.tensor([n + [0] * (width - len(n)) for n in verified.nodes], device=dev)
        kept = torch.tensor([len(n) for n in verified.nodes], device=dev)
        slots = torch.arange(len(self.seqs), device=dev)
        self.runner.commit(slots, node_idx, kept)
        events = []
        for b, s in enumerate(self.seqs):
            n = len(verified.nodes[b])
            new_feats = features[b, :n]
            new_tokens = torch.tensor(verified.tokens[b], device=dev)
            if s.auto and not s.drafted:  # the drafter has not seen the pending pairs yet
                s.backlog.append((s.pending_feats, s.pending_tokens.to(dev)))
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

    def _emit(self, s: _Seq, new_tokens: list[int],
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

    # ----- paged cache: admission and preemption by blocks ---------------------------------------
    def _candidates(self) -> list[_Seq | Request]:
        """Who starts next, in order: preempted requests (oldest admitted first), then the
        waiting ones."""
        return [*self.preempted, *self.waiting]

    @staticmethod
    def _uses_prefix_cache(r: Request) -> bool:
        """Whether a request may take cached prefix blocks: greedy or vanilla ones, whose
        output cannot depend on it. (A seeded sampled request's trees, so its sample, depend
        on the head's input, which a prefix hit shortens: it always computes its prompt.)"""
        return r.params.greedy or r.tree.mode == "vanilla"

    def _admissible(self) -> bool:
        """Whether the first candidate can start now (`_fits`)."""
        return self.paging is None or self._fits(self._candidates()[0], len(self.seqs))

    def _fits(self, c: _Seq | Request, rows: int) -> bool:
        """Whether a candidate's blocks are free beside `rows` running requests, keeping one
        block per running request free for its growth (a request admitted only to be
        preempted at the next step would be recomputed again and again)."""
        req = c.req if isinstance(c, _Seq) else c
        return self.paging.can_admit(self._prefill_tokens(c), self._uses_prefix_cache(req),
                                     spare=rows)

    @staticmethod
    def _prefill_tokens(c: _Seq | Request) -> list[int]:
        """What a candidate's prefill computes: a prompt, or a resumed request's committed
        entries (all its tokens but the newest)."""
        return c.tokens()[:-1] if isinstance(c, _Seq) else list(c.prompt_ids)

    def _reserve(self, tree: DraftTree) -> DraftTree:
        """Blocks for this step's trees (N entries past each committed prefix); where they run
        out, the newest request is preempted (`_preempt`) until they fit. -> the trees of the
        requests still running, in their rows' order."""
        before = list(self.seqs)
        num_n = tree.tokens.shape[1]
        lengths = self.runner.lengths[: len(before)].tolist()
        for s, length in sorted(zip(before, lengths, strict=True), key=lambda p: p[0].order):
            while self._row(s) is not None and not self.paging.ensure(
                    s.req.seq_id, self._row(s), length + num_n):
                self._preempt(max(self.seqs, key=lambda x: x.order))
        if len(self.seqs) == len(before):
            return tree
        rows = [next(i for i, b in enumerate(before) if b is s) for s in self.seqs]
        self._ngram_rows = [rows.index(b) for b in self._ngram_rows if b in rows]
        return tree.select(torch.tensor(rows, device=HOST))

    def _row(self, s: _Seq) -> int | None:
        return next((i for i, x in enumerate(self.seqs) if x is s), None)

    def _preempt(self, s: _Seq) -> None:
        """Free a running request's blocks (and its draft state); it resumes later from its
        prompt and output, recomputed (`_prefill`), with the output it would have had."""
        self._remove(self._row(s))
        s.backlog.clear()
        self.preempted.append(s)
        self.preempted.sort(key=lambda x: x.order)
        self.stats.preemptions += 1

    def _admit(self) -> list[tuple[Request, _Seq | None, list[int], int]]:
        """The candidates that start now (rows free, and blocks where paged), taken off their
        queues: (request, the preempted _Seq or None, tokens to prefill, how many of them
        are cached)."""
        out, widest, total, varlen = [], 0, 0, self._varlen()
        for c in self._candidates():
            rows = len(self.seqs) + len(out)
            tokens = self._prefill_tokens(c)
            widest, total = max(widest, len(tokens)), total + len(tokens)
            cost = total if varlen else widest * (len(out) + 1)  # tokens through the layers
            if rows >= self._rows() or (out and cost > self.prefill_budget) \
                    or (out and self._long(c)):  # a long one is chunked on its own
                break
            if self.paging is not None and not self._fits(c, rows):
                break
            out.append(self._take(c, rows))
        return out

    def _take(self, c: _Seq | Request, row: int
              ) -> tuple[Request, _Seq | None, list[int], int]:
        """A candidate off its queue, its blocks taken for `row` where paged (its prompt's
        cached prefix first). -> (request, the preempted _Seq or None, tokens to prefill, how
        many of them are cached)."""
        resumed = c if isinstance(c, _Seq) else None
        req = c.req if resumed is not None else c
        tokens, cached = self._prefill_tokens(c), 0
        if self.paging is not None:
            cached = self.paging.admit(req.seq_id, row, tokens, self._uses_prefix_cache(req))
            self.stats.prefix_query_tokens += len(tokens)
            self.stats.prefix_hit_tokens += cached
        self.preempted = [s for s in self.preempted if s is not c]
        self.waiting = [r for r in self.waiting if r is not c]
        return req, resumed, tokens, cached

    def _admit_within(self) -> tuple[_Chunked | None, list, _Chunked | None]:
        """What a mixed step reads beside the trees, within its prompt-token budget
        (`prefill_chunk`), first come first served, as the serving engines' schedulers do:
        the chunked prompt's next piece (`old`), then candidates whole (their tokens past
        the cached prefix) while they fit what is left, then where the one in progress
        finishes (at most one prompt stays chunked) the next candidate's first piece (`new`,
        in the row under the top one while `old` holds it; moved up after the step:
        `_chunk_on`). Rows: newcomers after the running ones, as `_admit`; a new chunk
        needs one more (the old one joins the running ones in the row after the newcomers,
        which must not be the new one's). -> (old, newcomers as `_admit` gives them, new)."""
        old, budget = self.chunking, self.prefill_chunk
        if old is not None:
            old.piece = min(budget, old.left)
            budget -= old.piece
        shared = self.newcomers_in_budget
        whole = budget if shared else self.prefill_budget  # tokens newcomers may take
        held = int(old is not None)  # the top row, until `old` joins the running ones
        may_chunk = old is None or (shared and old.piece == old.left)
        out, new = [], None
        for c in self._candidates():
            rows = len(self.seqs) + len(out)
            if rows + 1 + held > self.max_batch or (shared and budget <= 0) \
                    or (self.paging is not None and not self._fits(c, rows)):
                break
            req = c.req if isinstance(c, _Seq) else c
            tokens = self._prefill_tokens(c)
            need = len(tokens) - (self.paging.cached_prefix(tokens, self._uses_prefix_cache(req))
                                  if self.paging is not None else 0)
            if need <= (whole if shared else min(whole, self.prefill_chunk)):
                out.append(self._take(c, rows))
                whole -= need
                budget -= need if shared else 0
                continue
            if may_chunk and 0 < budget < need and rows + 1 + 2 * held <= self.max_batch:
                new = self._chunk(c, self.max_batch - 1 - held)
                new.piece = min(budget, new.left)
            break
        return old, out, new

    # ----- chunked prefill beside decoding ---------------------------------------------------
    def _rows(self) -> int:
        """Rows running requests may take (the top one is a chunked prefill's)."""
        return self.max_batch - (self.chunking is not None)

    def _long(self, c: _Seq | Request) -> bool:
        """Whether a candidate's prefill is chunked: requests are running and its tokens are
        more than a chunk."""
        return (bool(self.seqs) and self.max_batch > 1
                and len(self._prefill_tokens(c)) > self.prefill_chunk)

    def _admission(self) -> str:
        """How the first candidate starts: "prefill" (with the others that fit, this step),
        "chunk" (a chunk per step from now on) or "wait" (it is long and another prompt is
        being chunked: one at a time)."""
        if not self._long(self._candidates()[0]):
            return "prefill"
        return "chunk" if self.chunking is None else "wait"

    def _start_chunking(self) -> None:
        """The first candidate chunked in the top row; its chunks run from the next call of
        `_prefill_chunk` on."""
        self.chunking = self._chunk(self._candidates()[0], self.max_batch - 1)

    def _chunk(self, c: _Seq | Request, row: int) -> _Chunked:
        """A candidate off its queue to be prefilled in chunks in `row` (blocks for all its
        tokens where paged)."""
        req, resumed, tokens, cached = self._take(c, row)
        dev = self.runner.device
        self.runner.set_lengths(torch.tensor([row], device=dev),
                                torch.tensor([cached], device=dev))
        gen = _generator(req.params) if resumed is None else None
        return _Chunked(req, resumed, tokens, cached, cached, row, gen)

    def _chunk_on(self, ch: _Chunked) -> None:
        """A prompt whose first piece a mixed step read stays chunked, in the top row."""
        self.chunking, top = ch, self.max_batch - 1
        if ch.row != top:  # (the old chunk held the top row in that step)
            self.runner.copy_slot(ch.row, top)
            self._clear_row(ch.row)
            ch.row = top

    def _prefill_chunk(self) -> list[Event]:
        """The next chunk of the chunked prefill in a forward of its own (`_next_chunk`,
        `_chunk_done`)."""
        t0 = time.perf_counter()
        ch = self.chunking
        ch.piece = min(self.prefill_chunk, ch.left)
        events = self._chunk_done(ch, *self._read(self._next_chunk(ch)))
        self._drop_finished(events)
        self.stats.prefill_s += time.perf_counter() - t0
        return events

    def _read(self, prompts: PromptBatch):
        """A prompt batch's forward of its own (`TargetRunner.prefill_step`)."""
        return self.runner.prefill_step(prompts.tokens, prompts.positions, prompts.mask,
                                        prompts.slots, prompts.last_idx, prompts.params,
                                        prompts.generators)

    def _mixing(self) -> bool:
        """Whether prompts (newcomers, a chunk) ride in the running requests' verification
        forward (`mix_prompts` and a runner with `mixed_step`) rather than in a forward of
        their own."""
        return self.mix_prompts and getattr(self.runner, "mixed_step", None) is not None

    def _can_admit(self) -> bool:
        """Whether a candidate waits, a row is free for it and it fits (`_admissible`)."""
        return bool(self.waiting or self.preempted) and len(self.seqs) < self._rows() \
            and self._admissible()

    def _next_chunk(self, ch: _Chunked) -> PromptBatch:
        """A chunked prompt's next piece (`_Chunked.piece` tokens): a causal [1, C, C] mask
        after the entries written so far, in its row."""
        dev, num = self.runner.device, ch.piece
        final = ch.done + num == len(ch.tokens) and ch.resumed is None  # a new request's
        # last chunk samples its first token; the others' take greedy parameters
        return PromptBatch(
            torch.tensor([ch.tokens[ch.done:ch.done + num]], device=dev),
            ch.done + torch.arange(num, device=dev)[None],
            causal_mask(torch.tensor([num], device=dev), num), torch.tensor([ch.row], device=dev),
            torch.tensor([num - 1], device=dev), [ch.req.params if final else SamplingParams()],
            [ch.generator if final else None])

    def _chunk_done(self, ch: _Chunked, features: torch.Tensor, first: list[int],
                    first_lp: list[TokenLogprobs | None] | None) -> list[Event]:
        """A chunk's entries are written (its `prefill_step` result): the length advances;
        with the last chunk its request joins the running ones (the row after theirs) and
        gets its first token (the caller drops it if that ends it)."""
        dev, num = self.runner.device, ch.piece
        last = num == ch.left
        slots = torch.tensor([ch.row], device=dev)
        ch.feats.append(to_device(features, dev)[0, :num])
        ch.done += num
        self.runner.set_lengths(slots, torch.tensor([ch.done], device=dev))
        self.stats.prefill_tokens += num
        if self.paging is not None:
            self.paging.commit(ch.req.seq_id, ch.done, lambda: ch.tokens)
        events = []
        if last:
            if self.chunking is ch:
                self.chunking = None
            row = len(self.seqs)
            if ch.row != row:  # paged: the block table moves; slotted: the entries
                self.runner.copy_slot(ch.row, row)
                self._clear_row(ch.row)
            event = self._start(ch.req, ch.resumed, ch.tokens, ch.start, torch.cat(ch.feats),
                                first[0], ch.generator, first_lp[0] if first_lp else None)
            events = [event] if event is not None else []
            self._rate, self._depths_used, self._sizes_used = 0.0, [], []
        return events

    def _clear_row(self, row: int) -> None:
        """A row no request holds: length 0, and no blocks where paged."""
        dev = self.runner.device
        self.runner.set_lengths(torch.tensor([row], device=dev), torch.tensor([0], device=dev))
        if self.paging is not None:
            self.runner.set_blocks(row, [])

    def _start(self, r: Request, resumed: _Seq | None, toks: list[int], cached: int,
               feats: torch.Tensor, tok: int, gen: torch.Generator | None,
               logprobs: TokenLogprobs | None = None) -> Event | None:
        """A prefilled request joins the running ones (the next row): its pending pairs are
        (feature of position t, token t + 1) over the computed positions feats [n, H], the
        last one's token the next root (the first new token, or a resumed request's newest
        token). -> a new request's first-token event; None for a resumed one."""
        root = resumed.output[-1] if resumed is not None else tok
        following = torch.tensor(toks[cached + 1:] + [root], device=self.runner.device)
        self._admitted += 1
        if resumed is not None:
            resumed.pending_feats, resumed.pending_tokens = feats, following
            resumed.probe = True
            self.seqs.append(resumed)
            return None
        s = _Seq(r, gen, feats, following, order=self._admitted)
        self.seqs.append(s)
        return self._emit(s, [tok], [logprobs] if logprobs is not None else None)

    # ----- prefill ----------------------------------------------------------------------------
    def _prefill(self) -> list[Event]:
        """Admitted requests' tokens past their cached prefixes in a step of its own
        (`_prefill_inputs`); new requests get their first token, resumed ones continue."""
        t0 = time.perf_counter()
        idle = not self.seqs
        batch = self._admit()
        prompts = self._prefill_inputs(batch)
        reads = (self.runner.prefill_parts(prompts) if self._varlen()
                 else [self._read(p) for p in prompts])
        events = self._prefill_done(batch, prompts, reads)
        self._drop_finished(events)
        # the gates go with the batch they learnt at when the engine was idle and a newcomer
        # samples, so a seeded request that runs alone samples the same whatever ran before it
        # (its trees, so its sample, depend on them). Greedy newcomers keep them: a gate that
        # learnt speculation does not pay at a batch size would otherwise probe every new
        # batch of requests (at batch 2 on an AVX2 CPU ~1-2% of their decoding)
        if idle and not all(r.params.greedy for r, _, _, _ in batch):
            self.gates.clear()
            self._last_gate = None
        self.stats.prefill_s += time.perf_counter() - t0
        return events

    def _varlen(self) -> bool:
        """Whether admitted prompts are read one group each in one forward (`_mixing` and a
        runner with `prefill_parts`: no padding through the layers), else right-padded into
        one batch."""
        return self._mixing() and getattr(self.runner, "prefill_parts", None) is not None

    def _prefill_inputs(self, batch: list[tuple[Request, _Seq | None, list[int], int]]
                        ) -> list[PromptBatch]:
        """The admitted requests' (`_admit`) tokens past their cached prefixes, causal, in the
        rows after the running ones (their lengths set to the cached prefixes): one
        `PromptBatch` each (`_varlen`), else right-padded into one."""
        dev = self.runner.device
        first = len(self.seqs)
        cached = torch.tensor([c for _, _, _, c in batch], device=dev)
        slots = torch.arange(first, first + len(batch), device=dev)
        self.runner.set_lengths(slots, cached)
        # a resumed request's next token is known: greedy params take no sample from its
        # generator (its output continues as it would have)
        params = [SamplingParams() if s is not None else r.params for r, s, _, _ in batch]
        gens = [None if s is not None else _generator(r.params) for r, s, _, _ in batch]
        groups = [list(range(len(batch)))]
        if self._varlen():
            groups = [[b] for b in range(len(batch))]
        out = []
        for rows in groups:
            lengths = torch.tensor([len(batch[b][2]) - batch[b][3] for b in rows], device=dev)
            width = int(lengths.max())
            tokens = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
            for i, b in enumerate(rows):
                _, _, toks, c = batch[b]
                tokens[i, : len(toks) - c] = torch.tensor(toks[c:], device=dev)
            out.append(PromptBatch(
                tokens, cached[rows, None] + torch.arange(width, device=dev),
                causal_mask(lengths, width), slots[rows], lengths - 1,
                [params[b] for b in rows], [gens[b] for b in rows]))
        return out

    def _prefill_done(self, batch: list[tuple[Request, _Seq | None, list[int], int]],
                      prompts: list[PromptBatch], reads: list) -> list[Event]:
        """The admitted requests' prompts are written (`reads`: each prompt batch's
        `prefill_step` result, the batches holding the requests in order): they join the
        running ones (the caller drops those it ends); new ones get their first token."""
        dev, rows = self.runner.device, []
        for p, (features, first, first_lp) in zip(prompts, reads, strict=True):
            lengths = p.last_idx + 1
            self.runner.set_lengths(p.slots, p.positions[:, 0] + lengths)
            self.stats.prefill_tokens += int(lengths.sum())
            features = to_device(features, dev)
            rows += [(features[i], first[i], p.generators[i], first_lp[i] if first_lp else None)
                     for i in range(len(first))]
        if self.paging is not None:  # the prompts' full blocks are shareable from now on
            for r, _, toks, _ in batch:
                self.paging.commit(r.seq_id, len(toks), lambda toks=toks: toks)
        events = []
        for (r, resumed, toks, c), (feats, tok, gen, lp) in zip(batch, rows, strict=True):
            event = self._start(r, resumed, toks, c, feats[:len(toks) - c], tok, gen, lp)
            if event is not None:
                events.append(event)
        # what earlier steps learnt goes with the batch they ran: the rate, depths and sizes
        self._rate, self._depths_used, self._sizes_used = 0.0, [], []
        return events


def fold_seed(seed: int) -> int:
    """A 64-bit seed folded into the 32 bits that torch's CPU generator (mt19937) keeps, so
    that seeds differing only in their high bits give different samples. Seeds in
    [0, 2**32) are kept as they are. E.g. 1 -> 1, 1 + 2**32 -> 1 ^ 0x9E3779B1."""
    seed &= (1 << 64) - 1  # negative int64 seeds: their two's complement
    low, high = seed & 0xFFFFFFFF, seed >> 32
    return low ^ ((high * 0x9E3779B1) & 0xFFFFFFFF)  # odd multiplier: a bijection of high


def _generator(params: SamplingParams) -> torch.Generator:
    """The request's own CPU generator: seeded by the request (all 64 bits), else at random."""
    gen = torch.Generator()
    gen.manual_seed(fold_seed(params.seed) if params.seed is not None else
                    int(torch.randint(0, 2**32, ())))
    return gen


def _pad(seqs: list[_Seq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pending (feature, token) pairs of several sequences, right-padded: [B, A, H], [B, A], [B]
    (the features on the target's device, tokens and counts on HOST: the drafter moves what
    it runs on to its own device, a remote one sends them)."""
    counts = torch.tensor([len(s.pending_tokens) for s in seqs], device=HOST)
    width = int(counts.max())
    hidden = seqs[0].pending_feats.shape[-1]
    feats = seqs[0].pending_feats.new_zeros(len(seqs), width, hidden)
    toks = torch.zeros(len(seqs), width, dtype=torch.long, device=HOST)
    for b, s in enumerate(seqs):
        feats[b, : len(s.pending_tokens)] = s.pending_feats
        toks[b, : len(s.pending_tokens)] = to_device(s.pending_tokens, HOST)
    return feats, toks, counts
