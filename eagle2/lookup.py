"""Prompt-lookup branches of the draft tree (docs/draft-tree.md "Prompt lookup").

Text often repeats itself: code reuses names, answers quote the question. `TokenHistory`
keeps one sequence's tokens (prompt and output so far) with an index of its n-grams, and
proposes a chain under the root with no model cost: the longest suffix (max_ngram tokens
down to 1) that occurred earlier, its most recent earlier occurrence, and the tokens that
followed it there. Where the copy runs into the end of the history it repeats itself
(period = distance between the two occurrences), as a copied loop would.

E.g. history [5, 6, 7, 9, 5, 6], max_ngram 4: suffix [5, 6] occurred at 0..1, followed by
[7, 9, 5, 6]; depth 3 proposes [7, 9, 5] with match length 2.

`LookupTable` gives a proposed node its value: the measured probability that verification
accepts it, by match length and depth (fitted by `eagle2 calibrate`, stored in the head's
calibration.json; a conservative default otherwise). `propose_chain` weighs that chain against
the one the target's own answers to other prompts suggest (`eagle2.ngram.NgramStore`, where
the head ships one) and keeps the one expected to be accepted further.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, NamedTuple

import torch

from eagle2.tree import host_lists, rows_tensor

if TYPE_CHECKING:
    from eagle2.ngram import NgramStore

MAX_NGRAM = 4


class TokenHistory:
    """One sequence's tokens and, per n-gram (n <= max_ngram), where its most recent
    occurrence was followed: index[ngram] = position of the next token."""

    def __init__(self, max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        toks, index = self.tokens, self.index
        for tok in tokens:
            end = len(toks)  # the n-grams ending just before `end` are now followed by tok
            for n in range(1, min(self.max_ngram, end) + 1):
                index[tuple(toks[end - n:end])] = end
            toks.append(tok)

    def truncate(self, length: int) -> None:
        """Forget the tokens from `length` on (the index is rebuilt: rewinds are rare)."""
        if length < len(self.tokens):
            kept = self.tokens[:length]
            self.tokens, self.index = [], {}
            self.extend(kept)

    def propose(self, depth: int) -> tuple[list[int], int]:
        """The `depth` tokens that follow the longest earlier match of the history's suffix,
        and the match length ([] and 0 when nothing matches)."""
        toks = self.tokens
        num_t = len(toks)
        for n in range(min(self.max_ngram, num_t), 0, -1):
            start = self.index.get(tuple(toks[num_t - n:]))
            if start is not None:
                out: list[int] = []
                for i in range(depth):  # past the end the copy repeats what it proposed
                    src = start + i
                    out.append(toks[src] if src < num_t else out[src - num_t])
                return out, n
        return [], 0


# Default acceptance per match length (rows 1..4) and depth (columns 1..), for heads without a
# fitted table: conservative, about half the rates of all proposals on greedy SmolLM2 answers.
DEFAULT_RATES: tuple[tuple[float, ...], ...] = (
    (0.10, 0.05, 0.03),
    (0.20, 0.12, 0.08, 0.06),
    (0.30, 0.20, 0.15, 0.10),
    (0.40, 0.35, 0.30, 0.25, 0.20, 0.18, 0.16, 0.14),
)


@dataclass(frozen=True)
class LookupTable:
    """rates[m - 1][d - 1]: probability that a lookup node at depth d, proposed after a match
    of length m, is accepted. Non-increasing in d; depths past a row's end repeat its last rate
    times `decay` per extra level; match lengths past the last row use the last row."""

    rates: tuple[tuple[float, ...], ...] = DEFAULT_RATES
    decay: float = 0.85
    num_samples: int = 0

    def __post_init__(self) -> None:
        if not self.rates or any(not row for row in self.rates):
            raise ValueError("a lookup table needs at least one rate per match length")
        for row in self.rates:
            if any(not 0 <= r <= 1 for r in row):
                raise ValueError(f"lookup rates must lie in [0, 1], got {row}")
            if any(b > a for a, b in pairwise(row)):
                raise ValueError(f"lookup rates must not increase with depth, got {row}")

    def value(self, match_len: int, depth: int) -> float:
        row = self.rates[min(max(match_len, 1), len(self.rates)) - 1]
        if depth <= len(row):
            return row[depth - 1]
        return row[-1] * self.decay ** (depth - len(row))

    VALUES_KEPT = 64  # depths per match length `values` keeps computed

    @functools.cached_property
    def _value_rows(self) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(self.value(m, d) for d in range(1, self.VALUES_KEPT + 1))
                     for m in range(1, len(self.rates) + 1))

    def values(self, match_len: int, num: int) -> list[float]:
        """[value(match_len, d) for d in 1..num] (read from rows computed once)."""
        if num > self.VALUES_KEPT:
            return [self.value(match_len, d) for d in range(1, num + 1)]
        return list(self._value_rows[min(max(match_len, 1), len(self.rates)) - 1][:num])

    def to_json(self) -> dict:
        return {"rates": [list(r) for r in self.rates], "decay": self.decay,
                "num_samples": self.num_samples}

    @classmethod
    def from_json(cls, data: dict) -> LookupTable:
        return cls(tuple(tuple(r) for r in data["rates"]), data.get("decay", 0.85),
                   data.get("num_samples", 0))

    @classmethod
    def fit(cls, counts: list[list[int]], accepted: list[list[int]], min_count: int = 20,
            default: LookupTable | None = None) -> LookupTable:
        """counts[m - 1][d - 1] proposed nodes and accepted[m - 1][d - 1] of them -> rates.

        A cell with fewer than min_count samples takes the default's rate; each row is then
        made non-increasing in depth (running minimum) and cut after its last measured cell."""
        default = default or cls()
        rows = []
        for m, (cs, accs) in enumerate(zip(counts, accepted, strict=True), start=1):
            measured = [d for d, c in enumerate(cs) if c >= min_count]
            row: list[float] = []
            for d in range(max(measured, default=-1) + 1):
                rate = accs[d] / cs[d] if cs[d] >= min_count else default.value(m, d + 1)
                row.append(min(rate, row[-1]) if row else rate)
            rows.append(tuple(row) if row else tuple(default.rates[min(m, len(default.rates)) - 1]))
        return cls(tuple(rows), default.decay, sum(map(sum, counts)))


def propose_chain(history: TokenHistory, depth: int, table: LookupTable,
                  store: NgramStore | None = None) -> tuple[list[int], list[float], int]:
    """The chain to verify after a sequence's last token: prompt lookup's (valued by `table`)
    or, where the head ships an n-gram store, the store's when its values sum higher (the
    tokens it expects accepted: values fall along a chain, so that is the expected accepted
    length). -> (tokens, values, match length; 0 for the store's chain or none).
    E.g. a match of one token (rate ~0.2) loses to a 4-token context the target's answers
    continued with one token 9 times in 10 (~0.8)."""
    return propose_chains([history], [depth], table, store)[0]


def propose_chains(histories: Sequence[TokenHistory], depths: Sequence[int], table: LookupTable,
                   store: NgramStore | None = None) -> list[tuple[list[int], list[float], int]]:
    """`propose_chain` for a batch of sequences, the store's chains in one call
    (`NgramStore.propose_many`; a chain's first d tokens are its chain of depth d)."""
    return [branches[0] if branches else ([], [], 0)
            for branches in propose_branches(histories, depths, table, store)]


def propose_branches(histories: Sequence[TokenHistory], depths: Sequence[int],
                     table: LookupTable, store: NgramStore | None = None
                     ) -> list[list[tuple[list[int], list[float], int]]]:
    """Per sequence, every chain lookup proposes (at most `depth` tokens each): prompt
    lookup's (match length > 0) and the n-gram store's (match 0), the one whose values sum
    higher first (prompt lookup's on a tie), empty ones left out. The two often disagree
    where both are unsure, and a tree of both (`rank_branches`) is accepted further than
    either alone for the same nodes (greedy SmolLM2, 40 + 40 benchmark prompts x 256 tokens,
    5 lookup nodes a step: 2.25 -> 2.31 tokens a step on MT-bench, 2.55 -> 2.64 on
    HumanEval)."""
    most = max(depths, default=0)
    others = (store.propose_many([h.tokens for h in histories], most)
              if store is not None and most > 0 else None)
    out = []
    for b, (history, depth) in enumerate(zip(histories, depths, strict=True)):
        toks, match = history.propose(depth)
        branches = [(toks, table.values(match, len(toks)), match)] if toks else []
        if others is not None and depth > 0 and others[b][0]:
            other = (others[b][0][:depth], others[b][1][:depth], 0)
            if branches and sum(other[1]) > sum(branches[0][1]):
                branches.insert(0, other)
            else:
                branches.append(other)
        out.append(branches)
    return out


class LookupNode(NamedTuple):
    """A node of the tree lookup's branches make under the root (a named tuple: a step at
    batch 8 makes ~100 of them)."""

    token: int
    parent: int  # index of the parent in the ranked list; -1: the root
    depth: int  # from 1
    value: float
    store: bool  # only the n-gram store's branch proposed it


def rank_branches(branches: Sequence[tuple[list[int], list[float], int]],
                  most: int) -> list[LookupNode]:
    """The branches of one sequence (`propose_branches`) as one tree: a token two branches
    share under the same parent is one node (the larger value), and the nodes are ranked by
    value, highest first (ties: the shallower, then the earlier branch's), at most `most` of
    them. A branch's values do not increase along it, so a node is worth no more than its
    parent and every prefix of the ranking is a tree: keeping the best n nodes is cutting the
    list. E.g. branches [a, b] (0.6, 0.3) and [a, c] (0.5, 0.4): a 0.6, c 0.4, b 0.3."""
    if len(branches) == 1:  # a chain ranks as it runs
        toks, values, match = branches[0]
        return [LookupNode(tok, d - 2, d, value, match == 0)
                for d, (tok, value) in enumerate(zip(toks[:most], values, strict=False), 1)]
    nodes: list[list] = []  # token, parent, depth, value, store (build order)
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for toks, values, match in branches:
        parent = -1
        for depth, (tok, value) in enumerate(zip(toks[:most], values, strict=False), start=1):
            key = (parent, tok)
            at = index.get(key)
            if at is None:
                at = index[key] = len(nodes)
                nodes.append([tok, parent, depth, value, match == 0])
            else:
                node = nodes[at]
                node[3] = max(node[3], value)
                node[4] = node[4] and match == 0
            parent = at
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i][3], nodes[i][2], i))[:most]
    rank = {i: r for r, i in enumerate(order)}
    return [LookupNode(tok, rank[parent] if parent >= 0 else -1, depth, value, store)
            for tok, parent, depth, value, store in (nodes[i] for i in order)]


