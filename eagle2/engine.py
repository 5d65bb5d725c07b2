"""The batched speculative decoding loop (BRIEF §4-§5): prefill, draft, verify, commit.

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
from dataclasses import dataclass, field
from typing import Protocol

import torch

from eagle2.attention import causal_mask
from eagle2.config import SamplingParams, TreeConfig
from eagle2.runner import TargetRunner
from eagle2.tree import DraftTree, root_only
from eagle2.verify import Verified, children_lists, verify_greedy, verify_sampling


class DrafterLike(Protocol):
    """What the engine needs from a drafter (in-process `Drafter` or a remote draft worker)."""

    def draft(self, seq_ids: list[str], features: torch.Tensor, tokens: torch.Tensor,
              counts: torch.Tensor, config: TreeConfig) -> DraftTree: ...

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


@dataclass
class EngineStats:
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    other_s: float = 0.0
    steps: int = 0
    batch_sizes: list[int] = field(default_factory=list)


@dataclass
class _Seq:
    req: Request
    generator: torch.Generator
    pending_feats: torch.Tensor  # [A, H] features of the positions committed last
    pending_tokens: torch.Tensor  # [A] the token after each of them (last = next root)
    output: list[int] = field(default_factory=list)
    num_steps: int = 1  # target forwards that produced output (prefill counted)
    accepted_at_depth: Counter = field(default_factory=Counter)


class Engine:
    """Runs many requests through one target (and one drafter) in lockstep batches."""

    tree_margin = 130  # cache entries past max_context for the tree being verified

    def __init__(self, runner: TargetRunner, drafter: DrafterLike | None, max_batch: int = 8,
                 max_context: int = 2048, tree_margin: int | None = None):
        """runner: a target with max_batch cache slots of max_context + tree_margin entries."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.runner, self.drafter = runner, drafter
        self.max_batch, self.max_context = max_batch, max_context
        self.tree_margin = tree_margin or Engine.tree_margin
        self.seqs: list[_Seq] = []  # index = cache slot
        self.waiting: list[Request] = []
        self.stats = EngineStats()

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
        return {s.req.seq_id for s in self.seqs} | {r.seq_id for r in self.waiting}

    def has_work(self) -> bool:
        return bool(self.seqs or self.waiting)

    def cancel(self, seq_id: str) -> None:
        self.waiting = [r for r in self.waiting if r.seq_id != seq_id]
        for i, s in enumerate(self.seqs):
            if s.req.seq_id == seq_id:
                self._remove(i)
                return

    # ----- the step ---------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Admit waiting requests (prefill) or run one draft-verify-commit step for all."""
        if self.waiting and len(self.seqs) < self.max_batch:
            return self._prefill()
        if not self.seqs:
            return []
        t0 = time.perf_counter()
        tree = self._draft()
        t1 = time.perf_counter()
        verified, features = self._verify(tree)
        t2 = time.perf_counter()
        events = self._advance(verified, features)
        t3 = time.perf_counter()
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += t2 - t1
        self.stats.other_s += t3 - t2
        self.stats.steps += 1
        return events

    def _draft(self) -> DraftTree:
        groups: dict[TreeConfig, list[int]] = {}
        for i, s in enumerate(self.seqs):
            groups.setdefault(s.req.tree, []).append(i)
        parts: list[tuple[list[int], DraftTree]] = []
        for config, idx in groups.items():
            feats, toks, counts = _pad([self.seqs[i] for i in idx])
            if config.mode == "vanilla":
                rows = torch.arange(len(idx))
                parts.append((idx, root_only(toks[rows, counts - 1])))
            else:
                ids = [self.seqs[i].req.seq_id for i in idx]
                parts.append((idx, self.drafter.draft(ids, feats, toks, counts, config)))
        if len(parts) == 1:
            return parts[0][1]
        order = [i for idx, _ in parts for i in idx]
        tree = DraftTree.concat([t for _, t in parts])
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return tree.select(inverse)

    def _verify(self, tree: DraftTree) -> tuple[Verified, torch.Tensor]:
        dev = self.runner.device
        num_b = tree.batch_size
        slots = torch.arange(num_b, device=dev)
        positions = self.runner.lengths[:num_b, None] + tree.depths.to(dev)
        features, logits = self.runner.forward(tree.tokens.to(dev), positions,
                                               tree.tree_mask.to(dev), slots)  # [B, N, V]
        self.stats.batch_sizes.append(num_b)
        greedy = verify_greedy(tree, logits) if any(
            s.req.params.greedy for s in self.seqs) else None
        nodes, tokens = [], []
        parents = tree.parents.tolist()
        tree_tokens = tree.tokens.tolist()
        for b, s in enumerate(self.seqs):
            if s.req.params.greedy:
                nodes.append(greedy.nodes[b])
                tokens.append(greedy.tokens[b])
            else:
                n = int(tree.num_nodes[b])
                kids = children_lists(parents[b], n)
                kept, toks = verify_sampling(tree_tokens[b], kids, logits[b], s.req.params,
                                             s.generator)
                nodes.append(kept)
                tokens.append(toks)
        return Verified(nodes, tokens), features

    def _advance(self, verified: Verified, features: torch.Tensor) -> list[Event]:
        """Commit the accepted paths; their features [B, N, H] feed the next draft."""
        dev = self.runner.device
        width = max(len(n) for n in verified.nodes)
        node_idx = torch.tensor([n + [0] * (width - len(n)) for n in verified.nodes], device=dev)
        kept = torch.tensor([len(n) for n in verified.nodes], device=dev)
        slots = torch.arange(len(self.seqs), device=dev)
        self.runner.commit(slots, node_idx, kept)
        events = []
        for b, s in enumerate(self.seqs):
            n = len(verified.nodes[b])
            s.pending_feats = features[b, node_idx[b, :n]]
            s.pending_tokens = torch.tensor(verified.tokens[b], device=dev)
            s.num_steps += 1
            s.accepted_at_depth[n - 1] += 1
            events.append(self._emit(s, verified.tokens[b]))
        self._drop_finished(events)
        return events

    def _emit(self, s: _Seq, new_tokens: list[int]) -> Event:
        """Append tokens up to EOS / max_tokens / context end and say whether s is done."""
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
                     dict(s.accepted_at_depth))

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
        self.runner.set_lengths(torch.tensor([last]), torch.tensor([0]))
        if self.drafter is not None and s.req.tree.mode != "vanilla":
            self.drafter.release(s.req.seq_id)

    # ----- prefill ----------------------------------------------------------------------------
    def _prefill(self) -> list[Event]:
        t0 = time.perf_counter()
        room = self.max_batch - len(self.seqs)
        batch, self.waiting = self.waiting[:room], self.waiting[room:]
        dev = self.runner.device
        lengths = torch.tensor([len(r.prompt_ids) for r in batch], device=dev)
        width = int(lengths.max())
        tokens = torch.zeros(len(batch), width, dtype=torch.long, device=dev)
        for b, r in enumerate(batch):
            tokens[b, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids, device=dev)
        first = len(self.seqs)
        slots = torch.arange(first, first + len(batch), device=dev)
        self.runner.set_lengths(slots, torch.zeros_like(slots))
        positions = torch.arange(width, device=dev).expand(len(batch), width)
        features, last_logits = self.runner.forward(tokens, positions, causal_mask(lengths, width),
                                                    slots, logit_index=lengths - 1)  # [B, V]
        self.runner.set_lengths(slots, lengths)
        events = []
        for b, r in enumerate(batch):
            gen = torch.Generator()
            gen.manual_seed(fold_seed(r.params.seed) if r.params.seed is not None else
                            int(torch.randint(0, 2**32, ())))
            tok = _first_token(last_logits[b], r.params, gen)
            n = len(r.prompt_ids)
            s = _Seq(r, gen, features[b, :n],
                     torch.tensor(list(r.prompt_ids[1:]) + [tok], device=dev))
            self.seqs.append(s)
            events.append(self._emit(s, [tok]))
        self._drop_finished(events)
        self.stats.prefill_s += time.perf_counter() - t0
        return events


