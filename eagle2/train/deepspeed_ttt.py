"""The training-time test, data-parallel with DeepSpeed: `eagle2 train-head --deepspeed CONFIG
--arch eagle3` (or `--ttt`).

See docs/training.md "A head for a target larger than one GPU" and `eagle2.train.ttt`.

As `eagle2.train.deepspeed_train` does for the EAGLE-1/2 trainer: each step trains the
single-process batch, rank r its rows r, r + R, ... (padded as in the whole batch), with the
whole batch's noise. Every rank runs the target on its own rows (the target is loaded whole
on every rank: a target that fits one device). The loss is a sum over unrolled steps of mean
cross-entropies with different counts M_k a step, so each rank divides its step-k sum by
M_k / R (M_k all-reduced first, from the target's argmax): DeepSpeed's average of the ranks'
gradients is then the whole batch's. Rank 0 evaluates on the held-out split, keeps the best
head and decides early stopping; every rank follows its decisions.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from eagle2.train.data import atomic_write
from eagle2.train.deepspeed_train import DeepSpeedMixin, DistEnv, rank_rows
from eagle2.train.ttt import (
    Batch,
    StepStats,
    TTTConfig,
    TTTTrainer,
    step_mask,
    unrolled_loss,
)
from eagle2.train.ttt_stored import StoredTTTMixin


class DeepSpeedTTTTrainer(DeepSpeedMixin, TTTTrainer):
    def __init__(self, head, target, train, val, cfg: TTTConfig, out: Path, ds_config: dict,
                 env: DistEnv):
        super().__init__(head, target, train, val, cfg, out)
        self._setup_deepspeed(ds_config, env)
        self.bf16 = self.bf16 or bool(ds_config["bf16"]["enabled"])

    def _counts(self, part: Batch, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """(this rank's, all ranks') trained positions per unrolled step."""
        top = self.t2d[logits.argmax(-1)]
        valid = torch.arange(part.input_ids.shape[1], device=self.device)[None] \
            < part.lengths[:, None]
        local = [int(step_mask(part, top, valid, k)[0].sum()) for k in range(self.cfg.steps)]
        return local, self._all_counts(local)

    def train_step(self) -> StepStats:
        self._set_lr()
        full = self.batch_at(self.step)
        rows = rank_rows(full.input_ids.shape[0], self.env).to(self.device)
        part = self.rows(full, rows)
        world, steps = self.env.world, self.cfg.steps
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            feats, logits = self.target_outputs(part) if len(rows) else (None, None)
            uniform = None
            if self.cfg.noise > 0:  # the whole batch's draws, as one process draws them
                width = len(self.layers or (0,)) * self.target.config.hidden_size
                shape = (*full.input_ids.shape, width)
                uniform = torch.rand(shape, generator=self.gen, device=self.device)[rows]
            if len(rows):
                local, total = self._counts(part, logits)
                weight = self.head.lm_head.weight if self.frozen_weight is None else \
                    self.frozen_weight
                stats = unrolled_loss(self.head, self.target.embed, part, feats, logits,
                                      self.cfg, self.t2d, weight, self.feature_rms,
                                      uniform=uniform,
                                      denominators=[max(n, 1) / world for n in total])
            else:
                local, total = [0] * steps, self._all_counts([0] * steps)
                stats = StepStats(torch.zeros((), device=self.device), [0.0] * steps,
                                  [0.0] * steps, [0] * steps)
        self.engine.backward(stats.loss + self._zero())
        self.engine.step()
        self.step += 1
        return self._global_stats(stats, local, total)

    def _all_counts(self, local: list[int]) -> list[int]:
        total = torch.tensor(local, dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return [int(x) for x in total.tolist()]

    def _global_stats(self, stats: StepStats, local: list[int], total: list[int]) -> StepStats:
        """The whole batch's loss and per-step means (what one process would log)."""
        steps = self.cfg.steps
        sums = torch.tensor([float(stats.loss.detach()),
                             *[c * n for c, n in zip(stats.ce, local, strict=True)],
                             *[a * n for a, n in zip(stats.acc, local, strict=True)]],
                            dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        sums = sums.tolist()
        ce = [sums[1 + k] / max(total[k], 1) for k in range(steps)]
        acc = [sums[1 + steps + k] / max(total[k], 1) for k in range(steps)]
        return StepStats(torch.tensor(sums[0] / self.env.world), ce, acc, total)

    # -- evaluation and early stopping: rank 0 decides --
    def _eval_and_keep_best(self) -> bool:
        improved = stop = False
        if self.env.is_main:
            val = self.evaluate()
            self._write({"step": self.step, "elapsed_s": round(self.elapsed, 1),
                         "val_loss": val["loss"], "val_ce": val["ce"], "val_acc": val["acc"]})
            improved = val["loss"] < self.best
            if improved:
                self.best, self.bad_evals, self.best_val = val["loss"], 0, val
                state = self.head.state_dict()
                atomic_write(self.best_path, lambda tmp: torch.save(state, tmp))
            else:
                self.bad_evals += 1
                stop = self.bad_evals >= self.cfg.patience
        improved, stop = self._agree(improved, stop)
        if improved:
            self.save_checkpoint()  # best.pt and the checkpoint's best stay one pair
        return stop

    def run(self) -> dict:
        return {**super().run(), "world_size": self.env.world}

class DeepSpeedStoredTTTTrainer(StoredTTTMixin, DeepSpeedTTTTrainer):
    """The training-time test on the shards (`eagle2.train.ttt_stored`), data-parallel."""


def train_ttt_deepspeed_from_args(args, root: Path, load_target) -> dict:
    """The train stage under `--deepspeed` with the training-time test: every rank loads the
    target (`load_target(args)`) on its device and trains its share of each batch."""
    import argparse

    from eagle2.devices import pick_device
    from eagle2.train.deepspeed_train import init_distributed, read_config, resolve_config
    from eagle2.train.ttt import train_ttt_from_args

    device = pick_device(args.device)
    env = init_distributed(device)
    if device.type == "cuda":
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    args = argparse.Namespace(**{**vars(args), "device": str(device)})
    target = load_target(args)

    def make_trainer(head, target, train, val, cfg, out) -> DeepSpeedTTTTrainer:
        ds_config = resolve_config(read_config(args.deepspeed), cfg, env.world,
                                   device.type == "cuda")
        cls = DeepSpeedStoredTTTTrainer if args.stored_features else DeepSpeedTTTTrainer
        return cls(head, target, train, val, cfg, out, ds_config, env)

    summary = train_ttt_from_args(args, target, root, make_trainer)
    dist.barrier()
    return summary
