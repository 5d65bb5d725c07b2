# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""Engine variants side by side in one process: every variant decodes every prompt (or group
of `--batch` prompts decoded together), the order rotating by one each prompt, so a slow
phase of the machine falls on all of them.
Prints tokens/s and tau per suite, each variant's ratio to the first, the engine's step split,
and writes JSON.

    .venv/bin/python benchmarks/engine_ab.py --variants vanilla,shipped,no-lookup-alone \
        --num-prompts 8 --max-tokens 128 [--temperature 1.0] [--out FILE]

Variants: vanilla (plain decoding), shipped (the default engine), no-lookup-alone (no prompt
lookup chains on steps without a draft call: `Engine(lookup_alone=False)`), always-draft (the
speculation gate never shut), never-draft (the gate always shut and no newcomer probes:
the lookup chains alone), no-ngram (prompt lookup without the n-gram store's chains),
vanilla-logits and shipped-logits (greedy tokens as the argmax of the lm_head's logits, not
through `kernels.GreedyArgmax`), grid-costs (the budget prices greedy batches as the cost
grid's forwards, logits included, not as `CostModel.greedy`), no-lookup-veto (lookup chains on
steps without a draft call taken even where such steps delivered less than plain steps
lately: `Engine._lookup_vetoed`), no-chain-scale (those chains valued as the lookup table and
the n-gram store say, not scaled by what the request's chains got lately: `Engine._chain_scale`),
python-chains (the n-gram store's chains walked in Python, context by context, not by
csrc/ngram.cpp for the whole batch: `NgramStore.propose_many`), one-branch (steps without a
draft call verify one lookup chain a request, prompt lookup's or the n-gram store's, whichever
is worth more, not a tree of both: `Engine.lookup_branches`), global-scales (one measured
scale of step times for every batch size, not one per size: `Engine.scales`), packed-head (the
head's linears and draft vocabulary through oneDNN's packed bf16 kernel, what
`kernels.small_rows_plan` chose on the Intel Xeon before it measured 1-16 rows, with its own
draft costs, measured at its first step), fma-target and vanilla-fma-target (the target's
layers multiplied by the FMA kernel at every row count, as before the AMX kernel, with that
plan's cost grid), no-argmax-tiles and vanilla-no-argmax-tiles (the greedy argmax's int8
pass by vpdpwssd at every row count, not on the AMX tiles from `GreedyArgmax.tile_rows`),
random-head-costs (the lm_head's greedy costs timed after random tokens, as before
`runner.timing_tokens`, with a cost grid of its own), narrow-first-round (a greedy
verification's first argmax round takes the roots and their children only, as before
`GreedyArgmax.first_rows`), call-by-call-head and always-draft-call-by-call-head (the draft
head's calls as the native operators one by one with Python between them, as before
`eagle2.cpu.head.HeadStep` ran each as one `head_step` operator, with their own draft costs),
base-kernels
(the shipped engine whose target layers run the operators of `--base-source`, another commit's
csrc/cpu_ops.cpp built under its own namespace, with its own cost grid, measured at its first
step: a kernel change A/B'd in one process; greedy tokens through its greedy_argmax too, with
its own int8 pack, its exact pass reading the weight its source's greedy_argmax takes; the
lm_head's logits and the head keep this build's), vanilla-base-kernels
(plain decoding on them),
per-layer-op and
vanilla-per-layer-op (the target's layers one `decoder_layer` operator call each, as before
`fused.LayerStack` ran consecutive layers as one `decoder_layers` call, with their own cost
grid), other-ngram (the shipped engine with the n-gram store of `--ngram PATH`, e.g. one built
from more answers), other-head (the shipped engine with the head of `--draft DIR`, its
calibration and n-gram store with it: e.g. a newly trained head against the shipped one).
A variant named twice with a suffix ("shipped,shipped@2") is built twice: each instance loads
its own copy of the weights, and the spread between the two is what the method itself reads
between equal engines.
Greedy runs check that every variant's output equals the
first's among those whose target runs the same kernels (FMA and AMX sums differ in the last
bits); sampled runs (T > 0) seed prompt i with 1000 + i, and their variants differ in
their tokens (each tree consumes the generator differently).
"""

import argparse
import hashlib
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

import eagle2  # noqa: F401  (first: passive OpenMP waiting)

from eagle2 import Eagle2, SamplingParams
from eagle2.bench.prompts import load_suite
from eagle2.budget import SpeculationGate
from eagle2.config import TreeConfig
from eagle2.engine import EngineStats
from eagle2.cpu.kernels import FMA, PACKED

VARIANTS = ("vanilla", "shipped", "no-lookup-alone", "always-draft", "no-ngram",
            "vanilla-logits", "shipped-logits", "grid-costs", "no-lookup-veto", "no-chain-scale",
            "python-chains", "base-kernels",
            "never-draft", "vanilla-base-kernels", "one-branch", "global-scales", "packed-head",
            "fma-target", "vanilla-fma-target", "no-argmax-tiles", "vanilla-no-argmax-tiles",
            "random-head-costs", "narrow-first-round", "call-by-call-head",
            "always-draft-call-by-call-head", "per-layer-op", "vanilla-per-layer-op",
            "other-ngram", "other-head")


class _OpenGates(dict):
    """Engine.gates whose gate for every batch size always drafts (never, if not `open`)."""

    def __init__(self, open_: bool = True):
        super().__init__()
        self.open = open_

    def __contains__(self, size) -> bool:
        return True

    def __getitem__(self, size) -> SpeculationGate:
        gate = SpeculationGate()
        gate.should_draft = lambda: self.open
        return gate


def build(variant: str, max_batch: int = 8, base_source: str | None = None,
          threads: int = 1, ngram: str | None = None, draft: str | None = None) -> Eagle2:
    variant = variant.split("@")[0]  # "shipped@2": another instance of the same variant
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    mode = "vanilla" if variant.startswith("vanilla") else "eagle2"
    if variant == "other-head" and not draft:
        raise SystemExit("other-head needs --draft HEAD_DIR")
    llm = Eagle2.load(draft=draft if variant == "other-head" else None, threads=threads,
                      tree=TreeConfig(mode=mode), max_batch=max_batch)
    if variant.endswith("-logits"):
        llm.target.backend.greedy_head = None
    if variant == "no-lookup-alone":
        llm.engine.lookup_alone = False
    if variant == "global-scales":
        llm.engine.scales_per_batch = False
    if variant == "one-branch":
        llm.engine.lookup_branches = 1
    if variant.startswith("always-draft"):
        llm.engine.gates = _OpenGates()
    if variant.endswith("call-by-call-head"):
        llm.engine.drafter.kernels._head_step = lambda end, window: None
        own_draft_costs(llm, "call-by-call")
    if variant == "never-draft":
        llm.engine.gates = _OpenGates(open_=False)
        llm.engine._could_pay = lambda drafting: False  # no newcomer probes either
    if variant == "grid-costs":
        llm.engine._forward_costs = lambda costs: costs
    if variant == "no-lookup-veto":
        llm.engine._lookup_vetoed = lambda: False
    if variant == "no-chain-scale":
        llm.engine._chain_scale = lambda s: 1.0
    if variant == "python-chains":
        store = llm.engine.ngram.with_rates(llm.engine.ngram.rates)  # its own instance
        object.__setattr__(store, "propose_many", lambda contexts, depth: [
            store.propose(c, depth) for c in contexts])
        llm.engine.ngram = llm.engine.drafter.ngram = store
    if variant.endswith("base-kernels"):
        if not base_source:
            raise SystemExit("base-kernels needs --base-source OTHER/eagle2/csrc/cpu_ops.cpp")
        from eagle2.cpu.native import load_variant

        llm.target.backend.native = base = load_variant("eagle2_ab_base", Path(base_source))
        if llm.target.backend.greedy_head is not None:
            backend = llm.target.backend
            backend.greedy_head = base_greedy_argmax(backend.greedy_head.proj, base)
        tag = hashlib.sha256(Path(base_source).read_bytes()).hexdigest()[:12]
        own_costs(llm, f"ab-{tag}")  # (one per base source)
    if variant.endswith("per-layer-op"):
        # the target's layers one `decoder_layer` call each, not one `decoder_layers` call
        # (fused.NATIVE_STACK off while this variant decodes), with its own forward costs
        from eagle2.cpu import fused

        _during_generate(llm, lambda: mock.patch.object(fused, "NATIVE_STACK", False))
        own_costs(llm, "per-layer")
    if variant == "no-ngram":
        llm.engine.ngram = llm.engine.drafter.ngram = None
    if variant == "other-ngram":
        if not ngram:
            raise SystemExit("other-ngram needs --ngram PATH/ngram.npz")
        from eagle2.ngram import NgramStore

        llm.engine.ngram = llm.engine.drafter.ngram = NgramStore.load(ngram)
    if variant == "packed-head":
        head_kernel(llm, PACKED)
    if variant.endswith("fma-target"):
        target_kernel(llm, FMA)
    if variant.endswith("no-argmax-tiles") and llm.target.backend.greedy_head is not None:
        llm.target.backend.greedy_head.q_tiles = None
        llm.target.backend.greedy_head.first_rows = 0
    if variant == "narrow-first-round" and llm.target.backend.greedy_head is not None:
        llm.target.backend.greedy_head.first_rows = 0  # roots and their children, as before
    if variant == "random-head-costs":
        random_head_costs(llm)
    return llm


def _during_generate(llm, context) -> None:
    """llm.generate inside `context()` (a context manager: a module switch this variant alone
    flips while it decodes; the other variants of the process run without it)."""
    generate = llm.generate

    def wrapped(*a, **k):
        with context():
            return generate(*a, **k)
    llm.generate = wrapped


def base_greedy_argmax(proj, base):
    """`kernels.GreedyArgmax` through another build's operators (`--base-source`): its own int8
    pack, its exact pass reading the weight that source's greedy_argmax takes (the packed copy,
    before it read the bf16 rows)."""
    from eagle2.cpu.kernels import GreedyArgmax

    greedy = GreedyArgmax(proj, base)
    if "Tensor packed" in str(base.greedy_argmax.default._schema):
        greedy.weight = greedy.proj._native[1]
    return greedy


def random_head_costs(llm: Eagle2) -> None:
    """The lm_head's costs timed after random tokens, as before `runner.timing_tokens` (the
    target without its tokenizer while they are timed), in a cost cache of their own."""
    runner, target = llm.engine.runner, llm.target
    timed = runner.head_seconds

    def head_seconds(*a, **k):
        tokenizer, target.tokenizer = target.tokenizer, None
        try:
            return timed(*a, **k)
        finally:
            target.tokenizer = tokenizer
    runner.head_seconds = head_seconds
    own_costs(llm, "random-head")


def target_kernel(llm: Eagle2, kernel: int) -> None:
    """Multiply the target's layers (and lm_head) by `kernel` at every row count, with the
    cost grid of that plan (read from its cache or measured at the first step)."""
    from eagle2.cpu.kernels import ROW_BUCKETS
    from eagle2.budget import cost_cache_path

    target = llm.target
    target.backend.plan.block_bytes.update({rows: kernel for rows in ROW_BUCKETS})
    if target.backend.head_proj is not None:
        target.backend.head_proj.plan = target.backend.plan
    llm.engine._costs = llm.engine._cost_path = cost_cache_path(target)


def head_kernel(llm: Eagle2, kernel: int) -> None:
    """Multiply the drafter's head linears, fused layer weights and draft vocabulary by
    `kernel` at every row count; the engine then measures its own draft costs."""
    from eagle2.cpu.kernels import (
        ROW_BUCKETS,
        BlockedWeight,
        BlockPlan,
        PackedLinear,
        weights_stamp,
    )

    drafter, plan = llm.engine.drafter, BlockPlan({rows: kernel for rows in ROW_BUCKETS})
    kernels = drafter.kernels  # the CPU backend's (`eagle2.cpu.head.HeadKernels`)
    kernels.vocab_proj = BlockedWeight(drafter.draft_lm_head, plan)
    for module in drafter.head.modules():
        if isinstance(module, PackedLinear):
            module._packed = BlockedWeight(module.weight.detach(), plan)
            module._seen = weights_stamp(module.weight)
    if kernels._fused is not None:
        seen, weights = kernels._fused
        kernels._fused = seen, tuple(BlockedWeight(w.weight, plan) for w in weights)
    own_draft_costs(llm, f"kernel{kernel}")


def own_draft_costs(llm: Eagle2, tag: str) -> None:
    """The variant measures its own draft costs (at its first step) in a copy of the cost
    file beside the shipped one."""
    from eagle2.budget import draft_key

    engine = llm.engine
    engine._draft_key_of = engine.drafter, f"{draft_key(engine.drafter)}|{tag}"
    path = own_costs(llm, tag)  # a copy beside: the variant's draft costs its own
    if path.exists() and not engine._cost_path.exists():
        shutil.copy(path, engine._cost_path)


def own_costs(llm: Eagle2, tag: str):
    """The variant's cost grid in a cache file of its own beside the shipped one
    (`<stem>-<tag>.json`, measured at its first step where missing); -> the shipped one's
    path."""
    from eagle2.budget import cost_cache_path

    path = cost_cache_path(llm.target)
    llm.engine._costs = llm.engine._cost_path = path.with_name(f"{path.stem}-{tag}.json")
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="vanilla,shipped")
    ap.add_argument("--num-prompts", type=int, default=8, help="per suite")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=1,
                    help="prompts decoded together (groups of one suite's consecutive prompts)")
    ap.add_argument("--base-source", default=None, help="for base-kernels")
    ap.add_argument("--ngram", default=None, help="for other-ngram: an ngram.npz")
    ap.add_argument("--draft", default=None, help="for other-head: a head directory")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every variant")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = args.variants.split(",")
    llms = {v: build(v, max(8, args.batch), args.base_source, args.threads, args.ngram,
                     args.draft)
            for v in variants}
    suites = [load_suite(s, args.num_prompts) for s in ("mt_bench", "humaneval")]
    groups = [ps[i: i + args.batch] for ps in suites for i in range(0, len(ps), args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    sums = {v: {g[0].suite: [0, 0.0, 0] for g in groups} for v in variants}  # tokens, s, steps
    # untimed: the cost-aware budget measures this machine's forward and draft costs at its
    # first step where no cache has them yet (tens of seconds, once per machine and build)
    for v in variants:
        llms[v].generate([groups[0][0].user_message], replace(params, max_tokens=8))
        llms[v].engine.stats = EngineStats()
    # outputs are compared within a target kernel family (FMA and AMX sums differ in the last
    # bits, so their greedy texts may part): each variant against the first of its family
    family = {v: frozenset(llms[v].target.backend.plan.block_bytes.values()) for v in variants}
    first_of = {v: next(u for u in variants if family[u] == family[v]) for v in variants}
    same = True
    for i, group in enumerate(groups):
        sp = params if params.greedy else replace(params, seed=1000 + i)
        outputs = {}
        for v in variants[i % len(variants):] + variants[: i % len(variants)]:
            t0 = time.perf_counter()
            outs = llms[v].generate([p.user_message for p in group], sp)
            acc = sums[v][group[0].suite]
            acc[0] += sum(len(o.token_ids) for o in outs)
            acc[1] += time.perf_counter() - t0
            acc[2] += sum(o.num_steps for o in outs)
            outputs[v] = [o.token_ids for o in outs]
        same &= all(outputs[v] == outputs[first_of[v]] for v in variants)
    result = {"config": vars(args), "lossless": same if params.greedy else None, "variants": {}}
    for v in variants:
        st = llms[v].engine.stats
        steps = max(st.steps, 1)
        result["variants"][v] = {
            "suites": {s: {"tokens_per_s": round(a[0] / a[1], 3), "tau": round(a[0] / a[2], 4),
                           "vs_first": round((a[0] / a[1]) / (sums[variants[0]][s][0]
                                                              / sums[variants[0]][s][1]), 4)}
                       for s, a in sums[v].items()},
            "ms_per_step": {k: round(1000 * getattr(st, f"{k}_s") / steps, 3)
                            for k in ("draft", "verify", "other")},
            "steps": st.steps, "skipped_drafts": st.skipped_drafts,
            "lookup_steps": st.lookup_steps, "lookup_step_accepted": st.lookup_step_accepted,
            "lookup_vetoes": st.lookup_vetoes,
        }
        print(v, json.dumps(result["variants"][v]))
    print("every output equal to the first variant's of the same target kernels:",
          result["lossless"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
