"""Training a head with the training-time test (docs/training.md "Training a head").

Written for EAGLE-3 heads; EAGLE-1/2 heads train the same way (their step feature is the
target's final hidden state, then their own predicted feature; fc mixes it with the
embedding at every step; draft logits through the target's frozen lm_head rows), which lets
an existing head be fine-tuned for depth (`--init-head`).

The head is unrolled for `cfg.steps` draft steps over whole sequences, as it runs when it
drafts a tree: step 0 reads the target's three-layer features; step k >= 1 reads the head's
own output of step k - 1 at the same position (g'), with the token inputs shifted by k (the
ground truth stays the input: only the feature is the head's own). At step k a query at
position t attends to the step-0 keys at positions <= t (the committed prefix) and to the keys
of steps 1..k at position t only (its ancestors in a tree and itself); RoPE position t + k.

Targets: the target's own next-token distribution (soft targets), restricted to the draft
vocabulary and renormalised; positions whose target argmax lies outside the draft vocabulary
are not trained. Loss = sum_k decay^k * CE_k over answer positions. The target forward that
gives features and soft targets runs online per batch (frozen, no grad): storing 3H fp16
features would take 3.4 KB per token (8.6 GB for 2.5M tokens), and the forward costs about a
third of an unrolled step. Feature noise: uniform, relative to the feature RMS, at step 0.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eagle2.eagle3 import Eagle3Head, new_eagle3_head
from eagle2.head import DraftHead
from eagle2.train.batches import epoch_batches
from eagle2.train.data import Sequence, atomic_write, draft_vocab, loss_mask
from eagle2.train.trainer import Resumable, evenly_spaced, lr_at, split_sources


@dataclass(frozen=True)
class TTTConfig:
    steps: int = 4  # unrolled draft steps (the reference uses 7)
    decay: float = 0.8  # weight of step k: decay ** k
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    warmup: int = 50
    epochs: float = 2.0
    batch_tokens: int = 2048
    noise: float = 0.05  # uniform noise amplitude relative to the feature RMS (step 0)
    eval_every: int = 200  # steps between held-out evaluations (early stopping)
    eval_first: bool = False  # evaluate the initial head too (a fine-tune: it may stay best)
    patience: int = 3  # evaluations without improvement before stopping
    checkpoint_seconds: float = 180.0
    max_seconds: float | None = None
    log_every: int = 10
    seed: int = 0
    # bf16 autocast of the target pass and the head's matmuls: "auto" = on CUDA, and on CPUs
    # with native bf16 matmuls (AMX or AVX512-BF16: ~2x faster steps measured); "on", "off"
    bf16: str = "auto"

    def __post_init__(self) -> None:
        if self.bf16 not in ("auto", "on", "off"):
            raise ValueError(f"bf16 must be auto, on or off, got {self.bf16!r}")
        if self.steps < 1 or not 0 < self.decay <= 1:
            raise ValueError("steps must be >= 1 and decay in (0, 1]")
        if not self.lr > 0 or self.epochs <= 0 or self.batch_tokens < 16:
            raise ValueError("lr and epochs must be > 0, batch_tokens >= 16")


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right-padded
    loss_mask: torch.Tensor  # [B, T] bool: position t trains the prediction of token t + 2
    lengths: torch.Tensor  # [B]

    def to(self, device) -> Batch:
        return Batch(self.input_ids.to(device), self.loss_mask.to(device),
                     self.lengths.to(device))


def collate(seqs: list[Sequence]) -> Batch:
    lengths = torch.tensor([len(s.input_ids) for s in seqs])
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, :len(s.input_ids)], mask[b, :len(s.input_ids)] = s.input_ids, s.loss_mask
    return Batch(ids, mask, lengths)


def conversation_sequences(root: Path, max_len: int = 2048) -> list[Sequence]:
    """Token ids and loss masks of the self-distilled conversations (no stored features)."""
    from eagle2.train.data import load_conversations

    out = []
    for rec in load_conversations(root):
        ids = (rec["prompt_ids"] + rec["answer_ids"])[:max_len]
        out.append(Sequence(torch.tensor(ids), loss_mask(len(rec["prompt_ids"]), len(ids)),
                            None))
    return out


@torch.no_grad()
def target_pass(hf_model, batch: Batch, layers: tuple[int, ...] | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (features, target logits [B, T, V] fp32). Features: the inputs of `layers`
    concatenated [B, T, 3H] (EAGLE-3), or the last hidden state after the final norm
    [B, T, H] when layers is None (EAGLE-1/2)."""
    attn = (torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)[None]
            < batch.lengths[:, None]).long()
    out = hf_model.model(input_ids=batch.input_ids, attention_mask=attn,
                         output_hidden_states=layers is not None)
    logits = hf_model.lm_head(out.last_hidden_state)
    if layers is None:
        return out.last_hidden_state.float(), logits.float()
    feats = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
    return feats.float(), logits.float()


