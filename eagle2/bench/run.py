"""`eagle2 bench`: tau, tokens/s and speedup of each mode against plain decoding.

Metric definitions: `eagle2.bench.report`; docs/draft-tree.md.

Batch size 1 by default (a latency benchmark; `--batch B` runs B prompts together). For each
prompt (group) every mode runs once, the order rotating from prompt to prompt, so that load
noise from other processes hits all modes alike. Modes: vanilla (our engine, no drafting: the
speedup baseline), eagle2 (dynamic tree), static (the EAGLE-1 tree), chain (top_k 1), hf
(Hugging Face `model.generate` on the same target module: an outside baseline, batch 1).
Trees (`--tree`): "budget" (the default) is what users get, the engine's cost-aware budget
(`eagle2.budget`) over the default maxima; "fixed" takes --total-tokens/--depth/--tree-top-k
every step (static gets the same total_tokens: the ablation at equal budget).
Greedy runs check that every speculative mode's tokens equal vanilla's (`lossless`).
Metric definitions: `eagle2.bench.report`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from eagle2.cli import add_lookup_argument, add_model_arguments
from eagle2.config import SamplingParams, TreeConfig
from eagle2.tree import static_shape

from . import report
from .load import busy_processes
from .machine import head_name, loadavg, machine_info
from .report import PromptRun

ALL_MODES = ("vanilla", "eagle2", "static", "chain", "hf")
PHASE_FIELDS = {"draft": "draft_s", "verify": "verify_s", "prefill": "prefill_s",
                "other": "other_s"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", action="append", default=None,
                   help="mt_bench | humaneval (repeatable or comma list; default mt_bench)")
    p.add_argument("--num-prompts", type=int, default=10, help="prompts per suite")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k (0: off)")
    p.add_argument("--seed", type=int, default=0, help="T > 0: prompt i is sampled with seed+i")
    p.add_argument("--modes", default=",".join(ALL_MODES),
                   help=f"comma list of {', '.join(ALL_MODES)}")
    p.add_argument("--tree", choices=("budget", "fixed"), default=None,
                   help="budget: the engine's cost-aware tree (default unless a size is "
                        "given); fixed: the given sizes every step")
    p.add_argument("--batch", type=int, default=1,
                   help="prompts generated together (continuous batching); hf needs 1")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every prompt group R times, the mode order rotating on: more "
                        "alternations between modes, so that a shared machine's slow phases "
                        "(seconds long) fall on every mode alike")
    p.add_argument("--total-tokens", type=int, default=None, help="tree size incl. the root")
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--tree-top-k", type=int, default=None, help="draft tree branching")
    add_lookup_argument(p)
    p.add_argument("--out", default=None, help="output folder (default runs/bench-<timestamp>)")
    p.add_argument("--warmup", action="store_true", help="one short untimed run per mode first")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the count that decodes fastest on this "
                        "machine when quiet, measured once and cached, and fewer while other "
                        "processes keep cores busy: eagle2.threads)")
    p.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="run N busy-loop processes beside the benchmark (killed at the end), to "
                        "measure speculation on a machine that is not quiet")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="run only prompts i with i %% N == I (one process per core; needs a "
                        "fixed tree; its files are named *-shard-I-of-N, so shards may share "
                        "--out), then combine the shards' folders with --merge")
    p.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                   help="combine finished --shard runs (the runs-shard-I-of-N.json in these "
                        "folders) into one report in --out; runs nothing")
    add_model_arguments(p)


def parse_list(values: list[str], allowed: tuple[str, ...], what: str) -> list[str]:
    """['a,b', 'c'] -> ['a', 'b', 'c'] (deduplicated, in order), each checked."""
    items = list(dict.fromkeys(x.strip() for v in values for x in v.split(",") if x.strip()))
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"unknown {what} {bad or values}; use one of {', '.join(allowed)}")
    return items


def tree_source(args) -> str:
    explicit = any(getattr(args, f) is not None for f in ("total_tokens", "depth", "tree_top_k"))
    if args.tree == "budget" and explicit:
        raise ValueError(f"--tree {args.tree} picks the tree itself; drop --total-tokens/"
                         "--depth/--tree-top-k or use --tree fixed")
    return args.tree or ("fixed" if explicit else "budget")


def fixed_tree(args) -> TreeConfig:
    fields = {k: v for k, v in (("total_tokens", args.total_tokens), ("depth", args.depth),
                                ("top_k", args.tree_top_k)) if v is not None}
    return TreeConfig("eagle2", **fields, budget="fixed")


def mode_trees(modes: list[str], tree: TreeConfig, chain: TreeConfig) -> dict[str, TreeConfig]:
    """The TreeConfig each engine mode runs with; static gets eagle2's total_tokens."""
    trees = {"vanilla": TreeConfig("vanilla"), "eagle2": tree,
             "static": replace(tree, mode="static"), "chain": chain}
    return {m: trees[m] for m in modes if m in trees}


