"""Acceptance per depth of two draft heads from `benchmarks/head_eval.sh`-style JSONs (the
26-token tree head alone, dynamic and static, and with lookup): one panel per suite, the
fraction of verification steps that accept >= d draft tokens, log scale.

    .venv/bin/python benchmarks/plot_head_depth.py OUT.png \
        v6:benchmarks/head-v6-{}-xeon-amx-s34.json v7:benchmarks/head-v7-{}-xeon-amx-s34.json

Each NAME:PATTERN names a head and its JSONs, `{}` standing for tree26 / tree26-lookup.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

CURVES = (("tree26", "eagle2", "dynamic, head alone", "C0"),
          ("tree26", "static", "static, head alone", "C1"),
          ("tree26-lookup", "eagle2", "dynamic + lookup", "C2"))


def main() -> None:
    out, heads = sys.argv[1], [arg.split(":", 1) for arg in sys.argv[2:]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, suite in zip(axes, ("mt_bench", "humaneval"), strict=True):
        for i, (name, pattern) in enumerate(heads):
            style = "-" if i == len(heads) - 1 else "--"
            for tree, mode, label, color in CURVES:
                with open(pattern.format(tree)) as f:
                    acc = json.load(f)["suites"][suite]["modes"][mode]["acceptance_by_depth"]
                ax.plot(range(1, len(acc) + 1), acc, style, color=color, marker="o", ms=3,
                        label=f"{name} {label}")
        ax.set_title(f"{suite}: 26-token tree (depth 5, top_k 8), T = 0")
        ax.set_xlabel("depth d")
        ax.set_ylabel("fraction of steps accepting >= d draft tokens")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


if __name__ == "__main__":
    main()