def fold_seed(seed: int) -> int:
    """A 64-bit seed folded into the 32 bits that torch's CPU generator (mt19937) keeps, so
    that seeds differing only in their high bits give different samples. Seeds in
    [0, 2**32) are kept as they are. E.g. 1 -> 1, 1 + 2**32 -> 1 ^ 0x9E3779B1."""
    seed &= (1 << 64) - 1  # negative int64 seeds: their two's complement
    low, high = seed & 0xFFFFFFFF, seed >> 32
    return low ^ ((high * 0x9E3779B1) & 0xFFFFFFFF)  # odd multiplier: a bijection of high


def _first_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    if params.greedy:
        return int(logits.argmax())
    _, toks = verify_sampling([0], [[]], logits[None], params, gen)
    return toks[0]


def _pad(seqs: list[_Seq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pending (feature, token) pairs of several sequences, right-padded: [B, A, H], [B, A], [B]."""
    counts = torch.tensor([len(s.pending_tokens) for s in seqs])
    width = int(counts.max())
    hidden = seqs[0].pending_feats.shape[-1]
    feats = seqs[0].pending_feats.new_zeros(len(seqs), width, hidden)
    toks = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, s in enumerate(seqs):
        feats[b, : len(s.pending_tokens)] = s.pending_feats
        toks[b, : len(s.pending_tokens)] = s.pending_tokens.cpu()
    return feats, toks, counts
