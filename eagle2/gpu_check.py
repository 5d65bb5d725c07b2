"""`make gpu-check`: what a short GPU lease must show, written to one JSON file phase by phase.

    PYTHONPATH=. python3 -m eagle2.gpu_check --out DIR                # CUDA, bf16, < 8 min, H100
    PYTHONPATH=. python3 -m eagle2.gpu_check --out DIR --device cpu   # tiny shapes, fp32, CPU
    ... --phases lossless,divergence    # only these (after setup); --fail-phase NAME: a test hook

Imports only eagle2, torch, transformers and safetensors (no Ray, DeepSpeed, gguf, network).
Weights are random: a Llama with Llama-3-8B shapes and a random EAGLE head in bf16, plus a few
layers with Llama-3-70B shapes; `--device cpu` (the default without CUDA) runs every phase with
tiny shapes in fp32, so the whole check runs on any machine. The phases, in order (`PHASES`):

- setup: builds the random target (lm_head scaled x20 so that logits spread out and bf16 noise
  rarely flips an argmax) and the EAGLE head; backend: `target.backend.info` (the attention
  kernels in use), torch's SDPA switches, and the masked tree attention of the torch backend's
  layers at a verification shape with the query heads packed and with `enable_gqa` (ms and the
  kernels each runs: on CUDA a masked GQA call is expected to take the math kernel);
- warmup: the process's first engine runs (eager and through CUDA graphs), each twice: what
  torch.compile and the captures cost, kept out of the later phases' budgets;
- lossless: greedy eagle2 / static / chain / cost-aware eagle2 equal vanilla in the same engine
  (a mismatch is reported with its position and vanilla's top-2 logit gap there), and the
  sampling path runs;
- divergence: greedy eagle2 against vanilla over more prompts on the scaled model and on the
  unscaled one (the HF init as it is, logits close together): the fraction of prompts whose
  outputs differ, each first differing position, and the top-2 logit gaps that explain them.
  Reported, not judged: on a GPU, tree and single-token forwards round differently in bf16;
- sampling_speed: one verification step, sampled (T = 1) against greedy: the verification alone
  over random logits at Llama-3's 128,256-token vocabulary, and the runner's whole step;
- context_4k: a ~4096-token prompt's prefill, then eagle2 and vanilla decoding after it;
- prefill_memory: torch.cuda.max_memory_allocated over long prefills (null on a CPU);
- eagle2_vs_vanilla (ms per engine step, eager and, on CUDA, through the serving engine's CUDA
  graphs); paged_attention: the eager steps' FlexAttention and the graphed steps' attention
  over each layer's used entries gathered (the defaults) against over the paged blocks in
  place (prefill ms, ms per step, same tokens);
  arrivals: a long prompt and short ones arriving while 4 streams decode, read inside
  the verification forward against in forwards of their own (ms of steps with and without
  prompt tokens: what reading them costs the streams); forward_cost (ms per forward for N
  tokens x batch, eager and CUDA graphs, host against device time), lossless_eagle3_head,
  eagle3_vs_vanilla, forward_cost_70b_4_layers;
- tp2: a tensor-parallel (tp = 2) forward over NCCL when two GPUs are present (gloo with two
  CPU processes in CPU mode), against the whole model's logits, and its forward time;
- imports: no forbidden module (Ray, gRPC, DeepSpeed, gguf) was imported.

Reading DIR/gpu-check.json (rewritten atomically after every phase, so it holds what ran even if
a later phase or the process dies): top level, the run (device, device_name, dtype, torch,
tiny, budget_s), `passed` (null until the end; then true when no phase failed, every lossless
check held and nothing forbidden was imported), `finished` and `wall_s`; `phases` maps every
phase name, in order, to {"status": "pending" | "ok" | "failed" | "skipped", "budget_s",
"wall_s", and "result" (ok), "error" {"type", "message", "traceback" (last lines)} (failed) or
"reason" (skipped)}; "truncated": true where the phase skipped repetitions to stay in its time
budget (its result lists them under "skipped_for_budget"). The exit status is 1 when a phase
failed or a check did not hold. Each phase has a budget in seconds: loops stop repeating past
it, a phase running far past it is stopped (an error), and phases are skipped once the whole
run's budget (--budget-s, 420 s) is spent.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORBIDDEN = ("ray", "grpc", "deepspeed", "gguf")
SHAPES = {  # config.json values (meta-llama/Meta-Llama-3-8B and -70B)
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "llama-3-70b-layers": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=4,
                               num_attention_heads=64, num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
    "tiny-wide": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, vocab_size=256),
}
LLAMA3_VOCAB = 128256
LOGIT_SCALE = 20.0
TOTAL_BUDGET_S = 420.0  # the phases' share of the 8 minutes (the rest: start-up, slack)


# ----- the random models and the engine ---------------------------------------------------------
def random_target(shape: str, dtype: torch.dtype, device: str, seed: int = 0,
                  lm_scale: float = LOGIT_SCALE):
    """A random Llama (TargetModel) of the named shape; lm_head scaled by lm_scale (the default
    spreads the logits out; 1.0: the HF init as it is). Same seed: same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle2.target import TargetModel

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype (no fp32 copy on the GPU)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    if lm_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_scale)
    return TargetModel(model, None, f"random-{shape}" + ("" if lm_scale != 1.0 else "-unscaled"))


