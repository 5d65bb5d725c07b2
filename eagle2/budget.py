"""The cost-aware tree budget (docs/draft-tree.md "Choosing the tree size each step").

EAGLE-2 ranks draft nodes by value, the product of draft probabilities along the path; after
calibration (`eagle2.calibration`) a node's value estimates the probability that verification
accepts it, so the expected number of accepted draft tokens of a tree is the sum of its nodes'
values. A bigger tree accepts more but costs more to verify, and what it costs depends on the
hardware and on the batch: `CostModel` holds the target's forward time c(B, N) measured on
this machine. Each step the engine keeps, for every request, its best n - 1 nodes, with the n
that maximises

    tokens per second = sum_b (1 + E_b(n)) / (draft time + c(B, n))

and when even the best n does not beat plain decoding (B / c(B, 1)), it stops drafting for a
while (`SpeculationGate`) and decodes plainly, probing again later: at large batches, where
verification is no longer cheap, speculation switches itself off.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from eagle2.machine import cache_root, machine_key, write_json_atomic
from eagle2.tree import HOST, chain_tree, to_device

# bumped when costs are measured differently: cache files of older ways are measured again
# 5: the lm_head's logits and greedy argmax timed apart (`head_rows`); 6: after text, not
# random tokens (`runner.timing_tokens`); 7: the grid through the steps' `verify_step`, not
# `runner.forward` (`time_grid`)
COSTS_VERSION = 7
BATCHES = (1, 2, 4, 8, 16)
NODES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
HEAD_ROWS = (1, 2, 4, 8, 16, 32)  # lm_head rows timed (linear past the last)
# rows a request whose argmax a greedy verification takes in its first round (a chain's root
# and first child: `verify_greedy_lazily`), or the batch's first `first_rows` nodes where the
# runner's first round takes more (`GreedyArgmax.first_rows`); the later rounds' few rows are
# left to the scales
GREEDY_ROWS = 2


def cost_cache_path(target) -> Path:
    """Where this machine's measured forward costs of this target (`TargetModel`) are kept:
    keyed by its shape, dtype, device and the kernels its backend chose."""
    cfg = target.config
    shape = (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
             cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size)
    key = machine_key(f"{target.name}|{shape}|{target.dtype}|{target.device}|"
                      f"v{COSTS_VERSION}{target.backend.cost_key(target)}")
    return cache_root() / "costs" / f"{key}.json"


def _interp(xs: tuple[int, ...], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys); linear extrapolation past the last point."""
    if len(xs) == 1:
        return ys[0] * max(x, 1) / xs[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-9)