def lookup_tree_row(root: int, nodes: Sequence[LookupNode], values: Sequence[float]
                    ) -> tuple[list, list, list, list, list]:
    """The first len(values) ranked nodes (`rank_branches`) under `root` as a tree row for
    `eagle2.tree.tree_from_rows` (root first, depth order), each valued as `values` says."""
    order = sorted(range(len(values)), key=lambda i: nodes[i].depth)  # stable
    at = {i: j + 1 for j, i in enumerate(order)}
    return ([root, *(nodes[i].token for i in order)],
            [-1, *(at[nodes[i].parent] if nodes[i].parent >= 0 else 0 for i in order)],
            [0, *(nodes[i].depth for i in order)],
            [1.0, *(values[i] for i in order)],
            [False] + [True] * len(order))


@dataclass(frozen=True)
class Candidates:
    """A flat candidate list as `eagle2.tree.build_tree` takes it, in depth order."""

    tokens: torch.Tensor  # [B, C]
    parents: torch.Tensor  # [B, C] index into the list, -1 = the root
    scores: torch.Tensor  # [B, C] what the rerank sorts by (log scale; -inf: no candidate)
    depths: torch.Tensor  # [B, C] from 1
    values: torch.Tensor  # [B, C] acceptance estimates the tree reports
    lookup: torch.Tensor  # [B, C] bool: proposed by lookup alone


