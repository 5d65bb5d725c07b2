"""Data-parallel head training with DeepSpeed: `eagle2 train-head --deepspeed CONFIG`.

See docs/training.md "A head for a target larger than one GPU".

The EAGLE-1/2 trainer (`eagle2.train.trainer`) on stored feature shards, one process per
device, started by `torchrun` (or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT); NCCL on GPUs, gloo on CPUs.

Every optimizer step trains on the batch the single-process trainer trains on at that step
(`Trainer.batch_at`): with R ranks, rank r takes its rows r, r + R, ... E.g. 5 sequences,
2 ranks: rank 0 gets rows [0, 2, 4], rank 1 rows [1, 3]. The loss is a mean over the M masked
positions of the batch, so rank r scales its own mean (over its M_r positions) by
R * M_r / M: DeepSpeed averages the ranks' gradients, and the average is then the gradient of
the whole batch's mean, as in one process. The feature noise is drawn for the whole batch from
the same generator on every rank, and each rank keeps its rows, so the noise matches too.

ZeRO stage 2 (the default) partitions gradients and AdamW states over the ranks; the
parameters stay whole on every rank, so rank 0 evaluates and saves the head. bf16 (default on
GPUs) keeps fp32 master weights in the optimizer and runs the head under bf16 autocast; the
saved head holds the bf16 module weights. DeepSpeed owns the gradient clipping
(`gradient_clipping` = the trainer's grad_clip); the trainer keeps its own AdamW and lr
schedule, so a config must not name an optimizer or scheduler.

Checkpoints are DeepSpeed's (module, each rank's optimizer partition, and the step, elapsed
time and RNG states as client state), one tag a checkpoint; DeepSpeed writes `latest` after
the tag's files, so a kill mid-save resumes from the previous checkpoint. Decisions that all
ranks must take together (checkpoint now, stop at the time box) are rank 0's, broadcast.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from eagle2.head import DraftHead
from eagle2.train.batches import Batch, collate, epoch_batches
from eagle2.train.data import Sequence
from eagle2.train.trainer import StepStats, TrainConfig, Trainer, lr_at, step_loss

# ZeRO stage 2; "auto": bf16 on CUDA, fp32 elsewhere
DEFAULT_CONFIG = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the group, as the launcher (torchrun) set it."""

    rank: int
    world: int
    local_rank: int

    @classmethod
    def from_env(cls) -> DistEnv:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if k not in os.environ]
        if missing:
            raise ValueError(f"--deepspeed needs a launcher's environment ({missing} unset): "
                             "start it with `torchrun --nproc-per-node N eagle2 ...`")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return cls(rank, world, int(os.environ.get("LOCAL_RANK", rank)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_config(spec: str) -> dict:
    """`--deepspeed CONFIG`: a JSON file, or `zero2` for DEFAULT_CONFIG."""
    if spec == "zero2":
        return copy.deepcopy(DEFAULT_CONFIG)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--deepspeed {spec!r}: give a DeepSpeed JSON config file or 'zero2'")
    return json.loads(path.read_text())


def resolve_config(user: dict, cfg: TrainConfig, world: int, cuda: bool) -> dict:
    """The config given to deepspeed.initialize: the user's, with the batch settings this
    trainer implies (one micro-batch a step: our batches are token-packed), its gradient
    clipping, and bf16 "auto" decided."""
    for key in ("optimizer", "scheduler"):
        if key in user:
            raise ValueError(f"the DeepSpeed config names a {key!r}: remove it (the trainer's "
                             "AdamW and warm-up + cosine schedule are used, --lr/--warmup)")
    out = {**copy.deepcopy(DEFAULT_CONFIG), **copy.deepcopy(user)}
    bf16 = out.setdefault("bf16", {})
    if bf16.get("enabled", "auto") == "auto":
        bf16["enabled"] = cuda
    if out.get("fp16", {}).get("enabled"):
        raise ValueError("fp16 (loss scaling) is not supported for head training; use bf16")
    out.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
               train_batch_size=world, gradient_clipping=cfg.grad_clip,
               steps_per_print=2**31 - 1)
    return out


def init_distributed(device: torch.device) -> DistEnv:
    """Join the group (NCCL on CUDA, gloo on CPUs) and return this rank's place in it.

    On CPUs, DeepSpeed's backend would JIT-compile its shared-memory all-reduce at init (C++:
    minutes on a busy machine, ranks queued on a file lock, rebuilt whenever its flags change);
    only `inference_all_reduce` uses it, so it is marked incompatible and skipped: training's
    reductions go through the gloo process group."""
    import deepspeed
    import deepspeed.ops

    env = DistEnv.from_env()
    if device.type == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    return env


def rank_rows(num_rows: int, env: DistEnv) -> torch.Tensor:
    """[<= ceil(B / R)] this rank's rows of a batch: r, r + R, ..."""
    return torch.arange(env.rank, num_rows, env.world)


def select_rows(batch: Batch, rows: torch.Tensor) -> Batch:
    return Batch(batch.input_ids[rows], batch.loss_mask[rows], batch.features[rows],
                 batch.lengths[rows])


class DeepSpeedMixin:
    """A resumable trainer's (`eagle2.train.trainer.Resumable`) optimizer, checkpoints and
    log under a DeepSpeed engine; the host class sets head, opt, gen, cfg, out and device."""

    def _setup_deepspeed(self, ds_config: dict, env: DistEnv) -> None:
        import deepspeed

        self.env = env
        self.bf16 = bool(ds_config["bf16"]["enabled"])
        self.engine, self.opt, _, _ = deepspeed.initialize(
            model=self.head, optimizer=self.opt, config=ds_config)
        self.ckpt_dir = self.out / "deepspeed"

    def _set_lr(self) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.total_steps, self.cfg)

    def _zero(self) -> torch.Tensor:
        """0 with a gradient path to every parameter (each rank reduces every gradient)."""
        return sum(p.sum() for p in self.head.parameters()) * 0.0

    # -- checkpoints: DeepSpeed's, with the trainer's state as client state --
    def save_checkpoint(self) -> None:
        tag = f"step{self.step:08d}"
        client = {"step": self.step, "elapsed": self.elapsed, "gen": self.gen.get_state(),
                  "python_rng": random.getstate(), "config": asdict(self.cfg),
                  **self._extra_state()}
        self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state=client)
        dist.barrier()
        if self.env.is_main:  # `latest` names the new tag now: older ones can go
            for old in self.ckpt_dir.glob("step*"):
                if old.name != tag:
                    shutil.rmtree(old, ignore_errors=True)

    def maybe_resume(self) -> bool:
        if not (self.ckpt_dir / "latest").exists():
            return False
        path, client = self.engine.load_checkpoint(str(self.ckpt_dir))
        assert path is not None, f"unreadable DeepSpeed checkpoint under {self.ckpt_dir}"
        self.step, self.elapsed = client["step"], client["elapsed"]
        gen = client["gen"]
        self.gen.set_state(gen.cpu() if self.device.type == "cpu" else gen)
        random.setstate(client["python_rng"])
        self._load_extra(client)
        if self.env.is_main:
            self._drop_log_after_checkpoint()
        return True

    def _write(self, rec: dict) -> None:
        if self.env.is_main:
            super()._write(rec)

    @property
    def is_main(self) -> bool:
        return self.env.is_main

    def _agree(self, *flags: bool) -> list[bool]:
        """Rank 0's flags on every rank (each rank's clock differs a little)."""
        t = torch.tensor([float(f) for f in flags], device=self.device)
        dist.broadcast(t, src=0)
        return [bool(x) for x in t.tolist()]