@dataclass(frozen=True)
class CostModel:
    """Forward time in seconds of B requests x N tree tokens, measured on a grid after
    `prefix` committed tokens per request, and optionally on a second grid after
    `long_prefix`: the attention's share grows with the context (at 8 requests x 1 token,
    c = 57 ms after 64 tokens, 99 ms after 512, this machine), so a cost is read at the
    batch's mean context, linear between (and beyond) the two."""

    batches: tuple[int, ...]  # ascending
    nodes: tuple[int, ...]  # ascending
    seconds: tuple[tuple[float, ...], ...]  # [len(batches)][len(nodes)]
    prefix: int = 0  # committed cache entries per request when measured
    # seconds of one draft-head call (one tree level of DRAFT_PROBE_TOP_K nodes) at each of
    # draft_batches; empty until measured. Times come from here, never from the step just
    # run, so the tree chosen for a seeded sampling request is the same on every run here.
    draft_batches: tuple[int, ...] = ()
    draft_level_s: tuple[float, ...] = ()
    # the same at each of draft_batches for a level of DRAFT_NARROW_TOP_K nodes a request: a
    # level's cost grows with its nodes (B x top_k rows through the head and its vocabulary),
    # and the engine drafts narrower trees where the budget keeps small ones (empty: not
    # measured, every width costs as the wide level)
    draft_narrow_s: tuple[float, ...] = ()
    # which head the draft costs were measured with (`draft_key`): another head re-measures
    draft_head: str = ""
    long_prefix: int = 0  # 0: one grid, the cost does not depend on the context
    long_seconds: tuple[tuple[float, ...], ...] = ()  # like `seconds`, after long_prefix
    # seconds of the lm_head over head_rows rows: the logits (which every forward of the grid
    # computes, a row a token) and the same rows' argmax without the logits
    # (`TargetModel.greedy_tokens`; empty where the target has no greedy head)
    head_rows: tuple[int, ...] = ()
    head_logits_s: tuple[float, ...] = ()
    head_greedy_s: tuple[float, ...] = ()

    def __call__(self, num_b: int, num_n: int, context: float | None = None) -> float:
        """context: committed tokens per request (mean over the batch); None: the grid's."""
        short = self._read(self.seconds, num_b, num_n)
        if context is None or not self.long_prefix or self.long_prefix <= self.prefix:
            return short
        long = self._read(self.long_seconds, num_b, num_n)
        frac = (context - self.prefix) / (self.long_prefix - self.prefix)
        return max(short + (long - short) * frac, 0.5 * short)

    def greedy(self, num_b: int, num_n: int, context: float | None = None,
               first_rows: int = 0) -> float:
        """c(B, N) of a verification that takes the target's argmax without the logits
        (every request greedy: `LocalRunner.verify_step`): the grid's forward less the logits
        of its B x N rows, plus the argmax at GREEDY_ROWS of each request, or at first_rows
        of the B x N where that is more (`verify_greedy_lazily`'s first round). E.g. 30 ms
        with 8 ms of logits, 2 ms for the argmax of 2 rows: 24 ms. Without a greedy head's
        times, the grid's cost."""
        full = self(num_b, num_n, context)
        if not self.head_greedy_s:
            return full
        key = ("greedy", num_b, num_n, first_rows)
        head = self._reads.get(key)  # (the budget asks ~10 times a step)
        if head is None:
            rows = max(num_b * min(num_n, GREEDY_ROWS), min(num_b * num_n, first_rows))
            head = self._reads[key] = (
                _interp(self.head_rows, list(self.head_logits_s), num_b * num_n),
                _interp(self.head_rows, list(self.head_greedy_s), rows))
        logits, argmax = head
        return max(full - logits + argmax, 0.5 * full)

    def _read(self, grid, num_b: int, num_n: int) -> float:
        key = (grid is self.seconds, num_b, num_n)
        seconds = self._reads.get(key)
        if seconds is None:
            per_batch = [_interp(self.nodes, list(row), num_n) for row in grid]
            seconds = self._reads[key] = _interp(self.batches, per_batch, num_b)
        return seconds

    @functools.cached_property
    def _reads(self) -> dict[tuple, float | tuple[float, float]]:
        """(short grid?, B, N) -> seconds read off a grid, and ("greedy", B, N, first rows)
        -> the lm_head's (logits, argmax) seconds of `greedy`: the budget reads the same
        cells every step (~50 a step, ~4 us each)."""
        return {}

    def draft_level(self, num_b: int, width: int = 0) -> float:
        """Seconds of one draft-head call for num_b sequences (linear past the measured) of
        `width` nodes each (0: DRAFT_PROBE_TOP_K), linear in the width between the narrow and
        the wide measurement. E.g. 4 ms wide (8 nodes), 2 ms narrow (2 nodes): width 4 costs
        2 + 2 x (4 - 2) / 6 = 2.67 ms."""
        if not self.draft_batches:
            return 0.0
        wide = _interp(self.draft_batches, list(self.draft_level_s), num_b)
        if not self.draft_narrow_s or not width or width >= DRAFT_PROBE_TOP_K:
            return wide
        narrow = _interp(self.draft_batches, list(self.draft_narrow_s), num_b)
        frac = (width - DRAFT_NARROW_TOP_K) / (DRAFT_PROBE_TOP_K - DRAFT_NARROW_TOP_K)
        return max(narrow + (wide - narrow) * frac, 0.5 * min(narrow, wide))

    def catch_up(self, num_b: int, rows: int) -> float:
        """Seconds a draft call spends beyond a one-position one when it first runs the head
        over `rows` new positions per sequence (pairs the drafter has not seen: the backlog of
        plain steps; a narrow level is num_b x 2 rows through the head): the level cost linear
        in the width, extrapolated past the wide measurement. E.g. narrow 2 ms, wide 4 ms,
        20 rows: 2 + 2 x 18 / 6 - 2 = 6 ms more."""
        if not self.draft_batches or rows <= DRAFT_NARROW_TOP_K:
            return 0.0
        wide = _interp(self.draft_batches, list(self.draft_level_s), num_b)
        narrow = _interp(self.draft_batches, list(self.draft_narrow_s or self.draft_level_s),
                         num_b)
        slope = max(wide - narrow, 0.0) / (DRAFT_PROBE_TOP_K - DRAFT_NARROW_TOP_K)
        return slope * (rows - DRAFT_NARROW_TOP_K)

    def to_json(self) -> dict:
        return {"batches": list(self.batches), "nodes": list(self.nodes),
                "seconds": [list(r) for r in self.seconds], "prefix": self.prefix,
                "draft_batches": list(self.draft_batches),
                "draft_level_s": list(self.draft_level_s),
                "draft_narrow_s": list(self.draft_narrow_s), "draft_head": self.draft_head,
                "long_prefix": self.long_prefix,
                "long_seconds": [list(r) for r in self.long_seconds],
                "head_rows": list(self.head_rows), "head_logits_s": list(self.head_logits_s),
                "head_greedy_s": list(self.head_greedy_s)}

    @classmethod
    def from_json(cls, data: dict, draft_head: str | None = None) -> CostModel:
        """draft_head: take the draft costs kept for this head in a cache file's "drafts"
        (none if it has none); None: the ones the JSON names (draft_head/draft_level_s)."""
        batches = tuple(data.get("draft_batches", ()))
        levels = tuple(data.get("draft_level_s", ())) if batches else ()
        narrow = tuple(data.get("draft_narrow_s", ())) if batches else ()
        head = data.get("draft_head", "")
        if draft_head is not None and draft_head != head:
            entry = data.get("drafts", {}).get(draft_head, {})
            batches, levels = tuple(entry.get("batches", ())), tuple(entry.get("level_s", ()))
            narrow = tuple(entry.get("narrow_s", ()))
            head = draft_head if batches else ""
        return cls(tuple(data["batches"]), tuple(data["nodes"]),
                   tuple(tuple(r) for r in data["seconds"]), data.get("prefix", 0),
                   batches, levels, narrow, head, data.get("long_prefix", 0),
                   tuple(tuple(r) for r in data.get("long_seconds", ())),
                   tuple(data.get("head_rows", ())), tuple(data.get("head_logits_s", ())),
                   tuple(data.get("head_greedy_s", ())))

    def save(self, path: Path) -> None:
        """Write to a cache file, keeping the draft costs of other heads already there (two
        deployments of one target, e.g. with the head in a worker or in the engine, share
        the forward costs and keep their own draft costs)."""
        with _locked(path):
            self._write(path)

    def _write(self, path: Path) -> None:
        """save() with the lock already held."""
        drafts = {}
        if path.exists():
            try:
                drafts = json.loads(path.read_text()).get("drafts", {})
            except (OSError, ValueError):
                drafts = {}
        if self.draft_head:
            drafts[self.draft_head] = {"batches": list(self.draft_batches),
                                       "level_s": list(self.draft_level_s),
                                       "narrow_s": list(self.draft_narrow_s)}
        write_json_atomic(path, {**self.to_json(), "drafts": drafts})

    @classmethod
    def measure(cls, runner, max_batch: int, max_nodes: int = 32, prefix: int = 64,
                long_prefix: int = 0, repeats: int = 3) -> CostModel:
        """Time the verification step (`runner.verify_step`, logits included) over the grid
        after `prefix` and, if long_prefix > prefix, after long_prefix too (`time_grid`,
        1 + `repeats` sweeps over both), then take the lower envelope (`lower_envelope`; a
        cell of the short grid is also bounded by the long one's); and the lm_head's rows
        apart (`time_head`).

        Runs on cache slots [0, B): each slot's length is raised to at least the prefix for
        the measurement, so the tokens land in scratch entries past anything committed, and
        put back after. Safe between engine steps."""
        batches = tuple(b for b in BATCHES if b <= max_batch) or (1,)
        nodes = tuple(n for n in NODES if n <= max_nodes)
        prefixes = (prefix, long_prefix) if long_prefix > prefix else (prefix,)
        grids = time_grid(runner, batches, nodes, prefixes, passes=repeats + 1)
        return replace(cls.from_grids(batches, nodes, prefixes, grids),
                       **time_head(runner, passes=repeats + 1))

    @classmethod
    def from_grids(cls, batches: tuple[int, ...], nodes: tuple[int, ...],
                   prefixes: tuple[int, ...], grids) -> CostModel:
        """Timed grids, one per prefix (`time_grid`; one or two) -> the model: each grid's
        lower envelope, and a cell after the short prefix also bounded by the long one's
        (a longer context never costs less)."""
        if len(grids) == 1:
            return cls(batches, nodes, lower_envelope(grids[0]), prefixes[0])
        long = lower_envelope(grids[1])
        short = lower_envelope([[min(a, b) for a, b in zip(r, q, strict=True)]
                                for r, q in zip(grids[0], long, strict=True)])
        return cls(batches, nodes, short, prefixes[0], long_prefix=prefixes[1],
                   long_seconds=long)

    @classmethod
    def cached(cls, runner, max_batch: int, path: Path, prefix: int = 64,
               long_prefix: int = 0, refresh: bool = False,
               draft_head: str | None = None) -> CostModel:
        """From `path` (written by an earlier start or by `eagle2 bench-forward`), else
        measured and saved there. Processes starting together take turns (a file lock): the
        first measures, the others read, and no two measurements share the machine."""
        with _locked(path):
            if path.exists() and not refresh:
                model = cls.from_json(json.loads(path.read_text()), draft_head)
                if (model.batches[-1] >= min(max_batch, BATCHES[-1])
                        and (model.long_prefix > model.prefix or long_prefix <= prefix)
                        and (model.head_greedy_s or not getattr(runner, "greedy_argmax", False))):
                    return model
            model = cls.measure(runner, max_batch, prefix=prefix, long_prefix=long_prefix)
            model._write(path)
        return model