def add_chains(cands: Candidates, chain_tokens: torch.Tensor, chain_len: torch.Tensor,
               chain_scores: torch.Tensor, chain_values: torch.Tensor
               ) -> tuple[Candidates, torch.Tensor]:
    """Merge one lookup chain per row under the root into the head's candidates.

    chain_tokens, chain_scores, chain_values: [B, D] (row b uses its first chain_len[b]);
    scores and values must not increase along a chain. Walking down the chain, a token that
    the head proposed under the same parent reuses that candidate (score and value: the
    larger of the two); from the first one it did not, the chain adds new candidates. Each
    row gets D more columns (a reused or unused chain position is a non-candidate: score
    -inf), and the result is back in depth order (stable: lookup nodes after the head's at
    each depth), with [B, D] bool: which chain tokens became new candidates. Row by row on
    Python lists (as `eagle2.tree.build_tree`: the lists are small).
    E.g. head [a, b | a1] (a1 under a), chain [a, x]: a stays (value max), x joins under a.
    """
    num_b, num_c = cands.tokens.shape
    num_d = chain_tokens.shape[1]
    lists = host_lists([cands.tokens, cands.parents, cands.scores, cands.depths, cands.values,
                        cands.lookup, chain_tokens, chain_len, chain_scores, chain_values])
    cols, chains = lists[:6], lists[6:]  # (one read from a device)
    # below the head's deepest level (of the whole batch) nothing can be reused
    walked = min(num_d, max((max(r) for r in cols[3]), default=0) if num_c else 0)
    rows, fresh = [], []
    for b in range(num_b):
        tok, par, score, dep, val, look = (list(c[b]) for c in cols)
        ctok, length, cscore, cval = (c[b] for c in chains)
        first: dict[tuple[int, int], int] = {}  # (parent, token) -> its first candidate
        for i in range(num_c):
            first.setdefault((par[i], tok[i]), i)
        cur, parents, real = -1, [], []  # cur: the chain's node so far (-1: the root)
        for d in range(walked):
            hit = first.get((cur, ctok[d])) if d < length else None
            parents.append(cur)
            real.append(hit is None and d < length)
            if hit is not None:
                score[hit] = max(score[hit], cscore[d])
                val[hit] = max(val[hit], cval[d])
                cur = hit
            elif d < length:
                cur = num_c + d
        for d in range(walked, num_d):  # the rest: each new, under the one before it
            after = num_c + length - 1 if length > walked else cur  # past the chain's end
            parents.append(cur if d == walked else num_c + d - 1 if d - 1 < length else after)
            real.append(d < length)
        fresh.append(real)
        merged = (tok + ctok, par + parents,
                  score + [s if r else float("-inf") for s, r in zip(cscore, real, strict=True)],
                  dep + list(range(1, num_d + 1)),
                  val + [v if r else 0.0 for v, r in zip(cval, real, strict=True)], look + real)
        rows.append(_depth_order(*merged))
    dtypes = (cands.tokens.dtype, cands.parents.dtype, cands.scores.dtype, cands.depths.dtype,
              cands.values.dtype, torch.bool)
    dev = cands.tokens.device
    out = Candidates(*(rows_tensor(list(col), dt, dev)
                       for col, dt in zip(zip(*rows, strict=True), dtypes, strict=True)))
    return out, rows_tensor(fresh, torch.bool, dev).view(num_b, num_d)


def _depth_order(tokens: list, parents: list, scores: list, depths: list, values: list,
                 lookup: list) -> tuple[list, ...]:
    """One row stably sorted by depth, parents renumbered. E.g. depths [1, 2, 1] -> order
    [0, 2, 1]."""
    order = sorted(range(len(depths)), key=depths.__getitem__)
    new_of = [0] * len(order)
    for j, i in enumerate(order):
        new_of[i] = j
    return ([tokens[i] for i in order],
            [new_of[parents[i]] if parents[i] >= 0 else -1 for i in order],
            *([col[i] for i in order] for col in (scores, depths, values, lookup)))
