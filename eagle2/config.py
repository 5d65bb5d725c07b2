"""Configuration of the speculative decoder: the draft-tree budget and the sampling parameters.

Dimension letters used across the package:
    B batch (requests), N tree nodes (root included), D tree depth, K top-k,
    V vocabulary, H hidden size, S cache length, A accepted length, P retrieve paths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("eagle2", "static", "chain", "vanilla")
BUDGETS = ("auto", "fixed")
MAX_LOOKUP = 32
# the deepest drafted node (depth + 1) stays within the exact attention's window
# (eagle2.cpu.attention.WINDOW_DEPTH)
MAX_DEPTH = 31
# The most likely tokens a request may ask log-probabilities of, a position (OpenAI: 20).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TreeConfig:
    """Draft-tree budget (docs/draft-tree.md "Draft tree").

    mode: "eagle2" (dynamic tree: expand by path value, rerank globally), "static" (the
    EAGLE-1 default tree, cut to total_tokens), "chain" (top_k = 1) or "vanilla" (no drafting).
    total_tokens: tree size N verified by the target in one forward, root included.
    depth: number of expansion steps after the root step (draft levels = depth + 1).
    top_k: children proposed per expanded node and nodes expanded per level.
    budget: "auto" (the default): the three sizes above are maxima; each step the engine
    keeps the nodes whose calibrated value pays for their verification cost on this machine
    at the current batch, and stops drafting while speculation does not pay
    (`eagle2.budget`). "fixed": exactly these sizes every step (for ablations).
    draft_window: the head attends to at most this many past positions (sliding window), so
    that prompts longer than the head's training context keep drafting instead of failing.
    lookup: mode "eagle2" only: the longest chain that prompt lookup (a suffix match against
    the prompt and the output so far, `eagle2.lookup`) adds to the candidates of the global
    rerank; 0 turns it off. Its nodes compete for the same total_tokens.
    catch_up: the head runs over at most this many of the positions that reach it in one
    draft call; when more arrive at once (a long prompt, or the backlog of plain steps
    before a probe at a batch where speculation did not pay), it restarts from the last
    `catch_up` of them, as a sliding window would (prompt lookup still sees every token).
    This bounds what one draft call spends catching up (at batch 8 on a 2-core CPU a row
    costs ~0.16 ms against ~60 ms a plain step). Smaller caps cost acceptance: a fixed
    26-token tree lost 0.4% / 1.9% of its tau at 64 (MT-bench / HumanEval prompts, 50-170
    tokens). 0: no limit.
    """

    mode: str = "eagle2"
    total_tokens: int = 32
    depth: int = 6
    top_k: int = 8
    draft_window: int = 2048
    budget: str = "auto"
    lookup: int = 16
    catch_up: int = 256

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown speculation mode {self.mode!r}; use one of {MODES}")
        if self.total_tokens < 2:
            raise ValueError(
                f"total_tokens must be >= 2 (root + at least one draft), got {self.total_tokens}"
            )
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 1 <= self.depth <= MAX_DEPTH:
            raise ValueError(f"depth must be in [1, {MAX_DEPTH}], got {self.depth}")
        if self.budget not in BUDGETS:
            raise ValueError(f"unknown tree budget {self.budget!r}; use one of {BUDGETS}")
        if self.draft_window < 16:
            raise ValueError(f"draft_window must be >= 16, got {self.draft_window}")
        if not 0 <= self.lookup <= MAX_LOOKUP:
            raise ValueError(f"lookup must be in [0, {MAX_LOOKUP}] (0: off), got {self.lookup}")
        if self.catch_up < 0 or 0 < self.catch_up < 16:
            raise ValueError(f"catch_up must be 0 (no limit) or >= 16, got {self.catch_up}")

    @property
    def num_nodes(self) -> int:
        """Tree size N actually verified (root included)."""
        if self.mode == "vanilla":
            return 1
        if self.mode == "chain":
            return min(self.total_tokens, self.depth + 2)
        return self.total_tokens


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the target's distribution.

    temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters. The seed makes
    sampling reproducible per request (None: drawn from the OS).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # None: no log-probabilities; k: each output token's log-probability under the target's
    # own distribution (its log-softmax, before temperature, top-k and top-p) and the k most
    # likely tokens' (`eagle2.verify.TokenLogprobs`; k <= MAX_LOGPROBS)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (the most likely tokens "
                             f"reported a position), got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
