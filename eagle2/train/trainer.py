"""The head's training loop: feature regression + a small next-token term.

See docs/training.md "Training a head".

At position t the head gets (feature[t] + noise, embed(token[t+1])) and predicts
feature[t+1]. Loss on masked positions (answer tokens, see `data`):

    SmoothL1(pred[t], feature[t+1])  (mean over H)
    + ce_weight * CE(softmax(lm_head(feature[t+1])), log_softmax(lm_head(pred[t])))

both over the draft vocabulary (the reduced one when `d2t` is set; the target's
distribution is renormalised over it). Top-1 accuracy = the draft's argmax equals the token
that actually follows (token[t+2], the target's own greedy choice in greedy self-distilled
data). AdamW, betas (0.9, 0.95), grad clip 0.5, warm-up then cosine decay; checkpoints
(head + optimizer + step + RNG) every few minutes, atomically, and resume from them.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from eagle2.head import DraftHead, new_head, save_head
from eagle2.train.batches import Batch, collate, epoch_batches
from eagle2.train.data import Sequence, atomic_write, draft_vocab, load_shards


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    warmup: int = 50
    epochs: float = 4.0
    batch_tokens: int = 4096
    noise: float = 0.2  # uniform noise amplitude relative to the feature RMS
    ce_weight: float = 0.1
    checkpoint_seconds: float = 180.0
    max_seconds: float | None = None
    log_every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.epochs <= 0 or self.batch_tokens < 16:
            raise ValueError("epochs must be > 0 and batch_tokens >= 16")
        if self.noise < 0 or self.ce_weight < 0 or self.grad_clip <= 0:
            raise ValueError("noise and ce_weight must be >= 0, grad_clip > 0")


# ----- initialisation ------------------------------------------------------------------------
@torch.no_grad()
def init_from_target(head: DraftHead, target_hf, embed_scale: float = 0.01) -> None:
    """Start as a pass-through: fc copies the feature half (identity) and sees the embedding
    half only faintly; the decoder layer is the target's last one with its two output
    projections (o_proj, down_proj) zeroed, so the residual branches start at zero and the
    head initially predicts feature[t+1] = feature[t]."""
    last = target_hf.model.layers[-1]
    own = head.layers[0].state_dict()
    src = {k: v for k, v in last.state_dict().items() if k in own}
    head.layers[0].load_state_dict(src, strict=False)
    head.layers[0].self_attn.o_proj.weight.zero_()
    head.layers[0].mlp.down_proj.weight.zero_()
    hidden = head.config.hidden_size
    head.fc.weight.zero_()
    head.fc.weight[:, hidden:] = torch.eye(hidden)
    head.fc.weight[:, :hidden].normal_(0.0, embed_scale)
    if head.fc.bias is not None:
        head.fc.bias.zero_()


# ----- the loss ------------------------------------------------------------------------------
@dataclass
class StepStats:
    loss: torch.Tensor
    smooth_l1: float
    ce: float
    acc: float
    count: int


def step_loss(head: DraftHead, embed: torch.nn.Module, lm_weight: torch.Tensor,
              d2t: torch.Tensor | None, batch: Batch, cfg: TrainConfig,
              feature_rms: float, gen: torch.Generator | None = None,
              uniform: torch.Tensor | None = None) -> StepStats:
    """Loss of one padded batch. lm_weight: [Vd, H] draft rows of lm_head (frozen).
    uniform: [B, T-1, H] the noise's U(0, 1) draws (default: drawn from gen here)."""
    feats = batch.features  # [B, T, H]
    inputs = feats[:, :-1]
    if cfg.noise > 0 and head.training:
        u = torch.rand(inputs.shape, generator=gen, device=inputs.device) \
            if uniform is None else uniform
        inputs = inputs + (u - 0.5) * (cfg.noise * feature_rms)
    with torch.no_grad():
        tok_emb = embed(batch.input_ids[:, 1:])  # [B, T-1, H]
    pred = head.forward_train(tok_emb, inputs, (batch.lengths - 1).clamp(min=1))  # [B, T-1, H]
    mask = batch.loss_mask[:, :-1]  # [B, T-1]
    p, f = pred[mask], feats[:, 1:][mask]  # [M, H]
    smooth = F.smooth_l1_loss(p, f, reduction="none").mean(-1).mean()
    logp = torch.log_softmax(p @ lm_weight.T, dim=-1)  # [M, Vd]
    with torch.no_grad():
        target_p = torch.softmax(f @ lm_weight.T, dim=-1)
    ce = -(target_p * logp).sum(-1).mean()
    with torch.no_grad():
        top = logp.argmax(-1)
        top = top if d2t is None else d2t[top]
        nxt = F.pad(batch.input_ids, (0, 1))[:, 2:][mask]  # token[t+2]
        acc = (top == nxt).float().mean().item()
    loss = smooth + cfg.ce_weight * ce
    return StepStats(loss, smooth.item(), ce.item(), acc, int(mask.sum()))


