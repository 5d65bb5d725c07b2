"""What the engine keeps per request: the request as it arrives (`Request`), what it sends back
each step (`Event`), a running request's decoding state (`SeqState`: the pending (feature,
token) pairs its drafter has not seen, its output, its acceptance history) and its own seeded
generator (`request_generator`).

See docs/kv-cache.md and docs/draft-tree.md.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from eagle2.config import SamplingParams, TreeConfig
from eagle2.lookup import TokenHistory
from eagle2.tree import HOST
from eagle2.verify import TokenLogprobs


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
class SeqState:
    req: Request
    generator: torch.Generator
    pending_feats: torch.Tensor  # [A, H] features of the positions committed last
    # [A] the token after each of them (last = next root), on HOST: read there every step (the
    # next root, `pad_pending`), where on a GPU each read had been a copy back
    pending_tokens: torch.Tensor
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

    def take_backlog(self) -> SeqState:
        """Join the backlog in front of the pending pairs (the drafter is about to see them)."""
        if self.backlog:
            feats, tokens = zip(*self.backlog, strict=True)
            self.pending_feats = torch.cat([*feats, self.pending_feats])
            self.pending_tokens = torch.cat([*tokens, self.pending_tokens])
            self.backlog.clear()
        return self


def fold_seed(seed: int) -> int:
    """A 64-bit seed folded into the 32 bits that torch's CPU generator (mt19937) keeps, so
    that seeds differing only in their high bits give different samples. Seeds in
    [0, 2**32) are kept as they are. E.g. 1 -> 1, 1 + 2**32 -> 1 ^ 0x9E3779B1."""
    seed &= (1 << 64) - 1  # negative int64 seeds: their two's complement
    low, high = seed & 0xFFFFFFFF, seed >> 32
    return low ^ ((high * 0x9E3779B1) & 0xFFFFFFFF)  # odd multiplier: a bijection of high


def request_generator(params: SamplingParams) -> torch.Generator:
    """The request's own CPU generator: seeded by the request (all 64 bits), else at random."""
    gen = torch.Generator()
    gen.manual_seed(fold_seed(params.seed) if params.seed is not None else
                    int(torch.randint(0, 2**32, ())))
    return gen


def pad_pending(seqs: list[SeqState]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        toks[b, : len(s.pending_tokens)] = s.pending_tokens
    return feats, toks, counts
