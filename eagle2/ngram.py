"""Corpus lookup: what the target itself wrote after the same few tokens (docs/draft-tree.md
"The n-gram store").

Prompt lookup copies from the request's own tokens; where its match is short (a single token
that occurred before: accepted ~20% of the time on MT-bench) or missing, the n-gram
continuations of the target's own answers to other prompts often know better: the answers
the draft head was trained on are the target's greedy (and some T = 1) outputs, so their most
frequent continuation of the last 1-4 tokens is often what the target writes next (on
MT-bench, greedy, 43% of the positions where prompt lookup found no match).

`NgramStore` holds, for every context of 1-4 tokens seen at least `min_total` times in such
answers, its most frequent next token and a cell (order, that token's share of the context's
continuations, how often the context occurred); `rates[cell]` is the measured probability
that the target's greedy next token is that token, fitted on held-out answers the store was
not built from. A proposal walks the longest known context, appends its token and repeats,
valuing the d-th token at the product of the first d rates. Contexts are keys of a 64-bit
hash (`_context_keys`): a collision proposes a wrong token, which verification rejects.

Stored beside the head as `ngram.npz` (it belongs to the target, as the head does); built by
`eagle2 build-ngram` from the head's training conversations. A batch's chains are walked in
one native call (`propose_many`, csrc/ngram.cpp; the Python walk where it cannot be built).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle2.ext import ngram_ops

FILE_NAME = "ngram.npz"
MAX_ORDER = 4
SHARE_BINS = 10  # the top token's share of its context's continuations, in tenths
TOTAL_EDGES = (2, 3, 6, 21)  # context occurrences: 2, 3-5, 6-20, 21+
MIN_VALUE = 0.02  # a chain stops where its next token would be worth less

_MASK = (1 << 64) - 1
_MULT = 0x9E3779B97F4A7C15
_SEED = 0x2545F4914F6CDD1D


def _mix(h: int, tok: int) -> int:
    return ((h ^ (tok + 1)) * _MULT) & _MASK


def _context_keys(tokens: Sequence[int], max_order: int) -> list[int]:
    """Keys of the contexts ending at the end of `tokens`, order 1 first (the last token, then
    the last two, ...): one hash over the tokens read backwards, so each order extends the
    last."""
    keys, h = [], _SEED
    for tok in reversed(tokens[-max_order:]):
        h = _mix(h, tok)
        keys.append(h)
    return keys


def _cells(order: np.ndarray, share: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Cell index of (order 1-4, share in [0, 1], total >= 2)."""
    sbin = np.minimum((share * SHARE_BINS).astype(np.int64), SHARE_BINS - 1)
    tbin = np.searchsorted(np.asarray(TOTAL_EDGES), total, side="right") - 1
    return ((order - 1) * SHARE_BINS + sbin) * len(TOTAL_EDGES) + tbin


NUM_CELLS = MAX_ORDER * SHARE_BINS * len(TOTAL_EDGES)