def lr_at(step: int, total: int, cfg) -> float:
    """Linear warm-up, then cosine decay to 10% of lr (cfg: any config with lr and warmup)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


# ----- the loop ------------------------------------------------------------------------------
class Resumable:
    """Checkpoints of a training loop: head, optimizer, step, elapsed time, the noise RNG and
    Python's RNG (+ `_extra_state`), written atomically; resuming also drops log records
    written after the checkpoint; and the optimizer step. Subclasses set head, opt, gen, cfg,
    device, step, elapsed, total_steps, ckpt_path and log_path, and define `train_loss`."""

    is_main = True  # this process logs, evaluates and keeps the best head (data parallel: rank 0)

    def _agree(self, *flags: bool) -> list[bool]:
        """The loop's decisions (checkpoint now, stop now) as every process takes them: one
        process takes its own; data-parallel ranks take rank 0's."""
        return list(flags)

    def _extra_state(self) -> dict:
        return {}

    def _load_extra(self, state: dict) -> None:
        pass

    def save_checkpoint(self) -> None:
        state = {"head": self.head.state_dict(), "opt": self.opt.state_dict(),
                 "step": self.step, "elapsed": self.elapsed, "gen": self.gen.get_state(),
                 "python_rng": random.getstate(), "config": asdict(self.cfg),
                 **self._extra_state()}
        atomic_write(self.ckpt_path, lambda tmp: torch.save(state, tmp))

    def maybe_resume(self) -> bool:
        if not self.ckpt_path.exists():
            return False
        state = torch.load(self.ckpt_path, map_location=self.device, weights_only=False)
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.elapsed = state["step"], state["elapsed"]
        self.gen.set_state(state["gen"].cpu() if self.device.type == "cpu" else state["gen"])
        random.setstate(state["python_rng"])
        self._load_extra(state)
        self._drop_log_after_checkpoint()
        return True

    def _drop_log_after_checkpoint(self) -> None:
        if self.log_path.exists():  # drop records written after the checkpoint
            recs = [json.loads(x) for x in self.log_path.read_text().splitlines() if x]
            keep = "".join(json.dumps(r) + "\n" for r in recs if r["step"] <= self.step)
            atomic_write(self.log_path, lambda tmp: tmp.write_text(keep))

    def _write(self, rec: dict) -> None:
        with self.log_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def train_loss(self):
        """The loss of the batch at self.step (with .loss to backpropagate)."""
        raise NotImplementedError

    def train_step(self):
        """One optimizer step: scheduled lr, backward, grad clip (cfg.grad_clip)."""
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, self.total_steps, self.cfg)
        stats = self.train_loss()
        self.opt.zero_grad(set_to_none=True)
        stats.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        return stats


