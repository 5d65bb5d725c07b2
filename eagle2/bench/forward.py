"""`eagle2 bench-forward`: the target forward's cost curve against the memory roofline.

1. Read bandwidth: a sum over a tensor far larger than the last-level cache, best of several.
2. The forward (logits included) for N tree tokens x B requests after a realistic prefix,
   best of 1 + `--repeats` sweeps of the whole grid (as the engine measures its costs); one
   profiled run per cell splits it into linears, attention, lm_head and other work.
3. Roofline fraction = (bytes a forward must stream: weights + the KV cache it reads) /
   (time x bandwidth): 1.0 means the forward is as fast as memory allows.
The measured cost curve is also saved where the engine looks for this machine's costs, so
the cost-aware tree uses it (`eagle2.budget`). JSON + PNG in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from eagle2.cli import add_model_arguments

from .load import busy_processes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,2,4,8", help="comma list of batch sizes")
    p.add_argument("--nodes", default="1,2,3,4,6,8,12,16,24,32,48,64",
                   help="comma list of tokens per request")
    p.add_argument("--prefix", type=int, default=256, help="committed tokens per request")
    p.add_argument("--long-prefix", type=int, default=1024,
                   help="also time the grid after this many committed tokens (the engine "
                        "reads costs at the batch's context between the two); 0: not")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--refresh-kernels", action="store_true",
                   help="measure the linear kernels again instead of using the cached choice")
    p.add_argument("--no-save-costs", action="store_true",
                   help="do not store the curve as this machine's costs for the engine")
    p.add_argument("--background-load", type=int, default=0, metavar="N")
    p.add_argument("--out", default=None, help="output folder (default runs/forward-<time>)")
    add_model_arguments(p)


def llc_bytes() -> int:
    """Size of the largest CPU cache (Linux sysfs), 0 if unknown."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * mult)
    return max(sizes, default=0)


def read_bandwidth(device: torch.device, repeats: int = 8) -> tuple[float, int]:
    """Bytes/s of a sum over max(1 GiB, 4 x LLC) of fp32: -> (bandwidth, tensor bytes)."""
    size = max(1 << 30, 4 * llc_bytes())
    x = torch.ones(size // 4, device=device)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return size / best, size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def split_forward(runner, tokens, positions, mask, slots) -> dict[str, float]:
    """Shares of one forward's CPU time: linears / attention / lm_head / other (profiled)."""
    from torch.profiler import profile, record_function

    target = runner.target
    for _ in range(2):  # the first profiled forward of a process is mostly profiler start-up
        with profile() as prof:
            with record_function("eagle2.forward"):
                feats = target.forward(tokens, positions, mask, runner.cache, slots).hidden
            with record_function("eagle2.lm_head"):
                target.logits(feats)
    totals = {"linears": 0.0, "attention": 0.0, "lm_head": 0.0, "all": 0.0}
    for ev in prof.key_averages():
        us = ev.self_cpu_time_total
        totals["all"] += us
        if ev.key in ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise",
                      "eagle2_cpu::linear",  # the native bf16 linear (kernels.NATIVE)
                      "eagle2_cpu::linear_fma",  # ... its FMA variant (kernels.FMA)
                      "eagle2_cpu::linear_amx"):  # ... on the AMX tiles (kernels.AMX)
            totals["linears"] += us
        elif ("scaled_dot_product" in ev.key or ev.key == "aten::bmm"  # bmm: exact attention
              or ev.key == "eagle2_cpu::attention"):  # the CPU backend's native operators
            totals["attention"] += us
    for ev in prof.events():
        if ev.name == "eagle2.lm_head":
            totals["lm_head"] = ev.cpu_time_total
    totals["linears"] = max(totals["linears"] - totals["lm_head"], 0.0)  # the head's mm too
    other = max(totals["all"] - totals["linears"] - totals["attention"] - totals["lm_head"], 0)
    whole = max(totals["all"], 1e-9)
    return {"linears": totals["linears"] / whole, "attention": totals["attention"] / whole,
            "lm_head": totals["lm_head"] / whole, "other": other / whole}


