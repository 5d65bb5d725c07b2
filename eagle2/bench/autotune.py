"""Tree-budget auto-tuner (docs/DESIGN.md "Draft tree": "the budget must be chosen by measuring").

Three measurements on this hardware, then a pure choice:

1. **verify cost**: one target forward (+ logits and argmax) over N tree tokens after a
   ~200-token prefix, for N in `VERIFY_SIZES`; median of a few repeats, sizes interleaved.
2. **draft cost**: one drafter call (head update over 2 new pairs, root step, `depth`
   expansions, rerank) per top_k at the shallowest and the deepest depth, median of repeats;
   a level costs the same at every depth, so per top_k cost = `root + depth * level`.
3. **acceptance**: the target's greedy continuation of a few calibration prompts (not the
   benchmark's). At each position the head drafts its full candidate set once per top_k at
   the deepest depth, and the accepted length of every (depth, top_k, total_tokens) is read
   off it. This replay is exact for greedy verification: a dynamic tree of depth d holds the
   first d + 1 levels of the deepest tree's candidates (the frontier does not depend on
   depth), total_tokens only cuts the global rerank, and the accepted length is the longest
   prefix of the target's continuation found in the kept set. The replay models the head's
   candidates only; prompt-lookup nodes (`TreeConfig.lookup`) are not part of it.

`choose` then ranks configs by estimated tokens/s = (E[accepted] + 1) / (draft_s + verify_s(N)
+ overhead_s), all from this run's measurements.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from eagle2.attention import causal_mask
from eagle2.config import SamplingParams, TreeConfig
from eagle2.drafter import Drafter
from eagle2.runner import LocalRunner

VERIFY_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
TOTAL_TOKENS = (4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)
TOP_KS = (1, 2, 4, 6, 8)
DEPTHS = (1, 2, 3, 4, 5, 6)
CALIBRATION = (  # chat and code, like the two bench suites; never benchmark prompts
    "Explain how a hash table works and when you would use one instead of a list.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, "
    "with a docstring.",
)


@dataclass(frozen=True)
class Candidate:
    """One tree budget with its measured costs and estimated speed."""

    depth: int
    top_k: int
    total_tokens: int
    accepted: float  # E[accepted draft tokens] per verification step (replay)
    draft_s: float
    verify_s: float
    overhead_s: float

    @property
    def step_s(self) -> float:
        return self.draft_s + self.verify_s + self.overhead_s

    @property
    def tokens_per_s(self) -> float:
        return (self.accepted + 1) / self.step_s


@dataclass
class CostTable:
    """Everything measured; `choose` needs nothing else."""

    verify_s: dict[int, float]  # N -> seconds of one target forward over N tree tokens
    draft_s: dict[tuple[int, int], float]  # (depth, top_k) -> seconds of one drafter call
    accepted: dict[tuple[int, int, int], float]  # (depth, top_k, N) -> E[accepted]
    overhead_s: float = 0.0  # per-step engine work besides draft and verify
    num_positions: int = 0  # replayed positions behind `accepted`
    draft_fit: dict[int, tuple[float, float]] | None = None  # top_k -> (root_s, level_s)


def num_candidates(depth: int, top_k: int) -> int:
    """Candidates of a dynamic tree: k at depth 1, then k * k per expansion."""
    return top_k + depth * top_k * top_k


def interpolate(points: dict[int, float], n: int) -> float:
    """Piecewise-linear cost at n from measured sizes (linear extrapolation past the ends)."""
    xs = sorted(points)
    if n in points:
        return points[n]
    lo = max([x for x in xs if x < n], default=xs[0])
    hi = min([x for x in xs if x > n], default=xs[-1])
    if lo == hi:  # outside the measured range: extend the nearest segment
        lo, hi = (xs[0], xs[1]) if n < xs[0] else (xs[-2], xs[-1])
    slope = (points[hi] - points[lo]) / (hi - lo)
    return points[lo] + slope * (n - lo)


def choose(table: CostTable) -> list[Candidate]:
    """All replayed configs ranked by estimated tokens/s (ties: smaller tree, shallower)."""
    ranked = []
    for (depth, top_k, n), accepted in table.accepted.items():
        if (depth, top_k) not in table.draft_s or n - 1 > num_candidates(depth, top_k):
            continue  # no draft timing, or a bigger budget than the tree can fill
        ranked.append(Candidate(depth, top_k, n, accepted, table.draft_s[(depth, top_k)],
                                interpolate(table.verify_s, n), table.overhead_s))
    if not ranked:
        raise ValueError("the cost table has no complete (depth, top_k, total_tokens) entry")
    return sorted(ranked, key=lambda c: (-c.tokens_per_s, c.total_tokens, c.depth, c.top_k))


@dataclass
class TuneResult:
    table: CostTable
    ranked: list[Candidate]  # best first
    seconds: float  # the tuner's own wall time

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    @property
    def vanilla_tokens_per_s(self) -> float:
        return 1.0 / (self.table.verify_s[1] + self.table.overhead_s)

    @property
    def speculation_pays(self) -> bool:
        return self.best.tokens_per_s > self.vanilla_tokens_per_s

    def tree(self) -> TreeConfig:
        b = self.best
        return TreeConfig("eagle2", total_tokens=b.total_tokens, depth=b.depth, top_k=b.top_k,
                          budget="fixed")

    def chain(self) -> TreeConfig:
        """The best chain (top_k 1, every candidate verified) for the chain mode."""
        chains = [c for c in self.ranked if c.top_k == 1 and c.total_tokens >= c.depth + 2]
        depth = chains[0].depth if chains else self.best.depth
        return TreeConfig("chain", total_tokens=depth + 2, depth=depth, top_k=1, budget="fixed")

    def to_json(self, top: int = 15) -> dict:
        t = self.table
        return {
            "seconds": round(self.seconds, 2),
            "verify_ms": {str(n): round(1e3 * s, 2) for n, s in sorted(t.verify_s.items())},
            "draft_fit_ms": {str(k): {"root": round(1e3 * a, 2), "level": round(1e3 * b, 2)}
                             for k, (a, b) in sorted((t.draft_fit or {}).items())},
            "overhead_ms": round(1e3 * t.overhead_s, 2),
            "replayed_positions": t.num_positions,
            "accepted": {f"depth={d},top_k={k},N={n}": round(a, 3)
                         for (d, k, n), a in sorted(t.accepted.items())},
            "vanilla_tokens_per_s_est": round(self.vanilla_tokens_per_s, 3),
            "speculation_pays": self.speculation_pays,
            "choice": asdict(self.tree()),
            "ranked": [{**asdict(c), "tokens_per_s": round(c.tokens_per_s, 3)}
                       for c in self.ranked[:top]],
        }

    def format(self, top: int = 8) -> str:
        from .report import tuner_table

        return tuner_table(self, top)


# ----- replay (pure) ----------------------------------------------------------------------------
def replay_accepted(cands: list[tuple[list[int], list[float], list[int], int]],
                    truth: list[int], depths: tuple[int, ...],
                    sizes: tuple[int, ...]) -> dict[tuple[int, int], int]:
    """Accepted draft tokens for each (depth, N) from one deepest candidate set.

    cands: per level (tokens, scores, parents, level) in depth order, parents indexing the
    flat candidate list (-1 = the root), levels from 1; truth: the target's next tokens.
    The tree of depth d keeps the best N - 1 of the candidates at levels <= d + 1 (stable
    descending sort, as `build_tree`); accepted = on-truth-path candidates kept.
    E.g. level 1 tokens [5, 7] scores [-.1, -.9], truth [7, ...]: N = 2 keeps only 5 -> 0,
    N = 3 keeps both -> 1.
    """
    tokens = [t for c in cands for t in c[0]]
    scores = torch.tensor([s for c in cands for s in c[1]])
    parents = [p for c in cands for p in c[2]]
    levels = [c[3] for c in cands for _ in c[0]]
    on_path = []  # candidate indices on the truth path, by level
    for i, (tok, par, lvl) in enumerate(zip(tokens, parents, levels, strict=True)):
        if lvl <= len(truth) and tok == truth[lvl - 1] and (
                par < 0 if lvl == 1 else bool(on_path) and on_path[-1] == par):
            on_path.append(i)
    out = {}
    for depth in depths:
        limit = sum(1 for lvl in levels if lvl <= depth + 1)
        s = scores[:limit]
        ranks = [int((s > s[i]).sum() + (s[:i] == s[i]).sum()) for i in on_path if i < limit]
        for n in sizes:
            out[(depth, n)] = sum(1 for r in ranks if r < n - 1)
    return out


# ----- measuring --------------------------------------------------------------------------------
def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.inference_mode()
def measure_verify(runner: LocalRunner, prefix: list[int], sizes: tuple[int, ...],
                   repeats: int) -> dict[int, float]:
    """Median seconds of one target forward + logits + argmax over N tokens after prefix."""
    dev = runner.device
    num_p = len(prefix)
    slot = torch.zeros(1, dtype=torch.long, device=dev)
    ids = torch.tensor([prefix], device=dev)
    runner.set_lengths(slot, torch.zeros(1, dtype=torch.long, device=dev))
    runner.forward(ids, torch.arange(num_p, device=dev)[None], causal_mask(
        torch.tensor([num_p], device=dev), num_p), slot,
        logit_index=torch.tensor([num_p - 1], device=dev))
    runner.set_lengths(slot, torch.tensor([num_p], device=dev))

    def verify(n: int) -> None:
        toks = ids[:, torch.arange(n, device=dev) % num_p]
        pos = num_p + torch.arange(n, device=dev)[None]
        mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None]
        runner.forward(toks, pos, mask, slot)[1].argmax(-1).cpu()  # .cpu(): wait for a GPU

    verify(max(sizes))  # warm-up
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):  # interleave sizes so load changes hit all of them alike
        for n in sizes:
            times[n].append(_seconds(lambda n=n: verify(n)))
    return {n: statistics.median(ts) for n, ts in times.items()}


def measure_draft(drafter: Drafter, feats: torch.Tensor, ids: list[int], depths, top_ks,
                  repeats: int) -> tuple[dict, dict]:
    """Seconds per drafter call for each (depth, top_k) as root + depth x level per top_k.

    A level costs the same at every depth (the frontier is top_k nodes), so the line is fitted
    through the medians at the shallowest and the deepest depth. feats: [S, H] target features
    of ids; the head is primed on all but the last 2 pairs, and every timed call re-drafts
    from there with those 2 new pairs (a typical step).
    """
    sid = "tune-draft"
    base = len(ids) - 3
    drafter.draft([sid], feats[None, :base], torch.tensor([ids[1:base + 1]]),
                  torch.tensor([base]), TreeConfig(depth=1, top_k=1, budget="fixed", catch_up=0))
    new_f, new_t = feats[None, base:base + 2], torch.tensor([ids[base + 1:base + 3]])

    def call(depth: int, k: int) -> None:
        drafter.rewind(sid, base)
        drafter.draft([sid], new_f, new_t, torch.tensor([2]),
                      TreeConfig(total_tokens=24, depth=depth, top_k=k, budget="fixed",
                                 catch_up=0))

    lo, hi = min(depths), max(depths)
    call(hi, max(top_ks))  # warm-up
    times: dict[tuple[int, int], list[float]] = {(d, k): [] for d in {lo, hi} for k in top_ks}
    for _ in range(repeats):  # interleaved, like the verify sizes
        for d, k in times:
            times[(d, k)].append(_seconds(lambda d=d, k=k: call(d, k)))
    drafter.release(sid)
    fit = {}
    for k in top_ks:
        t_lo, t_hi = (statistics.median(times[(d, k)]) for d in (lo, hi))
        level = max((t_hi - t_lo) / (hi - lo), 0.0) if hi > lo else t_hi / hi
        fit[k] = (max(t_lo - lo * level, 0.0), level)
    return {(d, k): fit[k][0] + d * fit[k][1] for d in depths for k in top_ks}, fit


def replay_positions(sequences, reach: int, num_positions: int) -> list[list[int]]:
    """Evenly spread positions with `reach` known next tokens: per sequence, ascending."""
    spots = [(j, pos) for j, (ids, _, start) in enumerate(sequences)
             for pos in range(start, len(ids) - reach)]
    if len(spots) > num_positions:
        step = len(spots) / num_positions
        spots = [spots[int(i * step)] for i in range(num_positions)]
    return [[pos for j2, pos in spots if j2 == j] for j in range(len(sequences))]


def replay_sequence(drafter: Drafter, seq_id: str, ids: list[int],
                    feats: torch.Tensor, positions: list[int], depths, top_ks, sizes):
    """Yield {(depth, top_k, N): accepted} at each position (ascending) of one sequence.

    ids = prompt + the target's greedy continuation, feats [S, H] its target features. At
    position L the head holds pairs (feats[i], ids[i + 1]) for i < L, the root is ids[L] and
    the truth path is ids[L + 1:].
    """
    reach = max(depths) + 1
    done = 0
    for pos in positions:
        out = {}
        for k in top_ks:
            if seq_id in drafter.slot_of:
                drafter.rewind(seq_id, done)
            drafter.draft([seq_id], feats[None, done:pos], torch.tensor([ids[done + 1:pos + 1]]),
                          torch.tensor([pos - done]),
                          TreeConfig(total_tokens=2, depth=max(depths), top_k=k, budget="fixed",
                                     catch_up=0))
            cands = [(t[0].tolist(), s[0].tolist(), p[0].tolist(), lvl)
                     for t, s, p, lvl in drafter.last_candidates]
            for (d, n), acc in replay_accepted(cands, ids[pos + 1:pos + 1 + reach], depths,
                                               sizes).items():
                out[(d, k, n)] = acc
        done = pos
        yield out
    drafter.release(seq_id)


def measure_acceptance(drafter: Drafter, sequences, depths, top_ks, sizes,
                       num_positions: int) -> tuple[dict, int]:
    """Mean accepted length per (depth, top_k, N) over evenly spread replayed positions.

    sequences: (ids, feats [S, H], start) with start = the prompt length.
    """
    sums: dict[tuple[int, int, int], int] = {}
    count = 0
    spread = replay_positions(sequences, max(depths) + 1, num_positions)
    for j, positions in enumerate(spread):
        ids, feats, _ = sequences[j]
        for out in replay_sequence(drafter, f"tune-replay-{j}", ids, feats, positions, depths,
                                   top_ks, sizes):
            for key, acc in out.items():
                sums[key] = sums.get(key, 0) + acc
            count += 1
    return {key: s / max(count, 1) for key, s in sums.items()}, count


def tune(llm, calibration: list[list[int]] | None = None, gen_tokens: int = 48,
         prefix_tokens: int = 200, repeats: int = 3, budget_s: float = 75.0,
         max_positions: int = 48, min_positions: int = 8, depths: tuple[int, ...] = DEPTHS,
         top_ks: tuple[int, ...] = TOP_KS, sizes: tuple[int, ...] = TOTAL_TOKENS) -> TuneResult:
    """Measure this hardware and this head, then rank tree budgets (see the module doc).

    llm: an `eagle2.api.Eagle2`; calibration: prompt token ids (default: `CALIBRATION`
    through the chat template). The replay, the costly part, gets what is left of budget_s
    after the timings (min_positions..max_positions positions, from the measured draft cost).
    """
    t0 = time.perf_counter()
    prompts = calibration or [llm.encode(p) for p in CALIBRATION]
    stats0 = _stats(llm)
    reqs = [llm.request(p, SamplingParams(max_tokens=gen_tokens), TreeConfig("vanilla"))
            for p in prompts]
    outs = llm.generate_ids(reqs)
    stats1 = _stats(llm)
    steps = max(stats1["steps"] - stats0["steps"], 1)
    overhead = (stats1["other_s"] + stats1["draft_s"] - stats0["other_s"] - stats0["draft_s"])
    seqs = [list(p) + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    longest = max(max(len(s) for s in seqs), prefix_tokens)
    runner = LocalRunner(llm.target, 1, longest + max(VERIFY_SIZES) + 8)
    prefix = (seqs[0] * (prefix_tokens // len(seqs[0]) + 1))[:prefix_tokens]
    verify_s = measure_verify(runner, prefix, VERIFY_SIZES, repeats)
    feats = [_features(runner, s) for s in seqs]
    drafter = Drafter(llm.head, llm.target.embed, llm.target.lm_head, max_slots=1,
                      max_len=longest + 8, keep_candidates=True)
    draft_s, fit = measure_draft(drafter, feats[0], seqs[0], depths, top_ks, repeats)
    per_position = sum(draft_s[(max(depths), k)] for k in top_ks)
    left = budget_s - (time.perf_counter() - t0)
    num_positions = max(min_positions, min(max_positions, int(left / per_position)))
    sizes = tuple(sorted(set(sizes) | {d + 2 for d in depths}))  # + every full chain
    accepted, count = measure_acceptance(
        drafter, [(s, f, len(p)) for s, f, p in zip(seqs, feats, prompts, strict=True)],
        depths, top_ks, sizes, num_positions)
    table = CostTable(verify_s, draft_s, accepted, max(overhead / steps, 0.0), count, fit)
    return TuneResult(table, choose(table), time.perf_counter() - t0)


def autotune(llm, fallback_vanilla: bool = False, **kwargs) -> TreeConfig:
    """The best measured tree for this target, head and hardware (for the service).

    fallback_vanilla: return TreeConfig(mode="vanilla") when no tree is estimated to beat
    plain decoding.
    """
    result = tune(llm, **kwargs)
    if fallback_vanilla and not result.speculation_pays:
        return TreeConfig("vanilla")
    return result.tree()


def _stats(llm) -> dict[str, float]:
    s = llm.engine.stats
    return {"steps": s.steps, "other_s": s.other_s, "draft_s": s.draft_s}


@torch.inference_mode()
def _features(runner: LocalRunner, ids: list[int]) -> torch.Tensor:
    """[S, H] target features of a whole sequence (one causal forward, nothing committed)."""
    dev = runner.device
    n = len(ids)
    slot = torch.zeros(1, dtype=torch.long, device=dev)
    runner.set_lengths(slot, torch.zeros(1, dtype=torch.long, device=dev))
    feats, _ = runner.forward(torch.tensor([ids], device=dev), torch.arange(n, device=dev)[None],
                              causal_mask(torch.tensor([n], device=dev), n), slot,
                              logit_index=torch.tensor([n - 1], device=dev))
    return feats[0]