def random_eagle3_head(target, dtype: torch.dtype, device: str, draft_vocab: int = 32000):
    """A random EAGLE-3 head (the published architecture) over every k-th target token."""
    from eagle2.eagle3 import new_eagle3_head

    layers = target.num_layers
    aux = None if layers >= 6 else (0, layers // 2 - 1, layers - 2)  # tiny: valid layer ids
    vocab = target.vocab_size
    d2t = torch.arange(0, vocab, max(1, vocab // draft_vocab))[:draft_vocab]
    return new_eagle3_head(target.config, d2t, seed=0, dtype=dtype,
                           aux_layer_ids=aux).to(device)


def make_engine(target, head, max_batch: int, max_context: int,
                cuda_graphs: bool | str = False, graph_attention: str | None = None):
    """cuda_graphs: the target's steps and the head's tree levels through CUDA graphs per
    bucket (`eagle2.cuda_graphs`; "on" off CUDA: the same padded steps, eagerly), else
    eager; graph_attention: the padded steps' (`GraphedRunner.attention`). The target's cache
    is paged as the service's (blocks for max_batch whole contexts: no preemption)."""
    from eagle2.cuda_graphs import make_runner
    from eagle2.drafter import Drafter
    from eagle2.engine import Engine
    from eagle2.runner import BLOCK_SIZE

    target.set_feature_layers(head.feature_layers(target.num_layers))  # EAGLE-3: 3 layers
    # (the head's levels pad only on CUDA: off it the head keeps the CPU backend's kernels)
    drafter = Drafter(head, target.embed, target.lm_head, max_slots=max_batch,
                      max_len=max_context,
                      cuda_graphs=cuda_graphs if target.device.type == "cuda" else False)
    max_len = max_context + Engine.tree_margin
    runner = make_runner(target, max_batch, max_len, cuda_graphs,
                         num_blocks=max_batch * -(-max_len // BLOCK_SIZE),
                         graph_attention=graph_attention)
    return Engine(runner, drafter, max_batch=max_batch, max_context=max_context)


def generate(engine, prompts: list[list[int]], params, tree) -> tuple[list[list[int]], dict]:
    """New tokens per prompt, and the run's prefill ms, ms per step and tokens per step."""
    from eagle2.engine import Request

    out = {f"s{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add(Request(f"s{i}", tuple(p), params, tree))
    steps, decode_s, prefill_s = 0, 0.0, 0.0
    while engine.has_work():
        prefill = bool(engine.waiting) and len(engine.seqs) < engine.max_batch
        t0 = time.perf_counter()
        events = engine.step()
        _sync(engine.runner.device)
        if prefill:
            prefill_s += time.perf_counter() - t0
        else:
            steps += 1
            decode_s += time.perf_counter() - t0
        for ev in events:
            out[ev.seq_id].extend(ev.token_ids)
    tokens = sum(len(v) for v in out.values()) - len(prompts)  # less the prefills' tokens
    return [out[f"s{i}"] for i in range(len(prompts))], {
        "steps": steps, "prefill_ms": round(1000 * prefill_s, 3),
        "ms_per_step": round(1000 * decode_s / max(steps, 1), 3),
        "tokens_per_step": round(tokens / max(steps, 1), 3)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_diffs(outputs: list[list[int]], ref: list[list[int]]) -> list[int | None]:
    """Per prompt, the first position where outputs and ref differ (None: equal)."""
    out = []
    for t, r in zip(outputs, ref, strict=True):
        pos = next((j for j, (a, b) in enumerate(zip(t, r, strict=False)) if a != b),
                   None)
        out.append(pos if pos is not None or len(t) == len(r) else min(len(t), len(r)))
    return out


def random_prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def fixed_tree(mode: str, sizes: dict):
    from eagle2.config import TreeConfig

    if mode == "vanilla":
        return TreeConfig("vanilla")
    return TreeConfig(mode, sizes["total_tokens"], sizes["depth"], sizes["top_k"], budget="fixed")


# ----- the measurements (functions of models, used by the phases) ------------------------------
def check_lossless(target, head, sizes: dict, num_tokens: int,
                   modes: tuple[str, ...] = ("eagle2", "static", "chain"),
                   sampling: bool = True, over: Callable[[], bool] = lambda: False) -> dict:
    """Greedy eagle2 / static / chain against vanilla, and one sampling run per mode. A mismatch
    is reported with vanilla's top-1 minus top-2 logit where it happened: near 0, a flip of a
    near-tie by the GPU's rounding (docs/architecture.md "On GPUs"); large, a defect."""
    from eagle2.config import SamplingParams, TreeConfig

    prompts = random_prompts(target.vocab_size, [7, 12, 5])
    greedy = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    trees = {"vanilla": fixed_tree("vanilla", sizes), **{m: fixed_tree(m, sizes) for m in modes}}
    trees["eagle2-auto"] = TreeConfig("eagle2", sizes["total_tokens"], sizes["depth"],
                                      sizes["top_k"])  # the cost-aware budget (default)
    out: dict = {"skipped_for_budget": []}
    ref = None
    for mode, tree in trees.items():
        if ref is not None and over():
            out["skipped_for_budget"].append(f"greedy_{mode}")
            continue
        tokens, _ = generate(make_engine(target, head, 4, 256), prompts, greedy, tree)
        ref = tokens if mode == "vanilla" else ref
        diffs = first_diffs(tokens, ref)
        mismatch = [(i, d) for i, d in enumerate(diffs) if d is not None]
        out[f"greedy_{mode}"] = {"equal_to_vanilla": not mismatch,
                                 "first_mismatch": mismatch[:3]}
        if mismatch:  # a near-tie (bf16 rounding) or a defect: the margin tells them apart
            out[f"greedy_{mode}"]["top2_gap_at_mismatch"] = [
                logit_gaps(target, [prompts[i] + ref[i][:d]])["top2_gap_min"]
                for i, d in mismatch[:3]]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=num_tokens,
                            ignore_eos=True, seed=3)
    for mode in ("eagle2", "vanilla") if sampling else ():
        if over():
            out["skipped_for_budget"].append(f"sampling_{mode}")
            continue
        tokens, _ = generate(make_engine(target, head, 4, 256), prompts, params, trees[mode])
        out[f"sampling_{mode}"] = {"ran": all(len(t) == num_tokens for t in tokens)}
    return out


def forward_cost(target, batches: list[int], tokens: list[int], reps: int,
                 graphs: bool, over: Callable[[], bool] = lambda: False) -> dict:
    """ms per forward (features + logits of the last token) for each (batch, N)."""
    from eagle2.cuda_graphs import GraphedForward

    cache = target.allocate_cache(max(batches), 256)
    cache.lengths[:] = 64  # a committed prefix of 64 positions (values do not matter)
    dev = target.device
    rows, skipped = [], []
    for num_b in batches:
        for num_n in tokens:
            if over():
                skipped.append([num_b, num_n])
                continue
            toks = torch.randint(0, target.vocab_size, (num_b, num_n), device=dev)
            pos = (64 + torch.arange(num_n, device=dev)).expand(num_b, num_n).contiguous()
            mask = torch.ones(num_n, num_n, dtype=torch.bool, device=dev).tril()
            mask = mask.expand(num_b, num_n, num_n).contiguous()
            row = {"batch": num_b, "tokens": num_n}
            eager = GraphedForward(target, cache, [])
            row["eager_ms"], row["host_ms"] = _time(eager, target, toks, pos, mask, reps)
            if graphs and dev.type == "cuda":
                graphed = GraphedForward(target, cache, [(num_b, num_n)])
                row["graph_ms"], _ = _time(graphed, target, toks, pos, mask, reps)
                del graphed
            rows.append(row)
    return {"rows": rows, "skipped_for_budget": skipped}


@torch.inference_mode()
def _time(forward, target, toks, pos, mask, reps: int) -> tuple[float, float]:
    """(device ms per call incl. logits of the last token, host ms to issue one call)."""
    dev = target.device
    for _ in range(2):
        target.logits(forward(toks, pos, mask)[:, -1])
    _sync(dev)
    t0 = time.perf_counter()
    target.logits(forward(toks, pos, mask)[:, -1])
    host = time.perf_counter() - t0  # on CUDA: launch time only (no sync)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        target.logits(forward(toks, pos, mask)[:, -1])
    _sync(dev)
    device_ms = 1000 * (time.perf_counter() - t0) / reps
    return round(device_ms, 3), round(1000 * host, 3)


def time_calls(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """ms per call of fn, after one warm-up call."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return round(1000 * (time.perf_counter() - t0) / reps, 3)


def engine_vs_vanilla(target, head, sizes: dict, num_tokens: int, batches: tuple[int, ...],
                      over: Callable[[], bool] = lambda: False) -> dict:
    """ms per engine step and tokens per step, eagle2 (fixed tree) and vanilla, per batch;
    on CUDA also with the serving engine's CUDA graphs (`eagle2.cuda_graphs`: rows with
    cuda_graphs true, and whether their tokens are the eager run's)."""
    from eagle2.config import SamplingParams

    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    rows, skipped = [], []
    graphs = (False, True) if target.device.type == "cuda" else (False,)
    for num_b in batches:
        prompts = [[(7 * i + j) % target.vocab_size for j in range(9)] for i in range(num_b)]
        for mode in ("vanilla", "eagle2"):
            eager_tokens = None
            for on in graphs:
                if over():
                    skipped.append({"batch": num_b, "mode": mode, "cuda_graphs": on})
                    continue
                engine = make_engine(target, head, num_b, 256, cuda_graphs=on)
                # untimed first: the graphs' captures (two warm-ups and a capture per bucket)
                # and compiled kernels' first shapes fall there, not in the timed run
                generate(engine, prompts, params, fixed_tree(mode, sizes))
                before = _captures(engine)
                tokens, stats = generate(engine, prompts, params, fixed_tree(mode, sizes))
                row = {"batch": num_b, "mode": mode, "cuda_graphs": on, **stats,
                       "captures_in_timed_run": _captures(engine) - before}
                if on:
                    row["same_tokens_as_eager"] = tokens == eager_tokens
                    row["graph_steps"] = engine.runner.counts["graph"]
                eager_tokens = tokens
                rows.append(row)
    return {"rows": rows, "skipped_for_budget": skipped}


# (variant, whether FlexAttention reads the paged blocks in place, the graphs' attention)
PAGED_VARIANTS = (("gather", False, "sdpa"), ("in_place", True, "sdpa"),
                  ("in_place_graph_flex", True, "flex"))


def paged_attention(target, head, sizes: dict, num_tokens: int, batches: tuple[int, ...],
                    over: Callable[[], bool] = lambda: False) -> dict:
    """How the engine's steps read the paged cache (`PAGED_VARIANTS`): FlexAttention's eager
    steps (the prompts' prefills here) over each layer's used entries gathered into rows (the
    default) or over the blocks in place (`FlexBackend(paged_in_place=True)`), and the CUDA
    graphs' padded steps by SDPA over gathered entries (the default) or by FlexAttention over
    the blocks in place (`GraphedRunner(attention="flex")`). Per batch and mode (greedy
    eagle2 on a fixed tree, vanilla): prefill ms, ms per step, steps by launch, each run
    after an untimed one (captures, compiles), and whether the tokens are the default's.
    Off CUDA the padded steps run eagerly, FlexAttention eager."""
    from eagle2.config import SamplingParams
    from eagle2.flex import FlexBackend

    cuda = target.device.type == "cuda"
    backend = target.backend
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    rows, skipped = [], []
    try:
        for num_b in batches:
            prompts = random_prompts(target.vocab_size, [9 + 3 * i for i in range(num_b)],
                                     seed=31)
            for mode in ("eagle2", "vanilla"):
                tokens = {}
                for name, in_place, graph_attention in PAGED_VARIANTS:
                    if over():
                        skipped.append({"batch": num_b, "mode": mode, "variant": name})
                        continue
                    target.backend = FlexBackend(compiled=None if cuda else False,
                                                 paged_in_place=in_place)
                    engine = make_engine(target, head, num_b, 256,
                                         cuda_graphs=True if cuda else "on",
                                         graph_attention=graph_attention)
                    generate(engine, prompts, params, fixed_tree(mode, sizes))  # untimed
                    counts = dict(engine.runner.counts)
                    tokens[name], stats = generate(engine, prompts, params,
                                                   fixed_tree(mode, sizes))
                    launches = {k: v - counts.get(k, 0) for k, v in engine.runner.counts.items()}
                    rows.append({"batch": num_b, "mode": mode, "variant": name, **stats,
                                 "steps_by_launch": launches,
                                 "same_tokens_as_gather": tokens[name] == tokens.get("gather")})
    finally:
        target.backend = backend
    return {"rows": rows, "skipped_for_budget": skipped}


def _captures(engine) -> int:
    """CUDA graphs the engine's target runner and drafter have captured so far."""
    graphs = [getattr(engine.runner, "graphs", None),
              getattr(getattr(engine.drafter, "levels", None), "graphs", None)]
    return sum(g.counts["captured"] for g in graphs if g is not None)


def arrivals(target, head, sizes: dict, budget: int, long_len: int, num_tokens: int,
             over: Callable[[], bool] = lambda: False) -> dict:
    """Prompts arriving while requests decode: 4 greedy eagle2 streams; after their second
    step a `long_len`-token prompt and three short ones arrive (the step's prompt budget
    `budget` tokens: docs/kv-cache.md "Chunked prefill beside decoding"). Read inside the
    running requests' verification forward (`mix_prompts`) against in forwards of their own,
    on the service's paged runner (CUDA graphs for the plain steps on CUDA): per variant the ms
    of steps that read no prompt tokens and of those that read some (median), the steps until
    the long prompt's first token, and whether the outputs are the other variant's (reported:
    on a GPU the two batch the same tokens differently). On CUDA a step with prompt tokens may
    fit no graph bucket and run eagerly while plain steps replay graphs: `step_ms_by_launch`
    gives the medians per kind of step and launch, to compare like with like."""
    from eagle2.config import SamplingParams
    from eagle2.engine import Request

    vocab, tree = target.vocab_size, fixed_tree("eagle2", sizes)
    streams = random_prompts(vocab, [9, 14, 6, 11], seed=21)
    late = random_prompts(vocab, [long_len, 20, 33, 12], seed=22)
    out: dict = {"budget": budget, "long_prompt": long_len, "skipped_for_budget": []}
    outputs = {}
    for mix in (True, False):
        name = "mixed" if mix else "own_forward"
        if over():
            out["skipped_for_budget"].append(name)
            continue
        engine = make_engine(target, head, 8, long_len + 2 * num_tokens + 64,
                             cuda_graphs=target.device.type == "cuda")
        engine.prefill_chunk, engine.mix_prompts = budget, mix
        got: dict[str, list[int]] = {}
        for i, p in enumerate(streams):
            engine.add(Request(f"s{i}", tuple(p), SamplingParams(max_tokens=num_tokens,
                                                                 ignore_eos=True), tree))
        plain, reading, steps, first = [], [], 0, None
        kinds: dict[str, list[float]] = {}  # (plain | prompt)_(graphed | eager) -> step ms
        counts = getattr(engine.runner, "counts", None)
        while engine.has_work():
            if steps == 2:  # the streams are decoding
                for j, p in enumerate(late):
                    engine.add(Request(f"late{j}", tuple(p),
                                       SamplingParams(max_tokens=8, ignore_eos=True), tree))
            running, before = bool(engine.seqs), engine.stats.prefill_tokens
            graphed = counts["graph"] if counts is not None else 0
            t0 = time.perf_counter()
            events = engine.step()
            _sync(target.device)
            if running:
                ms, prompt = 1000 * (time.perf_counter() - t0), engine.stats.prefill_tokens > before
                (reading if prompt else plain).append(ms)
                launch = "graphed" if counts is not None and counts["graph"] > graphed else "eager"
                kinds.setdefault(f"{'prompt' if prompt else 'plain'}_{launch}", []).append(ms)
            steps += 1
            for ev in events:
                got.setdefault(ev.seq_id, []).extend(ev.token_ids)
                if ev.seq_id == "late0" and first is None and ev.token_ids:
                    first = steps - 2  # steps since it arrived, that one included
        outputs[name] = got
        out[name] = {"steps_to_long_first_token": first, "mixed_steps": engine.stats.mixed_steps,
                     "plain_step_ms": _median(plain), "prompt_step_ms": _median(reading),
                     "prompt_steps": len(reading),
                     "step_ms_by_launch": {k: _median(v) for k, v in sorted(kinds.items())},
                     "steps_by_launch": {k: len(v) for k, v in sorted(kinds.items())}}
    if len(outputs) == 2:
        out["outputs_equal"] = outputs["mixed"] == outputs["own_forward"]
    return out


def _median(values: list[float]) -> float | None:
    return round(sorted(values)[len(values) // 2], 3) if values else None


def logit_gaps(target, prompts: list[list[int]]) -> dict:
    """The top-1 minus top-2 logit after each prompt (how far an argmax is from a flip) and the
    logits' spread, over the target's own forward."""
    from eagle2.runner import LocalRunner

    runner = LocalRunner(target, 1, max(map(len, prompts)) + 8)
    dev = target.device
    gaps, stds = [], []
    for p in prompts:
        n = len(p)
        mask = torch.ones(1, n, n, dtype=torch.bool, device=dev).tril()
        _, logits = runner.forward(torch.tensor([p], device=dev),
                                   torch.arange(n, device=dev)[None], mask,
                                   torch.tensor([0], device=dev), torch.tensor([n - 1], device=dev))
        top = logits[0].topk(2).values
        gaps.append(float(top[0] - top[1]))
        stds.append(float(logits[0].std()))
    gaps.sort()
    return {"top2_gap_min": round(gaps[0], 5), "top2_gap_median": round(gaps[len(gaps) // 2], 5),
            "logit_std_mean": round(sum(stds) / len(stds), 4)}


def divergence(target, head, sizes: dict, prompts: list[list[int]], num_tokens: int) -> dict:
    """Greedy eagle2 (fixed tree) against vanilla on the same prompts, batched together."""
    from eagle2.config import SamplingParams

    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    outs, stats = {}, {}
    for mode in ("vanilla", "eagle2"):
        engine = make_engine(target, head, len(prompts), 256)
        outs[mode], stats[mode] = generate(engine, prompts, params, fixed_tree(mode, sizes))
    diffs = first_diffs(outs["eagle2"], outs["vanilla"])
    differing = [d for d in diffs if d is not None]
    return {"prompts": len(prompts), "new_tokens": num_tokens, "diverged": len(differing),
            "fraction_diverged": round(len(differing) / len(prompts), 4),
            "first_diff": diffs, "earliest_diff": min(differing, default=None),
            "eagle2_tokens_per_step_per_prompt": round(
                stats["eagle2"]["tokens_per_step"] / len(prompts), 3),
            **logit_gaps(target, prompts)}


def bench_tree(num_b: int, num_n: int, vocab: int, top_k: int, device, seed: int = 0):
    """A fixed top_k-ary tree of num_n nodes (breadth first) with random tokens, per row."""
    from eagle2.tree import tree_from_rows

    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [(i - 1) // top_k for i in range(1, num_n)]
    depths = [0] * num_n
    for i in range(1, num_n):
        depths[i] = depths[parents[i]] + 1
    rows = []
    for _ in range(num_b):
        tokens = torch.randint(0, vocab, (num_n,), generator=gen).tolist()
        rows.append((tokens, parents, depths, [0.5 ** d for d in depths], [False] * num_n))
    return tree_from_rows(rows, device)


def verify_only_ms(num_b: int, vocab: int, sizes: dict, device, reps: int) -> dict:
    """ms of `verify_batch` alone over random logits [B, N, V] in which each node's first child
    is the likely token (so a sampled walk goes deep), greedy against sampled at T = 1."""
    from eagle2.config import SamplingParams
    from eagle2.verify import verify_batch

    num_n, top_k = sizes["total_tokens"], sizes["top_k"]
    tree = bench_tree(num_b, num_n, vocab, top_k, device)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_b, num_n, vocab, generator=gen, device=device) * 2
    first_kids = [i for i in range(1, num_n) if (i - 1) % top_k == 0]
    parents = torch.tensor([(i - 1) // top_k for i in first_kids], device=device)
    rows = torch.arange(num_b, device=device)[:, None]
    logits[rows, parents[None], tree.tokens[:, first_kids]] += 24.0  # p ~ 1 at T = 1
    out = {"batch": num_b, "nodes": num_n, "vocab": vocab}
    for name, temp in (("greedy", 0.0), ("sampled", 1.0)):
        params = [SamplingParams(temperature=temp, seed=b) for b in range(num_b)]
        gens = [torch.Generator().manual_seed(b) for b in range(num_b)]
        out[f"{name}_ms"] = time_calls(lambda p=params, g=gens: verify_batch(tree, logits, p, g),
                                       reps, torch.device(device))
        out[f"{name}_tokens"] = sum(map(len, verify_batch(tree, logits, params, gens).tokens))
    out["sampled_over_greedy"] = round(out["sampled_ms"] / max(out["greedy_ms"], 1e-9), 3)
    return out


def verify_step_ms(target, num_b: int, sizes: dict, reps: int) -> dict:
    """ms of the runner's whole verification step (forward, logits, acceptance) over a fixed
    tree after a 64-token prefix, greedy against sampled at T = 1."""
    from eagle2.config import SamplingParams
    from eagle2.runner import LocalRunner

    runner = LocalRunner(target, num_b, 64 + sizes["total_tokens"] + 8)
    dev = target.device
    slots = torch.arange(num_b, device=dev)
    runner.set_lengths(slots, torch.full((num_b,), 64, device=dev))
    tree = bench_tree(num_b, sizes["total_tokens"], target.vocab_size, sizes["top_k"], "cpu")
    positions = 64 + tree.depths
    out = {"batch": num_b, "nodes": sizes["total_tokens"], "vocab": target.vocab_size}
    for name, temp in (("greedy", 0.0), ("sampled", 1.0)):
        params = [SamplingParams(temperature=temp, seed=b) for b in range(num_b)]
        gens = [torch.Generator().manual_seed(b) for b in range(num_b)]
        out[f"{name}_ms"] = time_calls(
            lambda p=params, g=gens: runner.verify_step(tree, positions, slots, p, g), reps, dev)
    out["sampled_over_greedy"] = round(out["sampled_ms"] / max(out["greedy_ms"], 1e-9), 3)
    return out


def masked_attention(shape: str, num_b: int, num_n: int, keys: int, dtype: torch.dtype,
                     device: str, reps: int) -> dict:
    """The tree attention of the torch backend's layers (`attention.masked_sdpa`: SDPA under
    a dense mask) at one verification shape, with the query heads packed (what CUDA runs) and
    with SDPA's `enable_gqa` (what the CPU runs): ms per call, the kernels (CUDA) or aten
    operators (CPU) one call ran, as the profiler names them, and the largest difference of
    their outputs."""
    from torch.profiler import ProfilerActivity, profile

    from eagle2 import attention

    heads, kv_heads = SHAPES[shape]["num_attention_heads"], SHAPES[shape]["num_key_value_heads"]
    head_dim = SHAPES[shape]["hidden_size"] // heads
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(num_b, heads, num_n, head_dim, generator=gen, device=dev, dtype=dtype)
    k, v = (torch.randn(num_b, kv_heads, keys, head_dim, generator=gen, device=dev,
                        dtype=dtype) for _ in range(2))
    mask = torch.rand(num_b, 1, num_n, keys, generator=gen, device=dev) < 0.9
    mask[..., -1] = True
    out: dict = {"shape": shape, "batch": num_b, "tokens": num_n, "keys": keys}
    results = {}
    default = attention.PACK_GQA_DEVICES
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    try:
        for name, devices in (("packed", frozenset({dev.type})), ("enable_gqa", frozenset())):
            attention.PACK_GQA_DEVICES = devices

            inp = attention.StepInputs(None, None, mask, None, None, True)

            def call(inp=inp):  # a layer's call: the packed bias is made once a forward
                return attention.masked_sdpa(q, k, v, inp)

            results[name] = call()
            with profile(activities=activities) as prof:
                call()
                _sync(dev)
            if dev.type == "cuda":
                names = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
            else:
                names = sorted({e.name for e in prof.events() if "attention" in e.name})
            out[name] = {"ms": time_calls(call, reps, dev), "kernels": names}
    finally:
        attention.PACK_GQA_DEVICES = default
    group = heads // kv_heads
    out["packed_bias_ms"] = time_calls(  # once a forward, shared by the layers
        lambda: attention.StepInputs(None, None, mask, None, None, True).packed_bias(group, dtype),
        reps, dev)
    out["max_abs_diff"] = float((results["packed"].float() - results["enable_gqa"].float())
                                .abs().max())
    return out


def prefill_peak(target, num_tokens: int) -> dict:
    """One prefill of num_tokens (greedy, the runner's path) in a fresh one-slot cache: its
    time and, on CUDA, the peak memory it allocated above what was held before it."""
    from eagle2.attention import causal_mask
    from eagle2.config import SamplingParams
    from eagle2.runner import LocalRunner

    dev = target.device
    runner = LocalRunner(target, 1, num_tokens + 8)
    cache_bytes = sum(t.numel() * t.element_size() for t in (runner.cache.k, runner.cache.v))
    tokens = torch.randint(0, target.vocab_size, (1, num_tokens),
                           generator=torch.Generator().manual_seed(5)).to(dev)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    lengths = torch.tensor([num_tokens], device=dev)
    runner.prefill_step(tokens, torch.arange(num_tokens, device=dev)[None],
                        causal_mask(lengths, num_tokens), torch.tensor([0], device=dev),
                        lengths - 1, [SamplingParams()], [None])
    _sync(dev)
    row = {"tokens": num_tokens, "ms": round(1000 * (time.perf_counter() - t0), 3),
           "cache_bytes": cache_bytes}
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        row.update(baseline_bytes=base, peak_bytes=peak, prefill_peak_bytes=peak - base)
    else:
        row.update(baseline_bytes=None, peak_bytes=None, prefill_peak_bytes=None)
    return row


# ----- the run: state, phases, the JSON -------------------------------------------------------
class Skip(Exception):
    """Raised by a phase that does not apply here; its message is the reason."""


class PhaseTimeout(Exception):
    """A phase ran far past its budget and was stopped."""


@dataclass
class Check:
    """What the phases share: the settings, the models built so far and the phase's clock."""

    args: argparse.Namespace
    device: str
    tiny: bool
    dtype: torch.dtype
    sizes: dict = field(default_factory=lambda: {"total_tokens": 16, "depth": 4, "top_k": 4})
    target: object = None
    head: object = None
    deadline: float = float("inf")  # this phase's soft budget (time.monotonic)
    # what was imported before the check began (a test process may already hold Ray or gRPC):
    # the imports phase reports only what the engine's phases brought in
    modules_before: frozenset = field(default_factory=lambda: frozenset(sys.modules))

    def pick(self, gpu, tiny):
        """The GPU run's value or the tiny run's."""
        return tiny if self.tiny else gpu

    def over(self) -> bool:
        """True once this phase's budget is spent: skip further repetitions."""
        return time.monotonic() > self.deadline

    def left(self) -> float:
        return self.deadline - time.monotonic()


def phase_setup(c: Check) -> dict:
    from eagle2.head import new_head

    shape = c.pick("llama-3-8b", "tiny")
    c.target = random_target(shape, c.dtype, c.device)
    c.head = new_head(c.target.config, seed=0, dtype=c.dtype).to(c.device)
    out = {"shape": shape, **SHAPES[shape], "lm_head_scale": LOGIT_SCALE}
    if c.device == "cuda":
        out["memory_allocated_bytes"] = torch.cuda.memory_allocated()
    return out


def phase_backend(c: Check) -> dict:
    """The backend and attention kernels the target runs with (after `fuse`, as a runner)."""
    c.target.fuse()
    backend = c.target.backend
    out = {"info": backend.info(c.target), "class": f"{type(backend).__module__}."
           f"{type(backend).__qualname__}", "exact": bool(getattr(backend, "exact", False))}
    if c.device == "cuda":
        cuda = torch.backends.cuda
        out["sdpa_enabled"] = {"flash": cuda.flash_sdp_enabled(),
                               "mem_efficient": cuda.mem_efficient_sdp_enabled(),
                               "cudnn": cuda.cudnn_sdp_enabled(), "math": cuda.math_sdp_enabled()}
        out["capability"] = list(torch.cuda.get_device_capability())
        from eagle2.flex import compile_failure

        # null: FlexAttention compiles here (else the error, and the target runs SDPA)
        out["flex_compile_failure"] = compile_failure(c.target.device, c.dtype)
    out["masked_attention"] = masked_attention(
        c.pick("llama-3-8b", "tiny"), 8, c.pick(32, 8), c.pick(1024, 128), c.dtype, c.device,
        c.pick(20, 3))
    return out


def phase_warmup(c: Check) -> dict:
    """The first engine runs of the process, eager and (CUDA) through CUDA graphs, each run
    twice: the first pays for torch.compile (FlexAttention's kernels, compiled once per
    process), the captures and the allocator's growth, which would otherwise land in the
    later phases' budgets. Reports the seconds of each run."""
    from eagle2.config import SamplingParams

    prompts = random_prompts(c.target.vocab_size, [9, 14], seed=5)
    params = SamplingParams(max_tokens=c.pick(8, 4), ignore_eos=True)
    out: dict = {"skipped_for_budget": []}
    for on in (False, True) if c.device == "cuda" else (False,):
        for mode in ("eagle2", "vanilla"):
            name = f"{mode}_{'graphs' if on else 'eager'}"
            if c.over():
                out["skipped_for_budget"].append(name)
                continue
            engine = make_engine(c.target, c.head, 2, 256, cuda_graphs=on)
            runs = []
            for _ in range(2):
                t0 = time.perf_counter()
                generate(engine, prompts, params, fixed_tree(mode, c.sizes))
                runs.append(round(time.perf_counter() - t0, 3))
            out[name] = {"first_s": runs[0], "again_s": runs[1]}
    return out


def phase_lossless(c: Check) -> dict:
    return check_lossless(c.target, c.head, c.sizes, c.pick(24, 8), over=c.over)


def phase_divergence(c: Check) -> dict:
    """eagle2 against vanilla, greedy, on the check's model and on the unscaled one."""
    prompts = random_prompts(c.target.vocab_size, c.pick([8, 13, 21, 34, 9, 16, 27, 40],
                                                         [6, 11, 17, 9]), seed=7)
    tokens = c.pick(32, 12)
    out: dict = {"tree": c.sizes, "skipped_for_budget": []}
    out["scaled_lm_head"] = divergence(c.target, c.head, c.sizes, prompts, tokens)
    if c.over():
        out["skipped_for_budget"].append("unscaled_lm_head")
        return out
    unscaled = random_target(c.pick("llama-3-8b", "tiny"), c.dtype, c.device, lm_scale=1.0)
    out["unscaled_lm_head"] = divergence(unscaled, c.head, c.sizes, prompts, tokens)
    return out


def phase_sampling_speed(c: Check) -> dict:
    batches, reps = c.pick((1, 8), (1, 2)), c.pick(10, 3)
    out: dict = {"verify_only": [], "verify_step": [], "skipped_for_budget": []}
    for num_b in batches:
        if c.over():
            out["skipped_for_budget"].append(num_b)
            continue
        out["verify_only"].append(verify_only_ms(num_b, LLAMA3_VOCAB, c.sizes, c.device, reps))
        c.target.set_feature_layers(None)
        out["verify_step"].append(verify_step_ms(c.target, num_b, c.sizes, reps))
    return out


def phase_context_4k(c: Check) -> dict:
    """A 4096-token prompt: prefill, then greedy decoding, eagle2 (fixed tree) and vanilla."""
    from eagle2.config import SamplingParams

    num_prompt, num_tokens = 4096, c.pick(32, 8)
    prompt = random_prompts(c.target.vocab_size, [num_prompt], seed=11)
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    out: dict = {"prompt_tokens": num_prompt, "new_tokens": num_tokens, "skipped_for_budget": []}
    for mode in ("vanilla", "eagle2"):
        if c.over():
            out["skipped_for_budget"].append(mode)
            continue
        engine = make_engine(c.target, c.head, 1, num_prompt + 2 * num_tokens + 64)
        tokens, out[mode] = generate(engine, prompt, params, fixed_tree(mode, c.sizes))
        out[mode]["new_tokens"] = len(tokens[0])
        out.setdefault("outputs", {})[mode] = tokens
    outs = out.pop("outputs", {})
    if len(outs) == 2:
        out["first_diff_eagle2_vs_vanilla"] = first_diffs(outs["eagle2"], outs["vanilla"])[0]
    return out


def phase_prefill_memory(c: Check) -> dict:
    c.target.set_feature_layers(None)
    out: dict = {"rows": [], "skipped_for_budget": []}
    if c.device != "cuda":
        out["reason"] = "torch.cuda.max_memory_allocated needs CUDA: memory figures are null"
    for num in c.pick((1024, 4096, 8192), (256, 1024)):
        if c.over():
            out["skipped_for_budget"].append(num)
            continue
        out["rows"].append(prefill_peak(c.target, num))
    return out


def phase_eagle2_vs_vanilla(c: Check) -> dict:
    return engine_vs_vanilla(c.target, c.head, c.sizes, c.pick(32, 8), (1, 8), c.over)


def phase_paged_attention(c: Check) -> dict:
    return paged_attention(c.target, c.head, c.sizes, c.pick(32, 6), c.pick((1, 8), (2,)),
                           c.over)


def phase_arrivals(c: Check) -> dict:
    return arrivals(c.target, c.head, c.sizes, c.pick(512, 32), c.pick(2000, 150),
                    c.pick(64, 24), c.over)


def phase_forward_cost(c: Check) -> dict:
    c.target.set_feature_layers(None)
    batches = c.pick([1, 2, 4, 8, 16], [1, 2])
    tokens = c.pick([1, 2, 4, 8, 16, 32, 64], [1, 4, 8])
    return forward_cost(c.target, batches, tokens, c.pick(10, 3), True, c.over)


def phase_lossless_eagle3_head(c: Check) -> dict:
    head3 = random_eagle3_head(c.target, c.dtype, c.device, c.pick(32000, 64))
    return check_lossless(c.target, head3, c.sizes, c.pick(24, 8), ("eagle2", "chain"),
                          over=c.over)


def phase_eagle3_vs_vanilla(c: Check) -> dict:
    head3 = random_eagle3_head(c.target, c.dtype, c.device, c.pick(32000, 64))
    return engine_vs_vanilla(c.target, head3, c.sizes, c.pick(32, 8), (1, 8), c.over)


def phase_forward_cost_70b_4_layers(c: Check) -> dict:
    """Four decoder layers of Llama-3-70B's shapes (the 8B model is freed first)."""
    c.target = c.head = None
    _free(c.device)
    shape = c.pick("llama-3-70b-layers", "tiny-wide")
    big = random_target(shape, c.dtype, c.device)
    try:
        out = forward_cost(big, [1, 8], c.pick([1, 16, 64], [1, 8]), c.pick(10, 3),
                           not c.tiny, c.over)
    finally:
        del big
    return {"shape": shape, **out}


def phase_imports(c: Check) -> dict:
    new = set(sys.modules) - c.modules_before
    return {"imported_forbidden": [m for m in FORBIDDEN if m in new],
            "imported_before_the_check": [m for m in FORBIDDEN if m in c.modules_before]}


# ----- tensor parallelism (two processes) ------------------------------------------------------
def _tp_measure(target, spec: dict) -> tuple[torch.Tensor, dict]:
    """A prompt's logits [N, V] (on the CPU) and ms per forward of 1 and 16 tokens after it."""
    from eagle2.runner import LocalRunner

    n, dev = spec["prompt"], target.device
    runner = LocalRunner(target, 1, n + 32)
    tokens = torch.tensor(random_prompts(target.vocab_size, [n], seed=3), device=dev)
    slots = torch.tensor([0], device=dev)
    mask = torch.ones(1, n, n, dtype=torch.bool, device=dev).tril()
    _, logits = runner.forward(tokens, torch.arange(n, device=dev)[None], mask, slots)
    runner.set_lengths(slots, torch.tensor([n], device=dev))
    times = {}
    for num in (1, 16):
        step = tokens[:, :num]
        pos = n + torch.arange(num, device=dev)[None]
        tri = torch.ones(1, num, num, dtype=torch.bool, device=dev).tril()
        times[f"ms_{num}_tokens"] = time_calls(
            lambda s=step, p=pos, m=tri: runner.forward(s, p, m, slots), spec["reps"], dev)
    return logits[0].float().cpu(), times


def _tp_worker(rank: int, world: int, port: int, spec: dict, out_path: str) -> None:
    """One rank: the whole model's logits and times, then its tp shard's (same seed)."""
    import torch.distributed as dist

    from eagle2.tp import apply_tp, init_tp

    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    device = f"cuda:{rank}" if cuda else "cpu"
    dtype = getattr(torch, spec["dtype"])
    init_tp(rank, world, "127.0.0.1", port, "nccl" if cuda else "gloo")
    try:
        whole, whole_ms = _tp_measure(random_target(spec["shape"], dtype, device), spec)
        _free(device)
        shard = apply_tp(random_target(spec["shape"], dtype, device), world, rank, device)
        logits, tp_ms = _tp_measure(shard, spec)
        if rank == 0:
            result = {"world_size": world, "process_group": dist.get_backend(),
                      "shape": spec["shape"], "prompt_tokens": spec["prompt"],
                      "max_abs_logit_diff": float((logits - whole).abs().max()),
                      "argmax_agreement": float((logits.argmax(-1) == whole.argmax(-1))
                                                .float().mean()),
                      "tp1": whole_ms, "tp2": tp_ms}
            Path(out_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def phase_tp2(c: Check) -> dict:
    """tp = 2 over NCCL on two GPUs (gloo over two CPU processes in CPU mode), spawned."""
    import torch.multiprocessing as mp

    if c.device == "cuda" and torch.cuda.device_count() < 2:
        raise Skip(f"tp = 2 needs two GPUs; this machine has {torch.cuda.device_count()}")
    if c.device == "cpu" and c.args.no_cpu_tp:
        raise Skip("--no-cpu-tp: the gloo run over two CPU processes was not asked for")
    spec = {"device": c.device, "dtype": str(c.dtype).removeprefix("torch."),
            "shape": c.pick("llama-3-8b", "tiny"), "prompt": 32, "reps": c.pick(10, 3)}
    worker = importlib.import_module("eagle2.gpu_check")._tp_worker  # picklable by name
    from eagle2.tp_channel import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tp2.json"
        ctx = mp.start_processes(worker, args=(2, free_port("127.0.0.1"), spec, str(out)),
                                 nprocs=2, join=False, start_method="spawn")
        try:
            while not ctx.join(timeout=1.0):
                if c.left() < -30:
                    raise PhaseTimeout(f"the tp = 2 ranks ran {30 - c.left():.0f} s past "
                                       "their budget")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
        return json.loads(out.read_text())


def _free(device: str) -> None:
    import gc

    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Phase:
    name: str
    run: Callable[[Check], dict]
    budget_s: float  # on the GPU run (soft: loops stop repeating past it)
    needs_model: bool = True  # skipped when setup failed


PHASES: list[Phase] = [
    Phase("setup", phase_setup, 60, needs_model=False),
    Phase("backend", phase_backend, 10),
    Phase("warmup", phase_warmup, 90),
    Phase("lossless", phase_lossless, 60),
    Phase("divergence", phase_divergence, 60),
    Phase("sampling_speed", phase_sampling_speed, 30),
    Phase("context_4k", phase_context_4k, 40),
    Phase("prefill_memory", phase_prefill_memory, 30),
    Phase("eagle2_vs_vanilla", phase_eagle2_vs_vanilla, 30),
    Phase("paged_attention", phase_paged_attention, 50),
    Phase("arrivals", phase_arrivals, 30),
    Phase("forward_cost", phase_forward_cost, 90),
    Phase("lossless_eagle3_head", phase_lossless_eagle3_head, 45),
    Phase("eagle3_vs_vanilla", phase_eagle3_vs_vanilla, 30),
    Phase("forward_cost_70b_4_layers", phase_forward_cost_70b_4_layers, 60, needs_model=False),
    Phase("tp2", phase_tp2, 90, needs_model=False),
    Phase("imports", phase_imports, 5, needs_model=False),
]


def write_json(path: Path, report: dict) -> None:
    """Write the report atomically: a temporary file beside it, then a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, path)


def error_record(exc: BaseException, lines: int = 12) -> dict:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"type": type(exc).__name__, "message": str(exc)[:2000],
            "traceback": text.rstrip().splitlines()[-lines:]}


class _Alarm:
    """Stops a phase (PhaseTimeout in the main thread) once it runs hard_s seconds."""

    def __init__(self, hard_s: float):
        self.hard_s = hard_s
        self.armed = (threading.current_thread() is threading.main_thread()
                      and hasattr(signal, "setitimer"))

    def _ring(self, signum, frame):
        raise PhaseTimeout(f"stopped after {self.hard_s:.0f} s (far past its budget)")

    def __enter__(self):
        if self.armed:
            self.previous = signal.signal(signal.SIGALRM, self._ring)
            signal.setitimer(signal.ITIMER_REAL, max(self.hard_s, 1.0))
        return self

    def __exit__(self, *exc):
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        return False


def skip_reason(c: Check, phase: Phase, report: dict, total_left: float) -> str | None:
    """Why a phase does not run (None: it runs)."""
    selected = c.args.phases
    if selected and phase.name not in selected and phase.name != "setup":
        return "not selected (--phases)"
    if phase.needs_model and report["phases"]["setup"]["status"] != "ok":
        return "needs the model, and setup did not succeed"
    if total_left < 3:
        return f"the run's budget of {c.args.budget_s:.0f} s is spent"
    return None


def run_phase(c: Check, phase: Phase, total_left: float) -> dict:
    """One phase, timed, within its budget; never raises (the outcome is its entry)."""
    budget = min(phase.budget_s, total_left)
    entry: dict = {"status": "running", "budget_s": round(budget, 1)}
    t0 = time.monotonic()
    c.deadline = t0 + budget
    try:
        with _Alarm(min(budget + max(20.0, budget / 2), total_left + 20)):
            if phase.name in c.args.fail_phase:
                raise RuntimeError(f"--fail-phase {phase.name}: a failure injected on purpose")
            result = phase.run(c)
        entry.update(status="ok", result=result)
        if result.get("skipped_for_budget"):
            entry["truncated"] = True
    except Skip as skip:
        entry.update(status="skipped", reason=str(skip))
    except Exception as exc:  # recorded: the next phase runs
        entry.update(status="failed", error=error_record(exc))
    finally:
        c.deadline = float("inf")
    entry["wall_s"] = round(time.monotonic() - t0, 2)
    _free(c.device)
    return entry


def passed(report: dict) -> bool:
    """No phase failed, every lossless check that ran held, nothing forbidden was imported."""
    phases = report["phases"]
    if any(p["status"] == "failed" for p in phases.values()):
        return False
    checks = [v.get("equal_to_vanilla", v.get("ran"))
              for name in ("lossless", "lossless_eagle3_head") if phases[name]["status"] == "ok"
              for v in phases[name]["result"].values() if isinstance(v, dict)]
    imports = phases["imports"].get("result", {}).get("imported_forbidden", [])
    return all(checks) and not imports


def header(c: Check) -> dict:
    """The run's description: what ran where, before any phase."""
    import transformers

    cuda = c.device == "cuda"
    return {"command": "gpu-check", "tiny": c.tiny, "device": c.device,
            "device_name": torch.cuda.get_device_name() if cuda else
            platform.processor() or platform.machine(),
            "gpus": torch.cuda.device_count() if cuda else 0, "dtype": str(c.dtype),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "tree": c.sizes,
            "budget_s": c.args.budget_s, "argv": sys.argv[1:], "passed": None,
            "finished": False, "wall_s": 0.0}


def run_check(args: argparse.Namespace,
              hook: Callable[[str, dict, Path], None] | None = None) -> dict:
    """Every phase in order; the JSON is rewritten after each (then hook(name, report, path))."""
    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device == "cpu"
    c = Check(args, device, tiny, torch.float32 if device == "cpu" else torch.bfloat16)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu-check.json"
    t_start = time.monotonic()
    report = header(c)
    report["phases"] = {p.name: {"status": "pending"} for p in PHASES}
    write_json(path, report)
    for phase in PHASES:
        total_left = args.budget_s - (time.monotonic() - t_start)
        reason = skip_reason(c, phase, report, total_left)
        entry = {"status": "skipped", "reason": reason} if reason else \
            run_phase(c, phase, total_left)
        report["phases"][phase.name] = entry
        report["wall_s"] = round(time.monotonic() - t_start, 1)
        print(f"[gpu-check] {phase.name}: {entry['status']} "
              f"({entry.get('wall_s', 0)} s){' ' + reason if reason else ''}", flush=True)
        write_json(path, report)
        if hook is not None:
            hook(phase.name, report, path)
    report.update(passed=passed(report), finished=True)
    write_json(path, report)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = [p.name for p in PHASES]
    parser = argparse.ArgumentParser(prog="python -m eagle2.gpu_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu-check.json")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: CUDA when available, else the CPU (tiny shapes)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes (the default on the CPU); on CUDA a quick smoke run")
    parser.add_argument("--phases", type=_names(names), default=[],
                        help=f"comma-separated phases to run (setup always runs): {names}")
    parser.add_argument("--fail-phase", type=_names(names), default=[],
                        help="make these phases fail on purpose (tests the reporting)")
    parser.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S,
                        help="seconds for all phases together; later phases are skipped")
    parser.add_argument("--no-cpu-tp", action="store_true",
                        help="CPU mode: skip the tp2 phase's two gloo processes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None,
         hook: Callable[[str, dict, Path], None] | None = None) -> int:
    """The command line; 1 when a phase failed or a check did not hold. hook: `run_check`'s."""
    args = parse_args(argv)
    report = run_check(args, hook)
    summary = {name: p["status"] for name, p in report["phases"].items()}
    print(json.dumps({"device": report["device"], "passed": report["passed"],
                      "wall_s": report["wall_s"], "phases": summary}, indent=2))
    return 0 if report["passed"] else 1


def _names(known: list[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        bad = [n for n in names if n not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown phases {bad}; known: {known}")
        return names
    return parse


if __name__ == "__main__":
    sys.exit(main())