def _first_feature(head, feats: torch.Tensor) -> torch.Tensor:
    """Step 0's feature: fc(three layers) for EAGLE-3; the target's feature for EAGLE-1/2
    (its fc mixes feature and embedding at every step)."""
    feats = feats.to(head.fc.weight.dtype)
    return head.fc(feats) if head.kind == "eagle3" else feats


def _layer_input(head, emb: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention input, residual) of the head's decoder layer for embedding + feature."""
    if head.kind == "eagle3":
        layer = head.midlayer
        return torch.cat([layer.input_layernorm(emb), layer.hidden_norm(g)], dim=-1), g
    x = head.fuse(emb, g)  # EAGLE-1/2: fc(cat(embed, feature)), no input norm
    return x, x


def _decoder(head):
    return head.midlayer if head.kind == "eagle3" else head.layers[0]


@dataclass
class StepStats:
    loss: torch.Tensor
    ce: list[float]  # per unrolled step
    acc: list[float]  # per unrolled step: draft argmax == target argmax
    count: list[int]  # trained positions per step
    extra: dict = field(default_factory=dict)


def unroll(head: DraftHead | Eagle3Head, embed: torch.nn.Module, input_ids: torch.Tensor,
           lengths: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's outputs [B, T, H] for each unrolled step (see the module doc).

    input_ids: [B, T]; feats: [B, T, F] the target's features at every position (F = 3H for
    an EAGLE-3 head, H for EAGLE-1/2). Step k at position t reads token[t + 1 + k] and
    (k >= 1) the step k - 1 output at t."""
    num_b, num_t = input_ids.shape
    device = feats.device
    layer = _decoder(head)
    attn = layer.self_attn
    dh = head.head_dim
    num_heads, num_kv = head.config.num_attention_heads, head.config.num_key_value_heads
    groups = num_heads // num_kv
    g = _first_feature(head, feats)  # [B, T, H]
    ids = F.pad(input_ids, (0, steps + 1))  # token[t + 1 + k] exists for every k
    causal = torch.tril(torch.ones(num_t, num_t, dtype=torch.bool, device=device))
    keys0 = values0 = None
    side_k: list[torch.Tensor] = []  # per later step: [B, KVH, T, Dh]
    side_v: list[torch.Tensor] = []
    outs = []
    for k in range(steps):
        with torch.no_grad():  # the target's embedding is frozen
            emb = embed(ids[:, 1 + k:1 + k + num_t]).to(g.dtype)  # token[t + 1 + k]
        h, residual = _layer_input(head, emb, g)
        q = attn.q_proj(h).view(num_b, num_t, num_heads, dh).transpose(1, 2)
        key = attn.k_proj(h).view(num_b, num_t, num_kv, dh).transpose(1, 2)
        val = attn.v_proj(h).view(num_b, num_t, num_kv, dh).transpose(1, 2)
        pos = (torch.arange(num_t, device=device) + k)[None].expand(num_b, num_t)
        cos, sin = head.rotary(h, pos)
        q, key = apply_rotary_pos_emb(q, key, cos, sin)
        if k == 0:
            keys0, values0 = key, val
        else:
            side_k.append(key)
            side_v.append(val)
        qg = q.view(num_b, num_kv, groups, num_t, dh)
        s0 = torch.einsum("bkgtd,bksd->bkgts", qg, keys0) / math.sqrt(dh)
        s0 = s0.masked_fill(~causal, float("-inf"))
        sides = [torch.einsum("bkgtd,bktd->bkgt", qg, sk)[..., None] / math.sqrt(dh)
                 for sk in side_k]  # each [B, KVH, G, T, 1]
        w = torch.softmax(torch.cat([s0, *sides], dim=-1), dim=-1)
        out = torch.einsum("bkgts,bksd->bkgtd", w[..., :num_t], values0)
        for j, sv in enumerate(side_v):
            out = out + w[..., num_t + j:num_t + j + 1] * sv[:, :, None]
        out = out.reshape(num_b, num_heads, num_t, dh).transpose(1, 2).reshape(num_b, num_t, -1)
        x = residual + attn.o_proj(out)
        g = x + layer.mlp(layer.post_attention_layernorm(x))  # the output of step k
        outs.append(g)
    return outs


def step_mask(batch: Batch, top: torch.Tensor, valid: torch.Tensor, k: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, tgt_top), both [B, T]: the positions step k trains (answer positions whose
    target argmax lies in the draft vocabulary) and that argmax's draft index. Step k at
    position t predicts token[t + 2 + k]: the target's logits at t + 1 + k. top: [B, T] the
    draft index of the target's argmax (-1 outside); valid: [B, T] not padding."""
    tgt_top = F.pad(top[:, 1 + k:], (0, 1 + k), value=-1)
    return F.pad(batch.loss_mask[:, k:], (0, k)) & valid & (tgt_top >= 0), tgt_top


