"""The training-time test on stored features: `eagle2 train-head --arch eagle3
--stored-features` (alone or with `--deepspeed`).

See docs/training.md "A head for a target larger than one GPU" and `eagle2.train.ttt`.

The online training-time test runs the target on every batch; a 70B target fits no single
GPU, so here the features stage's shards stand in for that forward: the EAGLE-3 head's step-0
features are the stored inputs of decoder layers 2, L/2 and L-3 (`aux`, written with `--arch
eagle3`; an EAGLE-1/2 head reads the stored final features), and the soft targets are the
target's logits recomputed from the stored final features through its lm_head (one matmul,
[B, T, H] x [H, V]). Only the target's embedding, lm_head and final norm are loaded. The
features are fp16 in the shards, so the losses match the online run's to fp16 rounding.
Under DeepSpeed: `eagle2.train.deepspeed_ttt.DeepSpeedStoredTTTTrainer`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle2.train.data import Sequence
from eagle2.train.ttt import Batch, TTTTrainer


@dataclass
class StoredBatch(Batch):
    final: torch.Tensor | None = None  # [B, T, H] fp16: the final features
    aux: torch.Tensor | None = None  # [B, T, 3H] fp16: the EAGLE-3 layers' inputs

    def to(self, device) -> StoredBatch:
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return StoredBatch(*(move(t) for t in (self.input_ids, self.loss_mask, self.lengths,
                                               self.final, self.aux)))


def collate_stored(seqs: list[Sequence]) -> StoredBatch:
    """Right-padded ids, masks and stored features of sequences from `load_shards`."""
    lengths = torch.tensor([len(s.input_ids) for s in seqs])
    num_b, num_t = len(seqs), int(lengths.max())
    ids = torch.zeros(num_b, num_t, dtype=torch.long)
    mask = torch.zeros(num_b, num_t, dtype=torch.bool)
    final = torch.zeros(num_b, num_t, seqs[0].features.shape[-1], dtype=torch.float16)
    has_aux = seqs[0].aux is not None
    aux = torch.zeros(num_b, num_t, seqs[0].aux.shape[-1], dtype=torch.float16) \
        if has_aux else None
    for b, s in enumerate(seqs):
        n = len(s.input_ids)
        ids[b, :n], mask[b, :n], final[b, :n] = s.input_ids, s.loss_mask, s.features
        if has_aux:
            aux[b, :n] = s.aux
    return StoredBatch(ids, mask, lengths, final, aux)


class VocabTarget:
    """The target as training on stored features needs it: its config, embedding, lm_head
    and final norm, read from safetensors (never its decoder layers)."""

    def __init__(self, spec: str | None, device: str | torch.device):
        from safetensors import safe_open
        from transformers import AutoConfig
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        from eagle2.target import embedded_model_dir, load_vocab_modules

        path = embedded_model_dir() if spec is None else spec
        self.config = AutoConfig.from_pretrained(path)
        self.num_layers = self.config.num_hidden_layers
        self.device = torch.device(device)
        self.embed, self.lm_head = load_vocab_modules(spec, torch.float32, str(self.device))
        self.norm = LlamaRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)
        from pathlib import Path

        for f in sorted(Path(path).glob("*.safetensors")):
            with safe_open(f, framework="pt") as h:
                if "model.norm.weight" in h.keys():
                    self.norm.weight.data.copy_(h.get_tensor("model.norm.weight"))
                    break
        else:
            raise ValueError(f"{path}: no model.norm.weight in its safetensors")
        self.norm.to(self.device)
        self.hf = None  # no forward: the shards hold its outputs


class StoredTTTMixin:
    """`TTTTrainer`'s batches and target outputs from the shards (see the module doc)."""

    def collate(self, seqs: list[Sequence]) -> StoredBatch:
        return collate_stored(seqs)

    def rows(self, batch: StoredBatch, rows: torch.Tensor) -> StoredBatch:
        return StoredBatch(batch.input_ids[rows], batch.loss_mask[rows], batch.lengths[rows],
                           batch.final[rows], None if batch.aux is None else batch.aux[rows])

    def target_outputs(self, batch: StoredBatch) -> tuple[torch.Tensor, torch.Tensor]:
        feats = batch.final if self.layers is None else batch.aux
        if feats is None:
            raise ValueError("the shards hold no EAGLE-3 layers: write them with the features "
                             "stage and --arch eagle3")
        weight = self.target.lm_head.weight
        logits = batch.final.to(weight.dtype) @ weight.T  # [B, T, V]
        return feats.float(), logits.float()


class StoredTTTTrainer(StoredTTTMixin, TTTTrainer):
    pass