def tree_nodes(tree: TreeConfig) -> int:
    """Nodes actually verified (the static tree has at most 26)."""
    if tree.mode == "static":
        return 1 + sum(len(level) for level in static_shape(tree.total_tokens))
    return tree.num_nodes


def draft_levels(tree: TreeConfig | None) -> int | None:
    if tree is None or tree.mode == "vanilla":
        return None
    return len(static_shape(tree.total_tokens)) if tree.mode == "static" else tree.depth + 1


# ----- one generation ---------------------------------------------------------------------------
def run_engine(llm, tree: TreeConfig, group: list[tuple[list[int], SamplingParams, str]]
               ) -> list[PromptRun]:
    """Generate a group of prompts together. Wall and phase times are the group's, shared out
    in proportion to each prompt's new tokens (so that sums over prompts stay right)."""
    before = {f: getattr(llm.engine.stats, f) for f in PHASE_FIELDS.values()}
    t0 = time.perf_counter()
    outs = llm.generate_ids([llm.request(ids, params, tree) for ids, params, _ in group])
    wall = time.perf_counter() - t0
    phase = {p: getattr(llm.engine.stats, f) - before[f] for p, f in PHASE_FIELDS.items()}
    total = max(sum(len(o.token_ids) for o in outs), 1)
    runs = []
    for (ids, _, prompt_id), out in zip(group, outs, strict=True):
        share = len(out.token_ids) / total if len(group) > 1 else 1.0
        runs.append(PromptRun(prompt_id, len(ids), out.token_ids, out.num_steps,
                              wall * share if len(group) > 1 else out.wall_s,
                              out.finish_reason, dict(out.accepted_at_depth),
                              {p: v * share for p, v in phase.items()}))
    return runs


@torch.inference_mode()
def run_hf(llm, ids: list[int], params: SamplingParams, prompt_id: str) -> PromptRun:
    """HF `generate` on the same target module, explicit attention mask, same stop rules."""
    from transformers import GenerationConfig

    eos = sorted(llm.eos_ids())
    sample = not params.greedy
    config = GenerationConfig(
        max_new_tokens=params.max_tokens, do_sample=sample,
        temperature=params.temperature if sample else None,
        top_p=params.top_p if sample else None, top_k=params.top_k if sample else None,
        eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)
    input_ids = torch.tensor([ids], device=llm.target.device)
    if sample:
        torch.manual_seed(params.seed if params.seed is not None else 0)
    t0 = time.perf_counter()
    out = llm.target.hf.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 generation_config=config)
    wall = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    reason = "stop" if new and new[-1] in eos else "length"
    return PromptRun(prompt_id, len(ids), new, len(new), wall, reason)


def run_mode(llm, mode: str, trees: dict, group: list[tuple[list[int], SamplingParams, str]]
             ) -> list[PromptRun]:
    if mode == "hf":
        return [run_hf(llm, ids, params, prompt_id) for ids, params, prompt_id in group]
    return run_engine(llm, trees[mode], group)


# ----- the benchmark ----------------------------------------------------------------------------
def parse_shard(text: str | None) -> tuple[int, int]:
    if text is None:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise ValueError(f"--shard must be I/N with 0 <= I < N, got {text!r}")
    return i, n


