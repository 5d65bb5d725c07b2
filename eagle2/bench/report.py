"""Benchmark metrics, `results.json`, the chart and the summary table
(docs/architecture.md "Metrics").

Definitions (stated once, saved into results.json under "definitions"):
- a *step* is one target forward pass that produced output, as `Completion.num_steps` counts
  them: the prefill (which yields the first token) plus every verification step;
- **tau** = total new tokens / total steps (prefill included). Plain decoding has tau = 1;
- **tau_decode** = (new tokens - 1) / (steps - 1) per prompt, summed over prompts: the same
  without the prefill, i.e. the mean accepted draft tokens + 1 (bonus) per verification step;
- **tokens/s** = total new tokens / total wall time (prefill included);
- **speedup** = a mode's tokens/s over vanilla's tokens/s, same prompts, same run;
- **acceptance by depth** d = fraction of verification steps that accepted >= d draft tokens.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

DEFINITIONS = {
    "step": "one target forward that produced output: the prefill + each verification step",
    "tau": "total new tokens / total steps (prefill included)",
    "tau_decode": "(new tokens - prompts) / (steps - prompts): tokens per verification step",
    "tokens_per_s": "total new tokens / total wall seconds (prefill included)",
    "speedup": "tokens_per_s / vanilla tokens_per_s, same prompts, same run",
    "acceptance_by_depth": "[d-1] = fraction of verification steps accepting >= d draft tokens",
    "accepted_length_hist": "{tokens per verification step (accepted + 1): number of steps}",
    "time_split": "engine time per phase (EngineStats deltas), seconds and fraction",
}
PHASES = ("draft", "verify", "prefill", "other")


@dataclass
class PromptRun:
    """One prompt generated in one mode."""

    prompt_id: str
    prompt_tokens: int
    token_ids: list[int]
    num_steps: int
    wall_s: float
    finish_reason: str
    accepted_at_depth: dict[int, int] = field(default_factory=dict)  # steps accepting exactly d
    phase_s: dict[str, float] = field(default_factory=dict)  # draft/verify/prefill/other

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    def summary(self) -> dict:
        n = self.new_tokens
        return {"prompt_id": self.prompt_id, "prompt_tokens": self.prompt_tokens,
                "new_tokens": n, "num_steps": self.num_steps,
                "tau": round(n / max(self.num_steps, 1), 4), "wall_s": round(self.wall_s, 4),
                "tokens_per_s": round(n / self.wall_s, 3) if self.wall_s > 0 else 0.0,
                "finish_reason": self.finish_reason}


def acceptance_by_depth(counts: dict[int, int], max_depth: int | None = None) -> list[float]:
    """counts {d: steps that accepted exactly d draft tokens} -> [P(accepted >= d), d = 1..].

    E.g. {0: 2, 1: 1, 3: 1} (4 steps) -> [0.5, 0.25, 0.25]: two steps accepted >= 1, one >= 2,
    one >= 3. max_depth pads (or cuts) the list; default = the deepest key.
    """
    total = sum(counts.values())
    deepest = max((d for d, c in counts.items() if c), default=0)
    max_depth = deepest if max_depth is None else max_depth
    if total == 0:
        return [0.0] * max_depth
    return [sum(c for d, c in counts.items() if d >= depth) / total
            for depth in range(1, max_depth + 1)]


def mode_metrics(runs: list[PromptRun], max_depth: int | None = None) -> dict:
    """Aggregate one mode's runs over a suite's prompts."""
    new = sum(r.new_tokens for r in runs)
    steps = sum(r.num_steps for r in runs)
    wall = sum(r.wall_s for r in runs)
    accepted: Counter = Counter()
    for r in runs:
        accepted.update(r.accepted_at_depth)
    phase = {p: sum(r.phase_s.get(p, 0.0) for r in runs) for p in PHASES}
    phase_total = sum(phase.values())
    decode_steps = steps - len(runs)
    return {
        "num_prompts": len(runs),
        "new_tokens": new,
        "num_steps": steps,
        "wall_s": round(wall, 4),
        "tau": round(new / steps, 4) if steps else 0.0,
        "tau_decode": round((new - len(runs)) / decode_steps, 4) if decode_steps > 0 else None,
        "tokens_per_s": round(new / wall, 3) if wall > 0 else 0.0,
        "acceptance_by_depth": [round(a, 4) for a in acceptance_by_depth(accepted, max_depth)],
        "accepted_length_hist": {str(d + 1): c for d, c in sorted(accepted.items())},
        "time_split": {p: {"s": round(s, 4), "frac": round(s / phase_total, 4)
                           if phase_total > 0 else 0.0} for p, s in phase.items()}
        if phase_total > 0 else None,
        "per_prompt": [r.summary() for r in runs],
    }


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def lossless_check(runs: dict[str, list[PromptRun]], speculative: list[str]) -> dict:
    """Greedy runs: every speculative mode's tokens equal vanilla's, prompt by prompt."""
    base = {r.prompt_id: r.token_ids for r in runs["vanilla"]}
    mismatches = []
    for mode in speculative:
        for r in runs[mode]:
            at = first_mismatch(r.token_ids, base[r.prompt_id])
            if at is not None:
                mismatches.append({"mode": mode, "prompt_id": r.prompt_id,
                                   "first_mismatch": at})
    return {"lossless": not mismatches, "mismatches": mismatches}


def finish_suite(runs: dict[str, list[PromptRun]], greedy: bool,
                 max_depths: dict[str, int | None]) -> dict:
    """Per-mode metrics, speedups, the lossless check and tau(eagle2)/tau(static)."""
    modes = {m: mode_metrics(rs, max_depths.get(m)) for m, rs in runs.items()}
    base = modes.get("vanilla", {}).get("tokens_per_s")
    for m in modes.values():
        m["speedup"] = round(m["tokens_per_s"] / base, 4) if base else None
    out: dict = {"modes": modes}
    spec = [m for m in runs if m not in ("vanilla", "hf")]
    if greedy and "vanilla" in runs:
        out.update(lossless_check(runs, spec))
        if "hf" in runs:  # an outside baseline: equal tokens expected, not a lossless claim
            out["hf_matches_vanilla"] = lossless_check(runs, ["hf"])["lossless"]
    else:
        out.update({"lossless": None, "mismatches": []})
    if "eagle2" in modes and "static" in modes and modes["static"]["tau"]:
        out["tau_ratio_eagle2_over_static"] = round(
            modes["eagle2"]["tau"] / modes["static"]["tau"], 4)
    return out


def write_json(path: Path, results: dict) -> None:
    path.write_text(json.dumps(results, indent=2) + "\n")


def plot(path: Path, suites: dict[str, dict]) -> None:
    """Speedup per mode per suite (bars) and tokens-per-step histograms per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_hist) = plt.subplots(1, 2, figsize=(12, 4.5))
    modes = list(dict.fromkeys(m for s in suites.values() for m in s["modes"]))
    width = 0.8 / max(len(suites), 1)
    for i, (name, suite) in enumerate(suites.items()):
        ys = [suite["modes"].get(m, {}).get("speedup") or 0.0 for m in modes]
        xs = [j + (i - (len(suites) - 1) / 2) * width for j in range(len(modes))]
        bars = ax_speed.bar(xs, ys, width, label=name)
        ax_speed.bar_label(bars, fmt="%.2f", fontsize=7)
    ax_speed.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax_speed.set_xticks(range(len(modes)), modes)
    ax_speed.set_ylabel("speedup over vanilla (tokens/s)")
    ax_speed.set_title("Speedup per mode")
    ax_speed.legend()
    _plot_hist(ax_hist, suites, [m for m in modes if m not in ("vanilla", "hf")])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_hist(ax, suites: dict[str, dict], modes: list[str]) -> None:
    hists = {}
    for m in modes:
        total: Counter = Counter()
        for suite in suites.values():
            total.update({int(k): v for k, v in
                          suite["modes"].get(m, {}).get("accepted_length_hist", {}).items()})
        hists[m] = total
    longest = max((max(h, default=1) for h in hists.values()), default=1)
    width = 0.8 / max(len(modes), 1)
    for i, (m, h) in enumerate(hists.items()):
        n = sum(h.values()) or 1
        xs = [x + (i - (len(modes) - 1) / 2) * width for x in range(1, longest + 1)]
        ax.bar(xs, [h.get(x, 0) / n for x in range(1, longest + 1)], width, label=m)
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("tokens per verification step (accepted + bonus)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("Accepted length per step (all suites)")
    if modes:
        ax.legend()


def summary_table(suites: dict[str, dict]) -> str:
    """A compact fixed-width table: one row per suite and mode."""
    head = (f"{'suite':<10} {'mode':<8} {'tau':>5} {'tok/s':>7} {'speedup':>7} "
            f"{'acc>=1':>6} {'acc>=2':>6} {'draft%':>6} {'verify%':>7}  lossless")
    lines = [head, "-" * len(head)]
    for name, suite in suites.items():
        for mode, m in suite["modes"].items():
            acc = m["acceptance_by_depth"] + [None, None]
            split = m["time_split"] or {}
            lossless = "" if mode in ("vanilla", "hf") else fmt_bool(suite.get("lossless"))
            lines.append(
                f"{name:<10} {mode:<8} {m['tau']:>5.2f} {m['tokens_per_s']:>7.2f} "
                f"{_num(m['speedup'], 7)} {_num(acc[0], 6)} {_num(acc[1], 6)} "
                f"{_pct(split.get('draft'), 6)} {_pct(split.get('verify'), 7)}  {lossless}")
        if "tau_ratio_eagle2_over_static" in suite:
            lines.append(f"{name:<10} tau(eagle2)/tau(static) at equal total_tokens = "
                         f"{suite['tau_ratio_eagle2_over_static']:.3f}")
    return "\n".join(lines)


def _num(x: float | None, w: int) -> str:
    return f"{x:>{w}.2f}" if x is not None else f"{'-':>{w}}"


def _pct(part: dict | None, w: int) -> str:
    return f"{100 * part['frac']:>{w}.0f}" if part else f"{'-':>{w}}"


def fmt_bool(x: bool | None) -> str:
    return "n/a" if x is None else str(x).lower()