def time_grid(runner, batches: tuple[int, ...], nodes: tuple[int, ...],
              prefix: int | tuple[int, ...], passes: int = 4):
    """Best seconds of a verification step (`runner.verify_step`, the call the engine's steps
    make: `Engine._verify`) for B greedy requests x N tokens (a chain of N tree tokens after
    `prefix` committed tokens, or past what is committed), for every (B, N) of the grid:
    [B][N]; prefix a tuple: one such grid per prefix, swept together. A step's tree comes
    from HOST (where the engine keeps it) and only token ids and accepted features come back,
    as in a step: through `runner.forward` a sharded target's full logits [B, N, V] had
    crossed from rank 0 to the engine, which no step pays. The logits are included: where
    greedy steps take the target's argmax without them (`runner.greedy_argmax`), the grid
    asks the step for them (`logits=True`) and `CostModel.greedy` trades them for the argmax.

    The grid is swept `passes` times, one call per cell and sweep, and each cell keeps its
    fastest call. On a shared machine slow phases last seconds (another process or VM on the
    core): timing one cell's calls back to back lets a phase spoil all of them, while across
    sweeps a phase spoils one sample of many cells. The first sweep also warms each shape up
    (kernel primitives are built at a shape's first call); its samples count only where no
    later one is faster. Cache slots [0, max B) are used (the tree's entries are scratch past
    the committed ones, as a step's before its commit), lengths restored after."""
    from eagle2.config import SamplingParams

    prefixes = prefix if isinstance(prefix, tuple) else (prefix,)
    dev = runner.device
    slots = torch.arange(batches[-1], device=dev)
    old = runner.lengths[: batches[-1]].clone()
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    starts = {pre: torch.clamp(old, min=pre) for pre in prefixes}
    greedy = [SamplingParams()] * batches[-1]  # temperature 0: no generator is drawn from
    step = {"logits": True} if getattr(runner, "greedy_argmax", False) else {}
    inputs: dict[int, dict[tuple[int, int], tuple]] = {pre: {} for pre in prefixes}
    for pre, start in starts.items():
        for num_b in batches:
            for num_n in nodes:
                tree = chain_tree(torch.zeros(num_b, num_n, dtype=torch.long, device=HOST))
                positions = start[:num_b, None].to(dev) + to_device(tree.depths, dev)  # [B, N]
                inputs[pre][num_b, num_n] = (tree, positions, slots[:num_b], greedy[:num_b],
                                             [None] * num_b)
    best = {(pre, cell): float("inf") for pre, cells in inputs.items() for cell in cells}
    try:
        for _ in range(max(passes, 1)):
            for pre, cells in inputs.items():
                runner.set_lengths(slots, starts[pre])
                # untimed: the native attention's kept key blocks (`KVCache.key_blocks`) of
                # the other prefix's slots are brought up to date, as decoding has them (else
                # the first call of each batch after the switch transposed every key again)
                runner.verify_step(*cells[batches[-1], nodes[0]], **step)
                for cell, args in cells.items():
                    sync()
                    t0 = time.perf_counter()
                    runner.verify_step(*args, **step)
                    sync()
                    best[pre, cell] = min(best[pre, cell], time.perf_counter() - t0)
    finally:
        runner.set_lengths(slots, old)
    grids = [[[best[pre, (b, n)] for n in nodes] for b in batches] for pre in prefixes]
    return grids if isinstance(prefix, tuple) else grids[0]