def weight_bytes(target) -> int:
    """Bytes of every weight a forward reads (decoder layers, final norm, lm_head)."""
    params = [p for p in target.layers.parameters()] + [p for p in target.norm.parameters()]
    total = sum(p.numel() * p.element_size() for p in params)
    head = target.lm_head.weight
    return total + head.numel() * head.element_size()


def kv_bytes(target, cache, num_b: int, length: int) -> int:
    per_token = 2 * target.num_layers * cache.k.shape[2] * target.head_dim * cache.k.element_size()
    return per_token * num_b * length


def run(args) -> int:
    from eagle2.api import Eagle2
    from eagle2.budget import CostModel, cost_cache_path, time_head

    batches = [int(x) for x in args.batches.split(",")]
    nodes = [int(x) for x in args.nodes.split(",")]
    if min(batches) < 1 or min(nodes) < 1 or args.repeats < 1:
        raise ValueError("--batches, --nodes and --repeats must be positive")
    out_dir = Path(args.out or f"runs/forward-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    t_load = time.perf_counter()
    long_prefix = args.long_prefix if args.long_prefix > args.prefix else 0
    llm = Eagle2.load(args.target, "untrained", dtype=args.dtype, device=args.device,
                      max_batch=max(batches),
                      max_context=max(args.prefix, long_prefix) + max(nodes) + 8,
                      threads=args.threads)
    runner, target = llm.engine.runner, llm.target
    if args.refresh_kernels:
        target.backend.fused = None
        target.fuse(refresh=True)
    load_s = time.perf_counter() - t_load
    with busy_processes(args.background_load):
        bandwidth, bw_bytes = read_bandwidth(target.device)
        prefixes = (args.prefix, long_prefix) if long_prefix else (args.prefix,)
        cells, grids = measure(runner, target, batches, nodes, prefixes, args.repeats, bandwidth)
        greedy = greedy_lm_head(runner, target, args.repeats)
        head = time_head(runner, passes=args.repeats + 1)
    model = replace(CostModel.from_grids(tuple(batches), tuple(nodes), prefixes, grids), **head)
    if not args.no_save_costs:
        model.save(cost_cache_path(target))
    result = {
        "target": target.name, "dtype": str(target.dtype).removeprefix("torch."),
        "device": str(target.device), "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "background_load": args.background_load,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 2), "bandwidth_tensor_bytes": bw_bytes,
        "weight_bytes": weight_bytes(target), "kernel_plan": target.backend.plan.block_bytes,
        "load_and_kernel_choice_s": round(load_s, 2), "prefix": args.prefix,
        "long_prefix": long_prefix, "cells": cells, "greedy_lm_head": greedy,
    }
    result["ratios"] = ratios(cells)
    (out_dir / "forward.json").write_text(json.dumps(result, indent=1))
    plot(out_dir / "forward.png", cells, result)
    print(format_table(cells, result))
    if greedy:
        print("greedy tokens of R hidden states, ms: " + "; ".join(
            f"R={r} logits+argmax {g['logits_argmax_ms']}, without logits {g['greedy_ms']}"
            for r, g in greedy.items()))
    print(f"wrote {out_dir / 'forward.json'} and {out_dir / 'forward.png'}", file=sys.stderr)
    return 0


def measure(runner, target, batches, nodes, prefixes, repeats, bandwidth):
    """Timed as the engine times its costs (`eagle2.budget.time_grid`: 1 + repeats sweeps of
    the grid, best per cell, after each of `prefixes` committed tokens: the first is the
    report's, a second one goes into `long_ms`), then one profiled forward per cell for the
    split. -> (cells, one grid per prefix)."""
    from eagle2.budget import time_grid

    grids = time_grid(runner, tuple(batches), tuple(nodes), tuple(prefixes),
                      passes=repeats + 1)
    prefix, costs, long = prefixes[0], grids[0], (grids[1] if len(grids) > 1 else None)
    cells = []
    dev = target.device
    for num_b, row in zip(batches, costs, strict=True):
        slots = torch.arange(num_b, device=dev)
        runner.set_lengths(slots, torch.full_like(slots, prefix))
        for num_n, best in zip(nodes, row, strict=True):
            tokens = torch.randint(0, target.vocab_size, (num_b, num_n), device=dev)
            positions = prefix + torch.arange(num_n, device=dev).expand(num_b, num_n)
            mask = torch.ones(num_n, num_n, dtype=torch.bool, device=dev).tril()
            shares = split_forward(runner, tokens, positions, mask.expand(num_b, num_n, num_n),
                                   slots)
            streamed = weight_bytes(target) + kv_bytes(target, runner.cache, num_b, prefix)
            cells.append({"batch": num_b, "nodes": num_n, "ms": round(best * 1e3, 3),
                          **({"long_ms": round(long[batches.index(num_b)][nodes.index(num_n)]
                                               * 1e3, 3)} if long else {}),
                          "shares": {k: round(v, 3) for k, v in shares.items()},
                          "bytes": streamed,
                          "roofline_ms": round(streamed / bandwidth * 1e3, 3),
                          "roofline_fraction": round(streamed / bandwidth / best, 3)})
        runner.set_lengths(slots, torch.zeros_like(slots))
    return cells, grids


def greedy_lm_head(runner, target, repeats: int, rows=(1, 2, 4, 8)) -> dict:
    """{R: ms of the argmax of R rows' logits (lm_head + argmax), and of the same tokens
    without the logits (`kernels.GreedyArgmax`, docs/cpu-backend.md "Exact greedy tokens")}, best of
    4 x (1 + repeats) sweeps (`LocalRunner.head_seconds`); {} where the target has no greedy
    head."""
    if target.backend.greedy_head is None:
        return {}
    logits, greedy = runner.head_seconds(tuple(rows), 4 * (1 + repeats), argmax=True)
    return {r: {"logits_argmax_ms": round(a * 1e3, 3), "greedy_ms": round(g * 1e3, 3)}
            for r, a, g in zip(rows, logits, greedy, strict=True)}


def ratios(cells: list[dict]) -> dict:
    """forward(N) / forward(1) per batch, and forward(1) / roofline."""
    out = {}
    for num_b in sorted({c["batch"] for c in cells}):
        row = {c["nodes"]: c for c in cells if c["batch"] == num_b}
        if 1 in row:
            base = row[1]["ms"]
            out[str(num_b)] = {"vs_one_token": {n: round(c["ms"] / base, 3)
                                                for n, c in sorted(row.items())},
                               "one_token_vs_roofline": round(base / row[1]["roofline_ms"], 3)}
    return out


def format_table(cells: list[dict], result: dict) -> str:
    lines = [f"read bandwidth {result['read_bandwidth_gb_s']} GB/s "
             f"({result['threads']} threads); weights {result['weight_bytes'] / 1e6:.0f} MB",
             "batch nodes      ms  x1-token  roofline-frac  linears attn lm_head other"]
    base = {}
    for c in cells:
        base.setdefault(c["batch"], c["ms"])
        s = c["shares"]
        ratio = c["ms"] / base[c["batch"]]
        lines.append(f"{c['batch']:5d} {c['nodes']:5d} {c['ms']:8.1f} {ratio:8.2f}"
                     f" {c['roofline_fraction']:13.2f}  {s['linears']:7.2f} {s['attention']:4.2f}"
                     f" {s['lm_head']:7.2f} {s['other']:5.2f}")
    return "\n".join(lines)


def plot(path: Path, cells: list[dict], result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for num_b in sorted({c["batch"] for c in cells}):
        row = [c for c in cells if c["batch"] == num_b]
        ax.plot([c["nodes"] for c in row], [c["ms"] for c in row], marker="o",
                label=f"batch {num_b}")
        ax.axhline(row[0]["roofline_ms"], ls=":", lw=0.8, color=ax.lines[-1].get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per request (N)")
    ax.set_ylabel("forward + logits, ms")
    ax.set_title(f"{result['target']} {result['dtype']}, {result['threads']} threads, "
                 f"{result['read_bandwidth_gb_s']} GB/s (dotted: roofline)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