@dataclass(frozen=True)
class NgramStore:
    """Sorted context keys [K] (uint64), each one's next token [K] and cell [K]; rates[cell]:
    the probability that the target's greedy next token is that token."""

    keys: np.ndarray
    tokens: np.ndarray
    cells: np.ndarray
    rates: np.ndarray  # [NUM_CELLS] float
    max_order: int = MAX_ORDER
    info: dict | None = None  # how it was built and fitted (sizes, held-out checks)

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def build(cls, answers: Iterable[tuple[Sequence[int], Sequence[int]]],
              max_order: int = MAX_ORDER, min_total: int = 2,
              rates: np.ndarray | None = None) -> NgramStore:
        """answers: (the prompt's last tokens, the answer's tokens) pairs; every answer token is
        a continuation of the contexts ending before it (the prompt's tail gives the first
        answer tokens theirs). Keeps contexts seen >= min_total times. rates: the cells'
        acceptance (default: each cell's share midpoint, until `fit`)."""
        if not 1 <= max_order <= MAX_ORDER:
            raise ValueError(f"max_order must be 1..{MAX_ORDER}, got {max_order}")
        key_parts, next_parts, order_parts = [], [], []
        mult = np.uint64(_MULT)
        for prompt_tail, answer in answers:
            seq = np.array([*prompt_tail, *answer], dtype=np.int64)
            pos = np.arange(len(prompt_tail), len(seq))
            h = np.full(len(pos), _SEED, dtype=np.uint64)
            for order in range(1, max_order + 1):  # `_context_keys`, vectorised
                ok = pos - order >= 0
                h = (h ^ (seq[np.maximum(pos - order, 0)] + 1).astype(np.uint64)) * mult
                key_parts.append(h[ok])
                next_parts.append(seq[pos[ok]])
                order_parts.append(np.full(int(ok.sum()), order, dtype=np.int64))
        if not key_parts or not sum(map(len, key_parts)):
            raise ValueError("no answer tokens to build an n-gram store from")
        key = np.concatenate(key_parts)
        nxt = np.concatenate(next_parts)
        ords = np.concatenate(order_parts)
        # count (context, next) pairs: sort by context, then next
        order = np.lexsort((nxt, key))
        key, nxt, ords = key[order], nxt[order], ords[order]
        new_pair = np.r_[True, (key[1:] != key[:-1]) | (nxt[1:] != nxt[:-1])]
        pair_start = np.flatnonzero(new_pair)
        pair_count = np.diff(np.r_[pair_start, len(key)])
        pkey, pnext, pord = key[pair_start], nxt[pair_start], ords[pair_start]
        new_ctx = np.r_[True, pkey[1:] != pkey[:-1]]
        ctx_start = np.flatnonzero(new_ctx)
        total = np.add.reduceat(pair_count, ctx_start)
        # the most frequent next token per context (the first of the ties: the smallest id)
        ctx_id = np.cumsum(new_ctx) - 1
        best = np.lexsort((-pair_count, ctx_id))
        first = best[np.searchsorted(ctx_id[best], np.arange(len(ctx_start)))]
        keep = total >= min_total
        cells = _cells(pord[ctx_start], pair_count[first] / total, total)
        if rates is None:
            rates = (np.arange(NUM_CELLS) // len(TOTAL_EDGES) % SHARE_BINS + 0.5) / SHARE_BINS
        return cls(pkey[ctx_start][keep], pnext[first][keep].astype(np.int32),
                   cells[keep].astype(np.uint16), np.asarray(rates, dtype=np.float64),
                   max_order, {"answer_tokens": int((ords == 1).sum())})

    def _find(self, tokens: Sequence[int]) -> int | None:
        """Index of the longest known context ending `tokens` (None: none is known). One
        search for all the orders' keys (a search per order cost ~4 numpy calls a token:
        at batch 8 the chains' proposals took ~0.5 ms a step)."""
        keys = _context_keys(tokens, self.max_order)
        found = np.searchsorted(self.keys, np.array(keys, dtype=np.uint64)).tolist()
        for key, i in zip(reversed(keys), reversed(found), strict=True):
            if i < len(self.keys) and int(self.keys[i]) == key:
                return i
        return None

    def next(self, tokens: Sequence[int]) -> tuple[int, float] | None:
        """The next token after the longest known context ending `tokens`, and its rate."""
        i = self._find(tokens)
        return None if i is None else (int(self.tokens[i]), float(self.rates[self.cells[i]]))

    def propose(self, tokens: Sequence[int], depth: int) -> tuple[list[int], list[float]]:
        """Up to `depth` tokens after `tokens`, each continuing the one before, and their values
        (the product of the rates so far; the chain stops below MIN_VALUE)."""
        ctx = list(tokens[-self.max_order:])
        out: list[int] = []
        values: list[float] = []
        value = 1.0
        for _ in range(depth):
            nxt = self.next(ctx)
            if nxt is None or value * nxt[1] < MIN_VALUE:
                break
            value *= nxt[1]
            out.append(nxt[0])
            values.append(value)
            ctx = [*ctx[1:], nxt[0]] if len(ctx) >= self.max_order else [*ctx, nxt[0]]
        return out, values

    @functools.cached_property
    def _native(self) -> tuple[torch.Tensor, ...]:
        """What csrc/ngram.cpp reads: the keys' bits as int64; a radix index of them (where
        the keys whose top `bits` bits are b begin, about one key a bucket); the tokens; each
        key's rate."""
        keys = np.ascontiguousarray(self.keys, np.uint64)
        bits = max(1, min(24, len(keys).bit_length()))
        tops = np.arange(2 ** bits + 1, dtype=np.uint64) << np.uint64(64 - bits)
        starts = np.searchsorted(keys, tops).astype(np.int64)
        starts[-1] = len(keys)  # (the last top wraps to 0)
        return (torch.from_numpy(keys.view(np.int64)), torch.from_numpy(starts),
                torch.from_numpy(np.ascontiguousarray(self.tokens, np.int32)),
                torch.from_numpy(np.ascontiguousarray(self.rates[self.cells], np.float64)))

    def propose_many(self, contexts: Sequence[Sequence[int]], depth: int
                     ) -> list[tuple[list[int], list[float]]]:
        """`propose` for each context, in one native call where csrc/ngram.cpp is built (the
        same tokens and values: a test compares them; inside the engine at batch 8 the Python
        walk cost ~0.5 ms a step, this ~0.16)."""
        ops = ngram_ops()  # (cached)
        if ops is None or not contexts or depth <= 0:
            return [self.propose(c, depth) for c in contexts]
        rows = []
        for c in contexts:
            tail = [int(t) for t in c[-self.max_order:]]
            rows.append([-1] * (self.max_order - len(tail)) + tail)
        toks, values = ops.ngram_chains(*self._native, torch.tensor(rows, dtype=torch.long),
                                        depth, MIN_VALUE, self.max_order)
        out = []
        for row_toks, row_values in zip(toks.tolist(), values.tolist(), strict=True):
            n = row_toks.index(-1) if -1 in row_toks else depth
            out.append((row_toks[:n], row_values[:n]))
        return out

    def check_vocab(self, vocab_size: int) -> None:
        """A store built from another tokenizer's answers would propose ids the target has no
        embedding for: refuse it with what to do."""
        top = int(self.tokens.max()) if len(self.tokens) else -1
        if top >= vocab_size:
            raise ValueError(f"the n-gram store ({FILE_NAME}) proposes token ids up to {top}, "
                             f"but the target's vocabulary has {vocab_size}: it was built for "
                             "another tokenizer; rebuild it with `eagle2 build-ngram` from this "
                             "target's answers, or delete it")

    def with_rates(self, rates: np.ndarray, info: dict | None = None) -> NgramStore:
        return NgramStore(self.keys, self.tokens, self.cells, np.asarray(rates, np.float64),
                          self.max_order, {**(self.info or {}), **(info or {})})

    def outcomes(self, answers: Iterable[tuple[Sequence[int], Sequence[int]]]
                 ) -> tuple[np.ndarray, np.ndarray]:
        """For every answer token with a known context: (its cell, whether the store's token
        for that context is it) [P] each."""
        cells, hits = [], []
        for prompt_tail, answer in answers:
            seq = [*prompt_tail, *answer]
            for i in range(len(prompt_tail), len(seq)):
                j = self._find(seq[max(0, i - self.max_order):i])
                if j is not None:
                    cells.append(int(self.cells[j]))
                    hits.append(int(self.tokens[j]) == seq[i])
        return np.array(cells, dtype=np.int64), np.array(hits, dtype=bool)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, keys=self.keys, tokens=self.tokens, cells=self.cells,
                            rates=self.rates, max_order=np.int64(self.max_order),
                            info=np.frombuffer(json.dumps(self.info or {}).encode(), np.uint8))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> NgramStore:
        with np.load(path) as data:
            info = json.loads(bytes(data["info"]).decode()) if "info" in data else None
            store = cls(data["keys"], data["tokens"], data["cells"], data["rates"],
                        int(data["max_order"]), info)
        if len(store.rates) != NUM_CELLS:
            raise ValueError(f"{path}: {len(store.rates)} rates, expected {NUM_CELLS}")
        if np.any(store.keys[1:] <= store.keys[:-1]):
            raise ValueError(f"{path}: context keys are not sorted and unique")
        ngram_ops()  # built (once per machine, ~15 s) as the store loads, not at a first request
        return store

    @classmethod
    def of_head(cls, head_dir: str | Path | None) -> NgramStore | None:
        """The store shipped in a head's directory (`FILE_NAME`), None without one."""
        if head_dir is None:
            return None
        path = Path(head_dir) / FILE_NAME
        return cls.load(path) if path.exists() else None