def time_head(runner, rows: tuple[int, ...] = HEAD_ROWS, passes: int = 4) -> dict:
    """CostModel's head_* fields: the lm_head's seconds over `rows` rows with and without
    the logits (`runner.head_seconds`, best of `passes` sweeps; monotone: more rows never
    cost less), or {} where the runner does not time its head (e.g. a sharded target)."""
    head_seconds = getattr(runner, "head_seconds", None)
    if head_seconds is None:
        return {}
    logits, greedy = head_seconds(rows, passes)
    return {"head_rows": tuple(rows), "head_logits_s": lower_envelope([logits])[0],
            "head_greedy_s": lower_envelope([greedy])[0] if greedy else ()}


def lower_envelope(seconds) -> tuple[tuple[float, ...], ...]:
    """c(B, N) = the least time measured at any (B' >= B, N' >= N).

    Timing noise only ever adds time, and more requests or more tokens never cost less, so
    a larger cell's time is also an upper bound for a smaller cell, and the least of the two
    is the better estimate: one slow sample then does not price its cell (nor, as a running
    maximum would, every larger one) above what the machine does."""
    grid = [list(row) for row in seconds]
    for i in reversed(range(len(grid))):
        for j in reversed(range(len(grid[i]))):
            if j + 1 < len(grid[i]):
                grid[i][j] = min(grid[i][j], grid[i][j + 1])
            if i + 1 < len(grid):
                grid[i][j] = min(grid[i][j], grid[i + 1][j])
    return tuple(tuple(row) for row in grid)