def unrolled_loss(head: DraftHead | Eagle3Head, embed: torch.nn.Module, batch: Batch,
                  feats: torch.Tensor, logits: torch.Tensor, cfg: TTTConfig, t2d: torch.Tensor,
                  lm_weight: torch.Tensor, feature_rms: float = 1.0,
                  gen: torch.Generator | None = None, uniform: torch.Tensor | None = None,
                  denominators: list[float] | None = None) -> StepStats:
    """The training-time test over one batch (see the module doc).

    feats: target features at every position; logits: [B, T, V] the target's. t2d: [V] long,
    the draft index of each target token (-1 outside the draft vocabulary). lm_weight: [Vd, H]
    the draft logits' matrix (`head.output_weight`: the head's own or the target's rows).
    uniform: [B, T, F] the noise's U(0, 1) draws (default: drawn from gen). denominators: per
    step, what its summed cross-entropy is divided by in the loss (default: its count here,
    a mean; data-parallel ranks give the whole batch's count / ranks)."""
    num_t = batch.input_ids.shape[1]
    device = feats.device
    if cfg.noise > 0 and head.training:
        u = torch.rand(feats.shape, generator=gen, device=device) if uniform is None else uniform
        feats = feats + (u - 0.5) * (cfg.noise * feature_rms)
    outs = unroll(head, embed, batch.input_ids, batch.lengths, feats, cfg.steps)
    valid = torch.arange(num_t, device=device)[None] < batch.lengths[:, None]
    total = torch.zeros((), device=device)
    stats = StepStats(total, [], [], [])
    draft_ids = draft_vocabulary(head, logits.shape[-1]).to(device)
    with torch.no_grad():  # once per batch: the full-vocabulary tensors are large
        top = t2d[logits.argmax(-1)]  # [B, T] draft index of the target's argmax, -1 outside
        probs = torch.softmax(logits[..., draft_ids], dim=-1)  # [B, T, Vd] renormalised
    for k, g in enumerate(outs):
        mask, tgt_top = step_mask(batch, top, valid, k)
        if not mask.any():
            stats.ce.append(0.0)
            stats.acc.append(0.0)
            stats.count.append(0)
            continue
        rows, cols = mask.nonzero(as_tuple=True)
        p = probs[rows, cols + 1 + k]  # [M, Vd]
        draft_logits = head.pre_logits(g[rows, cols]) @ lm_weight.T  # [M, Vd]
        logp = torch.log_softmax(draft_logits.float(), dim=-1)
        ce_rows = -(p * logp).sum(-1)  # [M]
        ce = ce_rows.mean()
        total = total + cfg.decay ** k * (ce if denominators is None
                                          else ce_rows.sum() / denominators[k])
        with torch.no_grad():
            acc = (logp.argmax(-1) == tgt_top[rows, cols]).float().mean().item()
        stats.ce.append(ce.item())
        stats.acc.append(acc)
        stats.count.append(int(mask.sum()))
    stats.loss = total
    return stats