class Trainer(Resumable):
    """Owns the head, the optimizer, the step counter and the noise RNG; resumable."""

    def __init__(self, head: DraftHead, embed: torch.nn.Module, lm_head: torch.nn.Module,
                 train: list[Sequence], val: list[Sequence], cfg: TrainConfig, out: Path):
        self.head, self.embed, self.cfg, self.out = head.train(), embed, cfg, Path(out)
        self.device = head.fc.weight.device
        weight = lm_head.weight.detach()
        self.d2t = head.d2t.to(self.device) if head.d2t.numel() else None
        self.lm_weight = (weight if self.d2t is None else weight[self.d2t]).float()  # [Vd, H]
        self.train_seqs, self.val_seqs = train, val
        self.lengths = [len(s.input_ids) for s in train]
        self.steps_per_epoch = len(epoch_batches(self.lengths, cfg.batch_tokens, cfg.seed, 0))
        self.total_steps = max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        self.feature_rms = feature_rms(train)
        self.opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=cfg.betas,
                                     weight_decay=cfg.weight_decay)
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.step, self.elapsed = 0, 0.0
        self.out.mkdir(parents=True, exist_ok=True)
        self.ckpt_path = self.out / "checkpoint.pt"
        self.log_path = self.out / "train_log.jsonl"

    # -- steps --
    def batch_at(self, step: int) -> Batch:
        epoch, i = divmod(step, self.steps_per_epoch)
        idx = epoch_batches(self.lengths, self.cfg.batch_tokens, self.cfg.seed, epoch)[i]
        return collate([self.train_seqs[j] for j in idx]).to(self.device)

    def train_loss(self) -> StepStats:
        return step_loss(self.head, self.embed, self.lm_weight, self.d2t,
                         self.batch_at(self.step), self.cfg, self.feature_rms, self.gen)

    @torch.no_grad()
    def evaluate(self, seqs: list[Sequence] | None = None) -> dict[str, float]:
        """Loss and top-1 accuracy without noise, weighted by masked positions."""
        seqs = self.val_seqs if seqs is None else seqs
        self.head.eval()
        totals, count = {"loss": 0.0, "smooth_l1": 0.0, "ce": 0.0, "acc": 0.0}, 0
        lengths = [len(s.input_ids) for s in seqs]
        for idx in epoch_batches(lengths, self.cfg.batch_tokens, 0, 0):
            st = step_loss(self.head, self.embed, self.lm_weight, self.d2t,
                           collate([seqs[j] for j in idx]).to(self.device), self.cfg,
                           self.feature_rms)
            for k, v in (("loss", st.loss.item()), ("smooth_l1", st.smooth_l1),
                         ("ce", st.ce), ("acc", st.acc)):
                totals[k] += v * st.count
            count += st.count
        self.head.train()
        return {k: v / max(count, 1) for k, v in totals.items()}

    def run(self, max_steps: int | None = None) -> dict:
        """Train to the end (or max_steps / max_seconds); checkpoint and log along the way."""
        end = self.total_steps if max_steps is None else min(max_steps, self.total_steps)
        last_ckpt, start = time.time(), time.time() - self.elapsed
        window: list[StepStats] = []
        bar = tqdm(total=end, initial=self.step, desc="train head", unit="step",
                   disable=not self.is_main)
        while self.step < end:
            window.append(self.train_step())
            self.elapsed = time.time() - start
            bar.update(1)
            if self.step % self.cfg.log_every == 0 or self.step == end:
                rec = self._log(window)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['acc']:.3f}")
                window = []
            ckpt, stop = self._agree(
                time.time() - last_ckpt > self.cfg.checkpoint_seconds,
                bool(self.cfg.max_seconds and self.elapsed > self.cfg.max_seconds))
            if ckpt:
                self.save_checkpoint()
                last_ckpt = time.time()
            if stop:
                break
        bar.close()
        self.save_checkpoint()
        val = self.evaluate() if self.val_seqs and self.is_main else {}
        self._write({"step": self.step, "elapsed_s": round(self.elapsed, 1),
                     **{f"val_{k}": round(v, 5) for k, v in val.items()}})
        return {"steps": self.step, "total_steps": self.total_steps,
                "elapsed_s": self.elapsed, "val": val}

    def _log(self, window: list[StepStats]) -> dict:
        n = sum(s.count for s in window) or 1
        rec = {"step": self.step, "epoch": round(self.step / self.steps_per_epoch, 3),
               "lr": lr_at(self.step - 1, self.total_steps, self.cfg),
               "loss": sum(s.loss.item() * s.count for s in window) / n,
               "smooth_l1": sum(s.smooth_l1 * s.count for s in window) / n,
               "ce": sum(s.ce * s.count for s in window) / n,
               "acc": sum(s.acc * s.count for s in window) / n,
               "tokens": n, "elapsed_s": round(self.elapsed, 1)}
        self._write(rec)
        return rec



