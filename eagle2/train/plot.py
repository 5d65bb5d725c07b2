"""Training curves of a head run (train_log.jsonl -> PNG), matplotlib with the Agg backend."""

from __future__ import annotations

import json
from pathlib import Path


def plot_log(log_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(x) for x in Path(log_path).read_text().splitlines() if x]
    train = [r for r in recs if "loss" in r]
    val = [r for r in recs if "val_loss" in r]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, key in zip(axes, ("loss", "smooth_l1", "ce", "acc"), strict=True):
        ax.plot([r["step"] for r in train], [r[key] for r in train], label="train")
        if val:
            ax.plot([r["step"] for r in val], [r[f"val_{key}"] for r in val], "o", label="val")
        ax.set_title("top-1 accuracy" if key == "acc" else key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)


def plot_ttt_log(log_path: Path, png_path: Path) -> None:
    """Curves of an EAGLE-3 run: loss, then cross-entropy and top-1 agreement per unrolled
    step (train lines, held-out points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(x) for x in Path(log_path).read_text().splitlines() if x]
    train = [r for r in recs if "loss" in r]
    val = [r for r in recs if "val_loss" in r]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    axes[0].plot([r["step"] for r in val], [r["val_loss"] for r in val], "o", label="val")
    axes[0].set_title("weighted loss")
    for ax, key in zip(axes[1:], ("ce", "acc"), strict=True):
        steps = len(train[0][key]) if train else 0
        for k in range(steps):
            line, = ax.plot([r["step"] for r in train], [r[key][k] for r in train],
                            label=f"step {k}")
            ax.plot([r["step"] for r in val], [r[f"val_{key}"][k] for r in val], "o",
                    color=line.get_color())
        ax.set_title("cross-entropy per step" if key == "ce" else "top-1 agreement per step")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)