def use_bf16(setting: str, device: torch.device) -> bool:
    if setting != "auto":
        return setting == "on"
    if device.type == "cuda":
        return True
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_amx_tile_supported", lambda: False)()
                or getattr(cpu, "_is_avx512_bf16_supported", lambda: False)())


def draft_vocabulary(head, vocab_size: int) -> torch.Tensor:
    """Target ids of the head's draft vocabulary (all of them for a full-vocabulary head)."""
    return head.d2t if head.d2t.numel() else torch.arange(vocab_size)


class TTTTrainer(Resumable):
    """Head + optimizer + step counter + RNGs; resumable; keeps the best head on held-out
    data and stops early when it stops improving."""

    def __init__(self, head: DraftHead | Eagle3Head, target, train: list[Sequence],
                 val: list[Sequence], cfg: TTTConfig, out: Path):
        self.head, self.target, self.cfg, self.out = head.train(), target, cfg, Path(out)
        self.device = head.fc.weight.device
        self.layers = head.feature_layers(target.num_layers)
        vocab = target.config.vocab_size
        ids = draft_vocabulary(head, vocab).to(self.device)
        self.t2d = torch.full((vocab,), -1, dtype=torch.long, device=self.device)
        self.t2d[ids] = torch.arange(ids.numel(), device=self.device)
        # the draft logits' matrix: trained with an EAGLE-3 head (its own lm_head), the
        # target's frozen rows for EAGLE-1/2
        self.frozen_weight = None if head.kind == "eagle3" else \
            head.output_weight(target.lm_head).to(self.device).float()
        self.train_seqs, self.val_seqs = train, val
        self.lengths = [len(s.input_ids) for s in train]
        self.steps_per_epoch = len(epoch_batches(self.lengths, cfg.batch_tokens, cfg.seed, 0))
        self.total_steps = max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        self.opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=cfg.betas,
                                     weight_decay=0.0)
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.step, self.elapsed = 0, 0.0
        self.best, self.bad_evals, self.best_val = float("inf"), 0, {}
        self.bf16 = use_bf16(cfg.bf16, self.device)
        self.feature_rms = self._feature_rms()
        self.out.mkdir(parents=True, exist_ok=True)
        self.ckpt_path = self.out / "checkpoint.pt"
        self.best_path = self.out / "best.pt"
        self.log_path = self.out / "train_log.jsonl"

    def _feature_rms(self) -> float:
        batch = self.collate(self.train_seqs[:8]).to(self.device)
        feats, _ = self.target_outputs(batch)
        valid = torch.arange(feats.shape[1], device=self.device)[None] < batch.lengths[:, None]
        return float(feats[valid].pow(2).mean().sqrt())

    # -- checkpoints (eagle2.train.trainer.Resumable) --
    def _extra_state(self) -> dict:
        return {"best": self.best, "bad_evals": self.bad_evals, "best_val": self.best_val}

    def _load_extra(self, state: dict) -> None:
        self.best, self.bad_evals = state["best"], state["bad_evals"]
        self.best_val = state.get("best_val", {})

    # -- steps --
    def batch_at(self, step: int) -> Batch:
        epoch, i = divmod(step, self.steps_per_epoch)
        idx = epoch_batches(self.lengths, self.cfg.batch_tokens, self.cfg.seed, epoch)[i]
        return self.collate([self.train_seqs[j] for j in idx]).to(self.device)

    # -- where the target's features and logits come from (`ttt_stored`: the shards) --
    def collate(self, seqs: list[Sequence]) -> Batch:
        return collate(seqs)

    def rows(self, batch: Batch, rows: torch.Tensor) -> Batch:
        """The batch's rows `rows` (a data-parallel rank's share), padded as before."""
        return Batch(batch.input_ids[rows], batch.loss_mask[rows], batch.lengths[rows])

    def target_outputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, logits) of `target_pass`: the target run on the batch."""
        return target_pass(self.target.hf, batch, self.layers)

    def loss(self, batch: Batch, gen: torch.Generator | None = None) -> StepStats:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            feats, logits = self.target_outputs(batch)
            weight = self.head.lm_head.weight if self.frozen_weight is None else \
                self.frozen_weight
            return unrolled_loss(self.head, self.target.embed, batch, feats, logits, self.cfg,
                                 self.t2d, weight, self.feature_rms, gen)

    def train_loss(self) -> StepStats:
        return self.loss(self.batch_at(self.step), self.gen)

    @torch.no_grad()
    def evaluate(self, seqs: list[Sequence] | None = None) -> dict:
        """Held-out loss and per-step top-1 agreement with the target (no noise)."""
        seqs = self.val_seqs if seqs is None else seqs
        self.head.eval()
        steps = self.cfg.steps
        ce, acc, count, loss = [0.0] * steps, [0.0] * steps, [0] * steps, 0.0
        lengths = [len(s.input_ids) for s in seqs]
        for idx in epoch_batches(lengths, self.cfg.batch_tokens, 0, 0):
            st = self.loss(self.collate([seqs[j] for j in idx]).to(self.device))
            for k in range(steps):
                ce[k] += st.ce[k] * st.count[k]
                acc[k] += st.acc[k] * st.count[k]
                count[k] += st.count[k]
            loss += float(st.loss) * st.count[0]
        self.head.train()
        n0 = max(count[0], 1)
        return {"loss": loss / n0, "ce": [c / max(n, 1) for c, n in zip(ce, count, strict=True)],
                "acc": [a / max(n, 1) for a, n in zip(acc, count, strict=True)]}

    def run(self) -> dict:
        cfg = self.cfg
        last_ckpt, start = time.time(), time.time() - self.elapsed
        window: list[StepStats] = []
        if cfg.eval_first and self.val_seqs and self.step == 0 and not self.best_path.exists():
            self._eval_and_keep_best()  # the log's "before" row; a worse fine-tune loses to it
        while self.step < self.total_steps:
            window.append(self.train_step())
            self.elapsed = time.time() - start
            if self.step % cfg.log_every == 0:
                self._log(window)
                window = []
            if self.val_seqs and self.step % cfg.eval_every == 0 and self._eval_and_keep_best():
                break
            ckpt, stop = self._agree(time.time() - last_ckpt > cfg.checkpoint_seconds,
                                     bool(cfg.max_seconds and self.elapsed > cfg.max_seconds))
            if ckpt:
                self.save_checkpoint()
                last_ckpt = time.time()
            if stop:
                break
        if self.val_seqs and self.step % cfg.eval_every:
            self._eval_and_keep_best()
        self.save_checkpoint()
        if self.is_main and self.best_path.exists():
            self.head.load_state_dict(torch.load(self.best_path, map_location=self.device))
        # the best head's evaluation is known (an evaluation costs minutes on a CPU)
        val = self.best_val or (self.evaluate() if self.val_seqs and self.is_main else {})
        return {"steps": self.step, "total_steps": self.total_steps, "elapsed_s": self.elapsed,
                "val": val, "best_val_loss": self.best}

    def _eval_and_keep_best(self) -> bool:
        """Evaluate; keep the head if it is the best so far. True: stop (no improvement for
        `patience` evaluations)."""
        val = self.evaluate()
        self._write({"step": self.step, "elapsed_s": round(self.elapsed, 1),
                     "val_loss": val["loss"], "val_ce": val["ce"], "val_acc": val["acc"]})
        if val["loss"] < self.best:
            self.best, self.bad_evals, self.best_val = val["loss"], 0, val
            state = self.head.state_dict()
            atomic_write(self.best_path, lambda tmp: torch.save(state, tmp))
            self.save_checkpoint()  # best.pt and the checkpoint's best stay one pair
            return False
        self.bad_evals += 1
        return self.bad_evals >= self.cfg.patience

    def _log(self, window: list[StepStats]) -> None:
        steps = self.cfg.steps
        n = [sum(s.count[k] for s in window) or 1 for k in range(steps)]
        self._write({
            "step": self.step, "epoch": round(self.step / self.steps_per_epoch, 3),
            "lr": lr_at(self.step - 1, self.total_steps, self.cfg),
            "loss": sum(float(s.loss.detach()) for s in window) / len(window),
            "ce": [sum(s.ce[k] * s.count[k] for s in window) / n[k] for k in range(steps)],
            "acc": [sum(s.acc[k] * s.count[k] for s in window) / n[k] for k in range(steps)],
            "tokens": n[0], "elapsed_s": round(self.elapsed, 1)})

    def _write(self, rec: dict) -> None:
        super()._write(rec)
        print(json.dumps(rec), flush=True)


def build_eagle3_head(target, train: list[Sequence], vocab_size: int, seed: int,
                      aux_layer_ids: tuple[int, ...] | None = None) -> Eagle3Head:
    """A new head with the `vocab_size` most frequent answer tokens as its draft vocabulary
    (the full target vocabulary if 0), its lm_head rows and norm started from the target's."""
    vocab = target.config.vocab_size
    d2t = draft_vocab(train, vocab, vocab_size) if vocab_size else torch.arange(vocab)
    head = new_eagle3_head(target.config, d2t, seed=seed, aux_layer_ids=aux_layer_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight.detach()[d2t].float())
        head.norm.weight.copy_(target.norm.weight.detach().float())
    return head.to(target.device)