@contextmanager
def _locked(path: Path):
    """An exclusive lock on `path`'s lock file (a sibling) for the duration of the block."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


DRAFT_PROBE_TOP_K = 8
DRAFT_NARROW_TOP_K = 2  # the narrow level measured beside it (CostModel.draft_narrow_s)
# how much better than plain decoding a speculative step must be predicted to keep drafting
SPECULATION_MARGIN = 0.05


def draft_key(drafter) -> str:
    """What decides a draft level's cost: the head's kind, its matrices' shapes and whether its
    layer and linears run on the CPU backend's native operators, which build (a remote
    drafter: "remote")."""
    head = getattr(drafter, "head", None)
    if head is None:
        return "remote"
    shapes = ",".join("x".join(map(str, p.shape)) for p in head.parameters())
    vocab = getattr(drafter, "draft_lm_head", None)
    rows = "" if vocab is None else f"|{tuple(vocab.shape)}"
    kernels = getattr(drafter, "kernels", None)  # the backend's (`Backend.head_kernels`)
    native = kernels.cost_key() if kernels is not None else ""
    return f"{getattr(head, 'kind', 'eagle2')}|{shapes}{rows}|{head.fc.weight.dtype}{native}"


def measure_draft_levels(drafter, batches: list[int], hidden: int, dtype: torch.dtype,
                         repeats: int = 3,
                         widths: tuple[int, ...] = (DRAFT_PROBE_TOP_K, DRAFT_NARROW_TOP_K)
                         ) -> dict[int, dict[int, float]]:
    """Seconds per draft-head call at each width (top_k) and batch size: {width: {batch: s}}.
    A depth-2 tree from one new position per sequence (three head calls), best of 1 +
    `repeats` sweeps over all (width, batch) cells (as `time_grid`: a slow phase of the
    machine spoils one sample of each cell, not all of one), on throwaway sequences (the
    drafter needs that many free slots)."""
    from eagle2.config import TreeConfig

    trees = {k: TreeConfig("eagle2", total_tokens=16, depth=2, top_k=k, budget="fixed",
                           lookup=0) for k in widths}
    ids = [f"__cost_probe_{i}" for i in range(max(batches))]
    best = {k: dict.fromkeys(batches, float("inf")) for k in widths}
    # the inputs on the head's device, where the drafter has one (in the engine they come from
    # the target's, the head's when both run there); a remote drafter sends them from HOST
    dev = getattr(drafter, "device", HOST)
    try:
        for i in range(repeats + 1):
            for k, tree in trees.items():
                for num_b in batches:
                    feats = torch.zeros(num_b, 1, hidden, dtype=dtype, device=dev)
                    toks = torch.zeros(num_b, 1, dtype=torch.long, device=dev)
                    counts = torch.ones(num_b, dtype=torch.long, device=dev)
                    t0 = time.perf_counter()
                    drafter.draft(ids[:num_b], feats, toks, counts, tree)
                    if i:  # the first sweep builds each shape's kernels
                        best[k][num_b] = min(best[k][num_b], (time.perf_counter() - t0) / 3)
    finally:
        for sid in ids:
            drafter.release(sid)
    return best


@dataclass(frozen=True)
class BudgetChoice:
    num_nodes: int  # N kept per auto-budget tree (root included)
    expected_tokens: float  # sum over requests of 1 + expected accepted drafts at N
    rate: float  # predicted tokens per second of this step at N
    plain_rate: float  # predicted tokens per second of a plain step
    plain_s: float = 0.0  # predicted seconds of a plain step
    draft_s: float = 0.0  # predicted seconds of the draft levels (within `rate`)

    @property
    def price(self) -> float:
        """Seconds this step is predicted to lose against plain decoding of the same tokens
        (0 if it gains): E / rate - E / plain_rate. A step pruned to the root loses its draft
        time."""
        return max(self.expected_tokens * (1 / self.rate - 1 / self.plain_rate), 0.0)

    @property
    def pays(self) -> bool:
        """Speculation is worth going on with: the predicted rate beats plain decoding by more
        than SPECULATION_MARGIN (the predictions' error: near break-even, drafting on a
        coin flip's verdict loses its probes' cost)."""
        return self.num_nodes > 1 and self.rate > self.plain_rate * (1 + SPECULATION_MARGIN)


# the share of plain decoding time that failed probes may cost (`probe_backoff`)
PROBE_BUDGET = 0.02


def probe_backoff(choice: BudgetChoice, budget: float = PROBE_BUDGET,
                  draft_call_s: float | None = None) -> int:
    """Plain steps to decode after a speculative step that did not pay, so that its predicted
    price is at most `budget` of their time (at least 0). E.g. batch 8, a probe losing 19.6 ms
    against plain steps of 61.6 ms: 16 steps (where 2, 4, 8 ... had probed 6 times in 96
    steps, the loss of each probe ~4x the gain of its accepted tokens).

    draft_call_s: the measured seconds of the probe's draft call, which replace the predicted
    levels in its price: the call also ran the head over the positions it had not seen (the
    plain steps' backlog, up to `TreeConfig.catch_up` of them a request), which the price of
    a tree, chosen by what its levels cost, leaves out (at batch 8 here that pass cost more
    than the levels and the wider verification together)."""
    price = choice.price
    if draft_call_s is not None:
        price += max(draft_call_s - choice.draft_s, 0.0)
    if price <= 0 or choice.plain_s <= 0:
        return 0
    return math.ceil(price / (budget * choice.plain_s) - 1e-9)


def choose_num_nodes(values: torch.Tensor, costs: CostModel | Callable[..., float], draft_s: float,
                     min_nodes: int = 1, context: float | None = None) -> BudgetChoice:
    # draft_s: the draft time of this step, predicted from the cost model
    """values: [B, N] calibrated acceptance estimates of each tree's nodes (node 0 = root,
    padding 0). -> the N that maximises predicted tokens per second this step.

    min_nodes: trees that cannot be cut (fixed budgets) make every forward at least this big.
    context: the batch's mean committed length (costs grow with it; None: the grid's own).
    E.g. one tree with values [1, .9, .5, .1], c(1, n) = .05, .052, .055, .07 s, draft .01 s:
    n = 3 gives (1 + 1.4) / .065 = 36.9 tokens/s, the best; plain gives 1 / .05 = 20.
    """
    num_b, num_n = values.shape
    drafts = values[:, 1:].float().clamp(0, 1)
    best = drafts.sort(dim=1, descending=True).values.cumsum(dim=1)  # [B, N - 1]
    # [N] by tree size n = i + 1
    expected = torch.cat([torch.zeros(1, device=best.device), best.sum(0)]) + num_b
    sizes = range(max(min_nodes, 1), num_n + 1)
    rates = [(float(expected[n - 1]) / (draft_s + costs(num_b, n, context)), n) for n in sizes]
    rate, n = max(rates)
    plain_s = costs(num_b, max(min_nodes, 1), context)
    return BudgetChoice(n, float(expected[n - 1]), rate, num_b / plain_s, plain_s, draft_s)


@dataclass
class MeasuredScales:
    """Measured step times against the cost model's predictions, as decayed ratios: plain
    steps, verified trees and draft calls. The cost grid is the best of a few quiet sweeps; in
    the engine a step also pays for acceptance, the tree's masks, the head's catch-up and
    whatever the machine does meanwhile (here: plain steps 1.2-1.3x their grid cost, trees
    1.4x, draft calls of a batch of 8 after a back-off 2.1x), and where trees cost more than
    the grid says against plain steps, the budget kept trees that lost. The engine uses the
    scaled costs only where timing cannot change an output (greedy batches,
    `Engine._timed_costs`): a seeded sampled request draws the same tokens on every run."""

    plain: float = 1.0
    tree: float = 1.0
    draft: float = 1.0
    decay: float = 0.9
    limits: tuple[float, float] = (0.5, 4.0)  # one step's ratio is clipped to these

    def observe(self, kind: str, actual_s: float, predicted_s: float) -> None:
        """kind: "plain", "tree" or "draft"."""
        if actual_s <= 0 or predicted_s <= 0:
            return
        ratio = min(max(actual_s / predicted_s, self.limits[0]), self.limits[1])
        setattr(self, kind, self.decay * getattr(self, kind) + (1 - self.decay) * ratio)

    def costs(self, costs: Callable[..., float]) -> Callable[..., float]:
        """The forward cost function c(B, n, context) with plain (n = 1) and tree (n > 1)
        forwards scaled."""
        def scaled(num_b: int, num_n: int, context: float | None = None) -> float:
            return costs(num_b, num_n, context) * (self.plain if num_n <= 1 else self.tree)
        return scaled


@dataclass
class RealizedRates:
    """What steps that drafted and steps that did not actually delivered at one batch size:
    committed tokens, seconds and steps of each kind as sums decayed by `decay` a step (of
    either kind). The budget's verdict comes from predictions (calibrated values, the cost
    grid, measured scales); these check it against the outcome. E.g. at batch 2 on an AVX2
    CPU the predicted accepted tokens came within 3% of those accepted, yet the drafting steps
    lost: their wider forwards and the head's catch-up cost more, against plain steps, than
    the grid said (eagle2 0.93-0.95x vanilla)."""

    decay: float = 0.99
    min_steps: float = 8.0  # decayed steps of each kind before `advantage` says anything
    spec: tuple[float, float, float] = (0.0, 0.0, 0.0)  # tokens, seconds, steps
    plain: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def observe(self, drafted: bool, tokens: int, seconds: float) -> None:
        self.spec, self.plain = (tuple(self.decay * x for x in acc)
                                 for acc in (self.spec, self.plain))
        new = (tokens, seconds, 1.0)
        if drafted:
            self.spec = tuple(a + b for a, b in zip(self.spec, new, strict=True))
        else:
            self.plain = tuple(a + b for a, b in zip(self.plain, new, strict=True))

    def advantage(self) -> float | None:
        """Tokens per second of the drafting steps / those of the plain ones; None until
        both kinds have `min_steps` (the drafting evidence fades over plain steps, so a
        losing verdict is retried)."""
        if min(self.spec[2], self.plain[2]) < self.min_steps or not self.spec[1] \
                or not self.plain[0]:
            return None
        return (self.spec[0] / self.spec[1]) / (self.plain[0] / self.plain[1])


@dataclass
class SpeculationGate:
    """Stop drafting while it does not pay; probe again after a back-off that doubles (up to
    `max_backoff` steps) each time the probe does not pay either, and resets when it does."""

    max_backoff: int = 64
    backoff: int = 0  # steps to skip after the current streak
    skip_left: int = 0
    history: list[bool] = field(default_factory=list)  # recent verdicts, for stats

    def should_draft(self) -> bool:
        if self.skip_left > 0:
            self.skip_left -= 1
            return False
        return True

    def record(self, pays: bool, min_backoff: int = 0) -> None:
        """min_backoff: skip at least this many steps after a step that did not pay (what
        keeps a probe's price a small share of the plain steps after it: `probe_backoff`)."""
        self.history = [*self.history[-63:], pays]
        if pays:
            self.backoff = 0
        else:  # the minimum may pass max_backoff, up to 4x
            self.backoff = max(min(max(2 * self.backoff, 2), self.max_backoff),
                               min(min_backoff, 4 * self.max_backoff))
            self.skip_left = self.backoff
