"""Where the target runs: in this process (`LocalRunner`) or sharded across tensor-parallel
ranks (`services` drives the same interface over Ray actors). The engine only talks to this.
"""

from __future__ import annotations

from typing import Protocol

import torch

from eagle2.target import TargetModel


class TargetRunner(Protocol):
    vocab_size: int
    device: torch.device

    @property
    def lengths(self) -> torch.Tensor:  # [slots] committed length per cache slot
        ...

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                slots: torch.Tensor, logit_index: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (features [B, N, H], fp32 logits [B, N, V], or [B, V] at logit_index [B])."""
        ...

    def commit(self, slots: torch.Tensor, node_idx: torch.Tensor, kept: torch.Tensor) -> None: ...

    def copy_slot(self, src: int, dst: int) -> None: ...

    def set_lengths(self, slots: torch.Tensor, values: torch.Tensor) -> None: ...


class LocalRunner:
    """The whole target and its KV cache in this process."""

    def __init__(self, target: TargetModel, num_slots: int, max_len: int):
        self.target = target.fuse()  # fused layers where the model allows (eagle2.fused)
        self.vocab_size = target.vocab_size
        self.device = target.device
        self.cache = target.allocate_cache(num_slots, max_len)

    @property
    def lengths(self) -> torch.Tensor:
        return self.cache.lengths

    def forward(self, tokens, positions, tree_mask, slots, logit_index=None):
        feats = self.target.forward(tokens, positions, tree_mask, self.cache, slots).features
        if logit_index is not None:
            rows = torch.arange(feats.shape[0], device=feats.device)
            return feats, self.target.logits(feats[rows, logit_index])
        return feats, self.target.logits(feats)

    def commit(self, slots, node_idx, kept) -> None:
        self.cache.commit(slots, node_idx, kept)

    def copy_slot(self, src: int, dst: int) -> None:
        self.cache.copy_slot(src, dst)

    def set_lengths(self, slots, values) -> None:
        dev = self.cache.lengths.device
        self.cache.lengths[slots.to(dev)] = values.to(dev)