def train_ttt_from_args(args, target, root: Path, make_trainer=TTTTrainer) -> dict:
    """The `train` stage of `eagle2 train-head --arch eagle3` (or `--ttt`): conversations of
    OUT and --extra-data -> split -> TTT training -> the head saved in the published layout.
    make_trainer: (head, target, train, val, cfg, out) -> the trainer (data-parallel ranks:
    `eagle2.train.deepspeed_ttt`; only rank 0 writes the head and summary)."""
    from eagle2.head import save_head
    from eagle2.train.plot import plot_ttt_log

    if getattr(args, "stored_features", False):  # the features stage's shards, mapped
        from eagle2.train.data import load_shards

        sources = [load_shards(path, mmap=True) for path in [root, *map(Path, args.extra_data)]]
    else:
        sources = [conversation_sequences(path, args.max_len)
                   for path in [root, *map(Path, args.extra_data)]]
    if not any(sources):
        raise ValueError(f"no conversations (or shards) under {root}; run the 'data' "
                         "(and 'features') stage first")
    train, val = split_sources(sources)
    val = evenly_spaced(val, args.val_sequences)
    cfg = TTTConfig(steps=args.ttt_steps, lr=args.lr, warmup=args.warmup, epochs=args.epochs,
                    batch_tokens=args.batch_tokens, noise=args.noise,
                    eval_every=args.eval_every, eval_first=bool(args.init_head),
                    patience=args.patience, bf16=args.bf16,
                    checkpoint_seconds=60 * args.checkpoint_minutes,
                    max_seconds=60 * args.train_minutes if args.train_minutes else None,
                    log_every=args.log_every, seed=args.seed)
    if args.init_head:  # fine-tune an existing head (its kind and draft vocabulary)
        from eagle2.head import load_head

        head = load_head(args.init_head, dtype=torch.float32, device=target.device)
    elif args.arch == "eagle3":
        head = build_eagle3_head(target, train, args.draft_vocab, args.seed)
    else:
        from eagle2.train.trainer import build_head

        head = build_head(target, train, args.draft_vocab, args.init, args.seed)
    out = root / f"train-ttt-{head.kind}"
    trainer = make_trainer(head, target, train, val, cfg, out)
    if trainer.maybe_resume():
        print(f"resumed from step {trainer.step}/{trainer.total_steps}", flush=True)
    summary = trainer.run()
    if getattr(trainer, "env", None) is not None and not trainer.env.is_main:
        return summary
    summary.update(num_sequences=len(train), num_val_sequences=len(val),
                   trained_positions=sum(int(s.loss_mask.sum()) for s in train),
                   draft_vocab=int(head.d2t.numel()), feature_layers=trainer.layers,
                   feature_rms=trainer.feature_rms, config=asdict(cfg))
    save = Path(args.save) if args.save else root / f"head-{head.kind}"
    save_head(trainer.head.eval(), save, target_config=target.config)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    plot_ttt_log(trainer.log_path, out / "curves.png")
    print(json.dumps({k: summary[k] for k in ("steps", "elapsed_s", "val")}, default=str))
    return summary