class DeepSpeedTrainer(DeepSpeedMixin, Trainer):
    """`Trainer` with its optimizer step, checkpoints and loop run by a DeepSpeed engine."""

    def __init__(self, head: DraftHead, embed: torch.nn.Module, lm_head: torch.nn.Module,
                 train: list[Sequence], val: list[Sequence], cfg: TrainConfig, out: Path,
                 ds_config: dict, env: DistEnv):
        super().__init__(head, embed, lm_head, train, val, cfg, out)
        self._setup_deepspeed(ds_config, env)

    # -- one step: this rank's rows of the single-process batch --
    def _rank_loss(self, full: Batch, uniform: torch.Tensor | None) -> tuple[StepStats, int]:
        rows = rank_rows(full.input_ids.shape[0], self.env)
        part = select_rows(full, rows).to(self.device)
        local = int(part.loss_mask[:, :-1].sum())
        if local == 0:  # no rows or no masked position: a zero gradient, still all-reduced
            return StepStats(self._zero(), 0.0, 0.0, 0.0, 0), 0
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            stats = step_loss(self.head, self.embed, self.lm_weight, self.d2t, part, self.cfg,
                              self.feature_rms, uniform=None if uniform is None
                              else uniform[rows.to(self.device)])
        return stats, local

    def train_step(self) -> StepStats:
        self._set_lr()
        full = self.batch_at(self.step, device="cpu")
        uniform = None
        if self.cfg.noise > 0:  # the whole batch's draws, as one process draws them
            shape = (*full.features.shape[:1], full.features.shape[1] - 1,
                     full.features.shape[2])
            uniform = torch.rand(shape, generator=self.gen, device=self.device)
        stats, local = self._rank_loss(full, uniform)
        sums = torch.tensor([stats.loss.item() * local, stats.smooth_l1 * local,
                             stats.ce * local, stats.acc * local, local],
                            dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        total = int(sums[4])
        self.engine.backward(stats.loss * (self.env.world * local / max(total, 1)))
        self.engine.step()
        self.step += 1
        mean = (sums[:4] / max(total, 1)).tolist()
        return StepStats(torch.tensor(mean[0]), mean[1], mean[2], mean[3], total)

    def batch_at(self, step: int, device: torch.device | str | None = None) -> Batch:
        epoch, i = divmod(step, self.steps_per_epoch)
        idx = epoch_batches(self.lengths, self.cfg.batch_tokens, self.cfg.seed, epoch)[i]
        return collate([self.train_seqs[j] for j in idx]).to(device or self.device)

    @torch.no_grad()
    def evaluate(self, seqs: list[Sequence] | None = None) -> dict[str, float]:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            return super().evaluate(seqs)

    def run(self, max_steps: int | None = None) -> dict:
        return {**super().run(max_steps), "world_size": self.env.world}

def train_deepspeed_from_args(args, root: Path) -> dict:
    """The `train` stage under `--deepspeed`: every rank reads the shards, the target's
    embedding and lm_head only (never its decoder layers), and trains its share."""
    from transformers import AutoConfig

    from eagle2.devices import pick_device
    from eagle2.head import new_head, save_head
    from eagle2.target import embedded_model_dir, load_vocab_modules
    from eagle2.train.data import draft_vocab, load_shards
    from eagle2.train.plot import plot_log
    from eagle2.train.trainer import split_sources, train_config

    if args.init != "random":
        raise ValueError("--deepspeed trains from --init random (the target's decoder "
                         "layers are not loaded)")
    device = pick_device(args.device)
    env = init_distributed(device)
    if device.type == "cuda":
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    # mapped, not read: a 70B target's features outgrow the host's memory (~16 KB a token)
    sources = [load_shards(path, mmap=True) for path in [root, *map(Path, args.extra_data)]]
    if not any(sources):
        raise ValueError(f"no feature shards under {root}; run the 'features' stage first")
    train, val = split_sources(sources)
    cfg = train_config(args)
    target_config = AutoConfig.from_pretrained(args.target or embedded_model_dir())
    embed, lm_head = load_vocab_modules(args.target, dtype=torch.float32, device=str(device))
    d2t = draft_vocab(train, target_config.vocab_size, args.draft_vocab) \
        if args.draft_vocab else None
    head = new_head(target_config, seed=args.seed, bias=False, draft_vocab=d2t).to(device)
    ds_config = resolve_config(read_config(args.deepspeed), cfg, env.world,
                               device.type == "cuda")
    trainer = DeepSpeedTrainer(head, embed, lm_head, train, val, cfg, root / "train",
                               ds_config, env)
    if trainer.maybe_resume():
        print(f"rank {env.rank}: resumed from step {trainer.step}/{trainer.total_steps}",
              flush=True)
    summary = trainer.run()
    if env.is_main:
        summary.update(num_sequences=len(train), num_val_sequences=len(val),
                       trained_positions=sum(int(s.loss_mask.sum()) for s in train),
                       draft_vocab=args.draft_vocab or None, feature_rms=trainer.feature_rms,
                       config=asdict(cfg), deepspeed=ds_config)
        save = Path(args.save) if args.save else root / "head"
        save_head(copy.deepcopy(trainer.head).float().eval(), save)
        (root / "train" / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        plot_log(trainer.log_path, root / "train" / "curves.png")
        print(json.dumps({k: summary[k] for k in ("steps", "elapsed_s", "val")}, default=str))
    dist.barrier()
    return summary