def fit_rates(cells: np.ndarray, hits: np.ndarray, min_count: int = 30) -> np.ndarray:
    """Per-cell hit rates from held-out outcomes. A cell with fewer than min_count samples
    takes its order's rate at that share over all totals, else the order's overall rate (0
    where an order has no sample); within an order and total bin a rate never falls as the
    share grows (running maximum)."""
    count = np.bincount(cells, minlength=NUM_CELLS).astype(np.float64)
    hit = np.bincount(cells, weights=hits.astype(np.float64), minlength=NUM_CELLS)
    shape = (MAX_ORDER, SHARE_BINS, len(TOTAL_EDGES))
    count, hit = count.reshape(shape), hit.reshape(shape)
    rates = np.zeros(shape)
    for o in range(MAX_ORDER):
        order_rate = hit[o].sum() / count[o].sum() if count[o].sum() else 0.0
        for s in range(SHARE_BINS):
            share_n, share_h = count[o, s].sum(), hit[o, s].sum()
            fallback = share_h / share_n if share_n >= min_count else order_rate
            for t in range(len(TOTAL_EDGES)):
                rates[o, s, t] = (hit[o, s, t] / count[o, s, t] if count[o, s, t] >= min_count
                                  else fallback)
        rates[o] = np.maximum.accumulate(rates[o], axis=0)
    return rates.reshape(-1)