def run(args) -> int:
    """Validate, load, run the interleaved loop, report."""
    from .prompts import load_suite, suite_names

    if args.merge:
        return merge(args.merge, Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}"))
    suites = parse_list(args.suite or ["mt_bench"], suite_names(), "suite")
    modes = parse_list([args.modes], ALL_MODES, "mode")
    source = tree_source(args)
    shard = parse_shard(args.shard)
    if args.batch < 1 or (args.batch > 1 and "hf" in modes):
        raise ValueError(f"--batch must be >= 1 and 1 with mode hf, got {args.batch}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    max_tokens=args.max_tokens)
    SamplingParams(**sampling)  # validate before loading anything
    prompts = {s: list(enumerate(load_suite(s, args.num_prompts)))[shard[0]::shard[1]]
               for s in suites}  # (index in the suite, prompt): seeds follow the index
    threads = torch.get_num_threads()
    try:  # the thread count is process-wide: put it back for in-process callers (tests)
        if args.threads:
            torch.set_num_threads(args.threads)
        with busy_processes(args.background_load):
            return _bench(args, prompts, modes, source, sampling)
    finally:
        torch.set_num_threads(threads)


def _bench(args, prompts: dict, modes: list[str], source: str, sampling: dict) -> int:
    from eagle2.api import Eagle2

    out_dir = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start, load_start = time.perf_counter(), loadavg()
    if load_start and load_start[0] > (os.cpu_count() or 1):
        print(f"warning: load average {load_start[0]} on {os.cpu_count()} CPUs: timings will be "
              f"noisy (with --threads 1 torch suffers less from oversubscription)",
              file=sys.stderr)
    llm = Eagle2.load(args.target, args.draft, dtype=args.dtype, device=args.device,
                      max_batch=args.batch, threads=args.threads or "auto")
    trees = _trees(llm, args, modes, source)
    greedy = args.temperature == 0
    # the cost-aware budget measures this machine's forward and draft costs at its first step
    # (cached per machine after): done here, untimed, not inside the first timed run
    auto = [m for m in modes if trees.get(m) is not None and trees[m].mode != "vanilla"
            and trees[m].budget == "auto"]
    first = llm.encode(next(iter(prompts.values()))[0][1].user_message)
    for mode in modes if args.warmup else auto[:1]:
        run_mode(llm, mode, trees, [(first, SamplingParams(
            **{**sampling, "max_tokens": 8}, seed=args.seed), "warmup")])
    runs = _loop(llm, prompts, modes, trees, sampling, None if greedy else args.seed, args.batch,
                 args.repeats)
    config = {
        "suites": list(prompts), "num_prompts": args.num_prompts, **sampling,
        "seed": args.seed, "modes": modes,
        "order": "per prompt every mode, order rotating by one each prompt",
        "batch_size": args.batch, "repeats": args.repeats, "warmup": args.warmup,
        "background_load": args.background_load,
        "target": llm.target.name,
        "draft": head_name(args, llm), "tree_source": source,
        "trees": {m: {**asdict(t), "num_nodes": tree_nodes(t)} for m, t in trees.items()},
    }
    if args.shard:
        config["shard"] = args.shard
    machine, wall_s = machine_info(llm, load_start), time.perf_counter() - t_start
    stats = llm.engine.stats  # what the cost-aware budget did over the whole run
    machine["budget"] = {"auto_steps": stats.auto_steps, "skipped_drafts": stats.skipped_drafts,
                         "skipped_probes": stats.skipped_probes,
                         "nodes_chosen": dict(sorted(stats.nodes_chosen.items())),
                         "predicted_accepted": round(stats.predicted_accepted, 1),
                         "accepted": stats.accepted, "realized_vetoes": stats.realized_vetoes,
                         "lookup_vetoes": stats.lookup_vetoes}
    machine["lookup"] = {"offered": stats.lookup_offered, "accepted": stats.lookup_accepted,
                         "steps_without_draft": stats.lookup_steps,
                         "accepted_without_draft": stats.lookup_step_accepted,
                         "ngram_chains_without_draft": stats.ngram_chains,
                         "ngram_accepted_without_draft": stats.ngram_accepted}
    # a shard's files carry its name, so shards started side by side with one --out (or with
    # the default, a folder named by the second they started) do not overwrite each other
    index, count = parse_shard(args.shard)
    tag = f"-shard-{index}-of-{count}" if args.shard else ""
    report.write_json(out_dir / f"runs{tag}.json", {
        "config": config, "machine": machine, "wall_s": wall_s,
        "runs": {s: {m: [asdict(r) for r in rs] for m, rs in by_mode.items()}
                 for s, by_mode in runs.items()}})
    return _report(out_dir, config, runs, [machine], wall_s, tag)


def _report(out_dir: Path, config: dict, runs: dict, machines: list[dict], wall_s: float,
            tag: str = "") -> int:
    """Metrics, results{tag}.json, the chart and the printed table from the raw runs."""
    greedy = config["temperature"] == 0
    levels = {m: draft_levels(TreeConfig(**{k: v for k, v in t.items() if k != "num_nodes"}))
              for m, t in config["trees"].items()}
    results = {
        "definitions": report.DEFINITIONS,
        "config": config,
        "machine": machines[0] if len(machines) == 1 else machines,
        "suites": {s: report.finish_suite(by_mode, greedy, levels)
                   for s, by_mode in runs.items()},
    }
    checks = [s["lossless"] for s in results["suites"].values()]
    results["lossless"] = None if None in checks else all(checks)
    results["wall_s"] = round(wall_s, 2)
    results_path, chart_path = out_dir / f"results{tag}.json", out_dir / f"bench{tag}.png"
    report.write_json(results_path, results)
    report.plot(chart_path, results["suites"])
    print("trees  " + "; ".join(
        f"{m}: N={t['num_nodes']} depth={t['depth']} top_k={t['top_k']}"
        + (f" lookup={t['lookup']}" if m == "eagle2" and t.get("lookup") else "")
        for m, t in config["trees"].items() if m != "vanilla"))
    print(report.summary_table(results["suites"]))
    for name, suite in results["suites"].items():
        for m in suite["mismatches"]:
            print(f"LOSSLESS FAILURE {name} {m}", file=sys.stderr)
    for machine in machines:
        if machine.get("lookup", {}).get("offered"):
            lk = machine["lookup"]
            print(f"prompt lookup: {lk['accepted']} of {lk['offered']} lookup nodes accepted"
                  + (f"; {lk['steps_without_draft']} steps verified chains without a draft "
                     f"call, accepting {lk['accepted_without_draft']}"
                     if lk.get("steps_without_draft") else "")
                  + (f" ({lk['ngram_chains_without_draft']} of those chains from the n-gram "
                     f"store, accepting {lk['ngram_accepted_without_draft']})"
                     if lk.get("ngram_chains_without_draft") else ""))
    print(f"lossless: {report.fmt_bool(results['lossless'])}; wrote {results_path} and "
          f"{chart_path}")
    return 1 if results["lossless"] is False else 0


def merge(dirs: list[str], out_dir: Path) -> int:
    """Combine `--shard` runs (every shard's runs-shard-I-of-N.json, or a runs.json, in the
    folders given): same config apart from the shard, prompts in suite order."""
    import json

    found = [(d, sorted(Path(d).glob("runs-shard-*-of-*.json"))
              + [p for p in [Path(d) / "runs.json"] if p.exists()]) for d in dirs]
    missing = [d for d, files in found if not files]
    if missing:
        raise ValueError(f"no runs in {missing}: --merge takes the --out folders of finished "
                         "--shard runs")
    parts = [json.loads(f.read_text()) for _, files in found for f in files]
    configs = [{k: v for k, v in p["config"].items() if k != "shard"} for p in parts]
    if any(c != configs[0] for c in configs[1:]):
        raise ValueError("the runs to merge differ in more than their --shard "
                         "(suites, sampling, modes, trees, target and head must match)")
    shards = [p["config"].get("shard") for p in parts]
    if None in shards or len(set(shards)) != len(shards):
        raise ValueError(f"--merge takes distinct --shard runs, got shards {shards}")
    runs: dict = {}
    for p in parts:
        for suite, by_mode in p["runs"].items():
            for mode, rs in by_mode.items():
                runs.setdefault(suite, {}).setdefault(mode, []).extend(
                    PromptRun(**{**r, "accepted_at_depth": {int(k): v for k, v in
                                                            r["accepted_at_depth"].items()}})
                    for r in rs)
    for by_mode in runs.values():  # suite order (the ids sort as the suites list them)
        for rs in by_mode.values():
            rs.sort(key=lambda r: _prompt_order(r.prompt_id))
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {**configs[0], "merged_shards": sorted(shards)}
    wall = max(p["wall_s"] for p in parts)  # the shards ran side by side
    return _report(out_dir, config, runs, [p["machine"] for p in parts], wall)


def _prompt_order(prompt_id: str) -> tuple:
    """'81' < '100'; 'HumanEval/9' < 'HumanEval/10'."""
    head, _, tail = prompt_id.rpartition("/")
    return (head, int(tail)) if tail.isdigit() else (head, tail)


def _trees(llm, args, modes: list[str], source: str):
    """-> {mode: TreeConfig}."""
    if source == "budget":
        tree = TreeConfig()
        chain = TreeConfig("chain", total_tokens=tree.depth + 2, depth=tree.depth, top_k=1)
    else:
        tree = fixed_tree(args)
        chain = TreeConfig("chain", total_tokens=tree.depth + 2, depth=tree.depth, top_k=1,
                           budget="fixed")
    if getattr(args, "lookup", None) is not None:
        tree = replace(tree, lookup=args.lookup)
    return mode_trees(modes, tree, chain)


def _loop(llm, prompts: dict, modes: list[str], trees: dict, sampling: dict,
          seed: int | None, batch: int = 1,
          repeats: int = 1) -> dict[str, dict[str, list[PromptRun]]]:
    """Every prompt group in every mode, `repeats` times, the mode order rotating by one from
    group to group."""
    from tqdm import tqdm

    runs: dict[str, dict[str, list[PromptRun]]] = {s: {m: [] for m in modes} for s in prompts}
    total = sum(len(ps) for ps in prompts.values()) * len(modes) * repeats
    turn = 0
    with tqdm(total=total, desc="bench", unit="gen", file=sys.stderr) as bar:
        for suite, suite_prompts in [*prompts.items()] * repeats:
            for start in range(0, len(suite_prompts), batch):
                group = [(llm.encode(prompt.user_message),
                          SamplingParams(**sampling, seed=None if seed is None else seed + i),
                          prompt.prompt_id) for i, prompt in suite_prompts[start:start + batch]]
                for mode in modes[turn % len(modes):] + modes[:turn % len(modes)]:
                    bar.set_postfix_str(f"{suite} {group[0][2]} {mode}")
                    runs[suite][mode].extend(run_mode(llm, mode, trees, group))
                    bar.update(len(group))
                turn += 1
    return runs
