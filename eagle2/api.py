"""The Python generation API: text or chat messages in, completions out.

    from eagle2 import Eagle2, SamplingParams
    llm = Eagle2.load()                       # embedded SmolLM2 + its shipped head
    out = llm.generate(["Hello!"], SamplingParams(max_tokens=64))[0]
    print(out.text, out.tau, out.tokens_per_s)
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from eagle2.budget import CostModel, cost_cache_path
from eagle2.config import SamplingParams, TreeConfig
from eagle2.cuda_graphs import make_runner
from eagle2.drafter import Drafter
from eagle2.eagle3 import Eagle3Head
from eagle2.engine import Engine, Event, Request
from eagle2.head import DraftHead, load_head, new_head
from eagle2.target import EMBEDDED_NAME, TargetModel
from eagle2.text import TextStream, encode_prompt
from eagle2.verify import TokenLogprobs

log = logging.getLogger(__name__)

HEADS_DIR = Path(__file__).parent / "heads"
_ids = itertools.count()


def shipped_head_dir(target_name: str) -> Path | None:
    path = HEADS_DIR / target_name
    return path if (path / "config.json").exists() else None


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length"
    prompt_tokens: int
    num_steps: int  # target forwards (prefill + verification steps)
    tau: float  # new tokens / num_steps
    wall_s: float  # from admission to the last token (prefill included)
    tokens_per_s: float
    accepted_at_depth: dict[int, int] = field(default_factory=dict)
    # token_ids' TokenLogprobs where SamplingParams.logprobs asked, else None
    logprobs: list[TokenLogprobs] | None = None


class Eagle2:
    """A target, a draft head and an engine, with the tokenizer around them."""

    def __init__(self, target: TargetModel, head: DraftHead | Eagle3Head | None,
                 tree: TreeConfig = TreeConfig(), max_batch: int = 8,
                 max_context: int | None = None, costs: CostModel | Path | None = None):
        """costs: the forward costs the tree budget decides with (`Engine`); default: this
        machine's cache for the target (measured at the first auto-budget step if absent)."""
        self.target, self.head, self.tree = target, head, tree
        self.tokenizer = target.tokenizer
        self.max_context = min(max_context or 2048, target.max_position)
        drafter = None
        if head is not None:
            target.set_feature_layers(head.feature_layers(target.num_layers))
            drafter = Drafter(head, target.embed, target.lm_head, max_slots=max_batch,
                              max_len=self.max_context)
        # CUDA graphs per bucket on CUDA ($EAGLE2_CUDA_GRAPHS: `eagle2.cuda_graphs.make_runner`)
        runner = make_runner(target, max_batch, self.max_context + Engine.tree_margin)
        self.engine = Engine(runner, drafter, max_batch=max_batch, max_context=self.max_context,
                             costs=costs or cost_cache_path(target))

    @classmethod
    def load(cls, target: str | None = None, draft: str | None = None,
             tree: TreeConfig = TreeConfig(), dtype: str | None = None, device: str | None = None,
             max_batch: int = 8, max_context: int | None = None,
             costs: CostModel | Path | None = None, threads: int | str | None = "auto"
             ) -> Eagle2:
        """target: None = embedded SmolLM2. draft: a head directory, "untrained", or None for
        the head shipped for this target (an untrained one if there is none).
        threads (CPU only): a count to set; "auto" (the default): EAGLE2_THREADS or
        OMP_NUM_THREADS if set, else the count that decodes fastest on this quiet machine
        (`eagle2.threads`: cached, or measured once at this load, ~1 s a count), and fewer
        while other processes keep the cores busy (`eagle2.threads.LoadFollower`); None:
        leave torch's setting alone."""
        from eagle2 import threads as thr

        tgt = TargetModel.load(target, dtype=dtype, device=device)
        auto = False  # a count chosen here (not the user's): measured if not cached, followed
        if threads == "auto" and tgt.device.type == "cpu":
            chosen = thr.requested()
            auto = chosen is None
            threads = chosen or thr.cached(tgt)  # None: measured once the engine exists
        elif threads == "auto":
            threads = None
        if isinstance(threads, int):
            if threads < 1:
                raise ValueError(f"threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)
        llm = cls(tgt, resolve_head(tgt, draft), tree, max_batch, max_context, costs)
        if auto:
            thr.settle(llm.engine, tgt, threads, follow=auto,
                       cost_path_of=(lambda: cost_cache_path(tgt)) if costs is None else None)
        return llm

    # ----- prompts ----------------------------------------------------------------------------
    def encode(self, prompt: str | list[dict], chat: bool = True) -> list[int]:
        """Token ids of a prompt (see `encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def eos_ids(self) -> frozenset[int]:
        ids = {self.tokenizer.eos_token_id} if self.tokenizer is not None else set()
        eos = self.target.config.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos])
        return frozenset(i for i in ids if i is not None)

    def request(self, prompt_ids: list[int], params: SamplingParams,
                tree: TreeConfig | None = None, seq_id: str | None = None) -> Request:
        return Request(seq_id or f"req-{next(_ids)}", tuple(prompt_ids), params,
                       tree or self.tree, self.eos_ids())

    # ----- generation -------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[dict]] | str, params: SamplingParams | None = None,
                 mode: str | None = None, chat: bool = True) -> list[Completion]:
        """Generate for all prompts together (continuous batching up to max_batch)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or SamplingParams()
        tree = replace(self.tree, mode=mode) if mode else self.tree
        reqs = [self.request(self.encode(p, chat), params, tree) for p in prompts]
        return self.generate_ids(reqs)

    def generate_ids(self, reqs: list[Request]) -> list[Completion]:
        for r in reqs:
            self.engine.add(r)
        state = {r.seq_id: _Progress(r, time.perf_counter(), TextStream(self.tokenizer,
                                                                        r.params.stop))
                 for r in reqs}
        done: dict[str, Completion] = {}
        while len(done) < len(reqs):
            for ev in self.engine.step():
                prog = state[ev.seq_id]
                if self._absorb(prog, ev):
                    done[ev.seq_id] = prog.completion()
        return [done[r.seq_id] for r in reqs]

    def _absorb(self, prog: _Progress, ev: Event) -> bool:
        """Add an event's tokens; apply stop strings. True when the request is finished."""
        prog.text.add(ev.token_ids, final=ev.finished)
        if ev.logprobs is not None:
            prog.logprobs.extend(ev.logprobs)
        prog.num_steps, prog.accepted = ev.num_steps, ev.accepted_at_depth
        prog.reason = ev.finish_reason
        if prog.text.stopped and not ev.finished:
            self.engine.cancel(ev.seq_id)
            prog.reason = "stop"
            return True
        return ev.finished


@dataclass
class _Progress:
    req: Request
    start: float
    text: TextStream
    num_steps: int = 0
    accepted: dict[int, int] = field(default_factory=dict)
    reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    def completion(self) -> Completion:
        wall = time.perf_counter() - self.start
        ids = self.text.token_ids
        n = len(ids)
        return Completion(self.text.text, list(ids), self.reason or "length",
                          len(self.req.prompt_ids), self.num_steps,
                          n / max(self.num_steps, 1), wall, n / wall if wall > 0 else 0.0,
                          self.accepted, self.logprobs[:n]  # a stop string cuts the ids
                          if self.req.params.logprobs is not None else None)


def resolve_head(target: TargetModel, draft: str | None) -> DraftHead | Eagle3Head:
    """The head for a target: an explicit directory, "untrained", or the shipped one."""
    if draft == "untrained":
        return new_head(target.config, dtype=target.dtype).to(target.device)
    path = Path(draft) if draft else shipped_head_dir(
        EMBEDDED_NAME if target.name == EMBEDDED_NAME else Path(target.name).name)
    if path is None:
        log.warning("no trained draft head for %s: using an untrained one (lossless, slow)",
                    target.name)
        return new_head(target.config, dtype=target.dtype).to(target.device)
    head = load_head(path, dtype=target.dtype, device=target.device)
    width = getattr(head, "target_hidden_size", head.config.hidden_size)
    if width != target.config.hidden_size:
        raise ValueError(f"draft head {str(path)!r} expects target features of width {width}, "
                         f"the target's hidden size is {target.config.hidden_size}")
    return head


__all__ = ["Completion", "Eagle2", "resolve_head"]