def feature_rms(seqs: list[Sequence], sample: int = 64) -> float:
    feats = torch.cat([s.features[:256].float() for s in seqs[:sample]])
    return float(feats.pow(2).mean().sqrt())


# ----- the `train` stage of `eagle2 train-head` ----------------------------------------------
def split(seqs: list[Sequence], every: int = 20) -> tuple[list[Sequence], list[Sequence]]:
    """Every `every`-th sequence is held out for validation (none if there are too few)."""
    if len(seqs) < 2 * every:
        return seqs, []
    return ([s for i, s in enumerate(seqs) if i % every],
            [s for i, s in enumerate(seqs) if i % every == 0])


def split_sources(sources: list[list[Sequence]], every: int = 20
                  ) -> tuple[list[Sequence], list[Sequence]]:
    """`split` of each source (a data directory) on its own, so that a data set grown by
    appending chunks to any source keeps every held-out sequence held out: the next head,
    trained from the previous one on more data, is never validated on what that one saw."""
    train, val = [], []
    for seqs in sources:
        t, v = split(seqs, every)
        train += t
        val += v
    return train, val


def evenly_spaced(seqs: list, n: int) -> list:
    """At most n of seqs, evenly spaced (all if n <= 0): a subset of a held-out split is
    still held out, and an evaluation's cost grows with it."""
    if n <= 0 or len(seqs) <= n:
        return seqs
    return [seqs[i * len(seqs) // n] for i in range(n)]


def build_head(target, train: list[Sequence], vocab_size: int, init: str, seed: int):
    d2t = draft_vocab(train, target.config.vocab_size, vocab_size) if vocab_size else None
    head = new_head(target.config, seed=seed, bias=False, draft_vocab=d2t)
    if init == "target":
        init_from_target(head, target.hf)
    return head.to(target.device)


def train_config(args) -> TrainConfig:
    """The EAGLE-1/2 trainer's settings from `eagle2 train-head`'s arguments."""
    return TrainConfig(lr=args.lr, warmup=args.warmup, epochs=args.epochs,
                       batch_tokens=args.batch_tokens, noise=args.noise,
                       ce_weight=args.ce_weight, checkpoint_seconds=60 * args.checkpoint_minutes,
                       max_seconds=60 * args.train_minutes if args.train_minutes else None,
                       log_every=args.log_every, seed=args.seed)


def train_from_args(args, target, root: Path) -> dict:
    from eagle2.train.plot import plot_log

    sources = [load_shards(path) for path in [root, *map(Path, args.extra_data)]]
    if not any(sources):
        raise ValueError(f"no feature shards under {root}; run the 'features' stage first")
    train, val = split_sources(sources)
    cfg = train_config(args)
    head = build_head(target, train, args.draft_vocab, args.init, args.seed)
    trainer = Trainer(head, target.embed, target.lm_head, train, val, cfg, root / "train")
    if trainer.maybe_resume():
        print(f"resumed from step {trainer.step}/{trainer.total_steps}", flush=True)
    summary = trainer.run()
    num_tokens = sum(int(s.loss_mask.sum()) for s in train)
    summary.update(num_sequences=len(train), num_val_sequences=len(val),
                   trained_positions=num_tokens, draft_vocab=args.draft_vocab or None,
                   feature_rms=trainer.feature_rms, config=asdict(cfg))
    save = Path(args.save) if args.save else root / "head"
    save_head(trainer.head.eval(), save)
    (root / "train" / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    plot_log(trainer.log_path, root / "train" / "curves.png")
    print(json.dumps({k: summary[k] for k in ("steps", "elapsed_s", "val")}, default=str))
    return summary
