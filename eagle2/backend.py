"""The boundary between the device-independent algorithm and a device's kernels.

The target model (`TargetModel`), its KV cache and the drafter ask a `Backend` for everything
whose best implementation depends on the device: preparing the target's layers, allocating the
KV cache, the layer stack's forward with attention over the cache, the lm_head and the greedy
argmax, and the draft head's calls. This module's `Backend` is the torch implementation (SDPA
over a dense mask, the Hugging Face modules' own projections): it runs on any device. What
CUDA targets use is its subclass `eagle2.flex.FlexBackend` (the same modules, tree attention
through FlexAttention's block mask instead of the dense one). The CPU backend
(`eagle2.cpu.CpuBackend`: measured kernel plans, the native operators, exact bf16 attention)
subclasses it too; `eagle2.devices.backend_for` picks one.
Engine, tree, verify, drafter, budget and lookup never import a backend's kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from eagle2.attention import KVCache, Parts, StepInputs, decoder_layer, step_inputs

if TYPE_CHECKING:
    from eagle2.target import TargetModel


@dataclass
class TargetOutput:
    hidden: torch.Tensor  # [B, N, H] last hidden state after the final norm (lm_head's input)
    features: torch.Tensor  # [B, N, F] what the draft head reads: `hidden` (EAGLE-1/2), or
    # the residual stream at the inputs of `feature_layers` concatenated, F = 3H (EAGLE-3)


class StepPart(NamedTuple):
    """One group of new tokens of a `TargetModel.forward_parts` forward: tokens, positions
    [B, N], tree_mask [B, N, N], slots [B], as `TargetModel.forward` takes them."""

    tokens: torch.Tensor
    positions: torch.Tensor
    tree_mask: torch.Tensor
    slots: torch.Tensor


def split_output(out: TargetOutput, parts: Parts) -> list[TargetOutput]:
    """A `Parts` forward's output ([1, T, ...]) -> each group's ([B, N, ...])."""
    hidden = parts.split(out.hidden)
    if out.features is out.hidden:
        return [TargetOutput(h, h) for h in hidden]
    return [TargetOutput(h, f) for h, f in zip(hidden, parts.split(out.features), strict=True)]


def module_layers(target: TargetModel, x: torch.Tensor, cache: KVCache, inp: StepInputs | Parts
                  ) -> TargetOutput:
    """The target's decoder layers (HF modules, `attention.decoder_layer`) on its embeddings x
    [B, N, H] (a `Parts` forward's [1, T, H]) and the final norm, keeping the inputs of
    `target.feature_layers`."""
    keep = target.feature_layers or ()
    kept: dict[int, torch.Tensor] = {}
    for i in range(target.num_layers):
        if i in keep:
            kept[i] = x
        x = decoder_layer(target.layers[i], i, x, cache, inp, target.head_dim)
    hidden = target.norm(x)
    return TargetOutput(hidden, torch.cat([kept[i] for i in keep], dim=-1) if keep else hidden)


WHOLE_TREE = 1 << 30  # a greedy head's first_rows: every node of the trees in one round


class WholeTreeArgmax:
    """The greedy head of the torch backends (GPUs): `Backend.greedy_tokens` over every node
    of a verification at once (`LocalRunner.verified`), one launch and one read back a step,
    instead of the fp32 logits [B, N, V] (at 64 requests x 16 nodes of a 128k vocabulary,
    ~0.5 GB written and read again for their argmax)."""

    first_rows = WHOLE_TREE
    every_row = True  # padding rows too (cheaper on a GPU than reading the node counts back)


class Backend:
    """torch operations only; one instance per model it serves (it may keep per-model state)."""

    name = "torch"
    # attention whose result for a token does not depend on the tree or batch around it
    # (bitwise plain decoding's): the CPU backend's bf16 kernels; SDPA here
    exact = False
    # a backend's argmax without logits (`greedy_tokens`; `first_rows`: the rows its first
    # round takes, `verify.verify_greedy_lazily`), None: none
    greedy_head: object | None = WholeTreeArgmax()

    def prepare(self, target: TargetModel, measure: bool | None = None,
                refresh: bool = False) -> None:
        """Make the target's layers ready for this backend (fuse, pack, measure kernels)."""

    def info(self, target: TargetModel) -> dict:
        """What `ModelInfo` reports of the kernels in use."""
        return {"backend": self.name, "attention": "sdpa", "fused": False, "native": False}

    def cost_key(self, target: TargetModel) -> str:
        """What this target's measured step costs depend on beyond its shape and device (the
        kernels chosen): part of the cost cache's key (`budget.cost_cache_path`)."""
        return ""

    def allocate_cache(self, target: TargetModel, num_slots: int, max_len: int) -> KVCache:
        return KVCache.allocate(target.num_layers, num_slots, target.local_kv_heads(), max_len,
                                target.head_dim, target.dtype, target.device)

    def allocate_paged_cache(self, target: TargetModel, num_slots: int, num_blocks: int,
                             block_size: int, max_len: int) -> KVCache:
        """`TargetModel.allocate_paged_cache` (`KVCache.allocate_paged`), laid out heads-outer
        where the attention reads the blocks in place (`reads_blocks`)."""
        return KVCache.allocate_paged(
            target.num_layers, num_slots, num_blocks, block_size, max_len,
            target.local_kv_heads(), target.head_dim, target.dtype, target.device,
            ones_column=self.exact, heads_outer=self.reads_blocks(target.device))

    def reads_blocks(self, device: torch.device) -> bool:
        """Whether the attention reads a paged cache's blocks in place on `device` (the flex
        backend's, compiled) rather than each slot's entries gathered into rows."""
        return False

    def kv_bytes_per_token(self, target: TargetModel) -> int:
        """`TargetModel.kv_bytes_per_token`: K and V (and the exact attention's column of
        ones in V)."""
        per_layer = target.local_kv_heads() * (2 * target.head_dim + int(self.exact))
        return target.num_layers * per_layer * torch.finfo(target.dtype).bits // 8

    def forward(self, target: TargetModel, tokens: torch.Tensor, positions: torch.Tensor,
                tree_mask: torch.Tensor, cache: KVCache, slots: torch.Tensor) -> TargetOutput:
        """`TargetModel.forward` through the HF modules and the attention of `forward_inputs`
        (here SDPA over a dense mask)."""
        x = target.embed(tokens)  # [B, N, H]
        inp = self.forward_inputs(target, cache, slots, tree_mask, positions, x)
        return self.layers(target, x, cache, inp)

    def forward_parts(self, target: TargetModel, parts: list[StepPart],
                      cache: KVCache) -> list[TargetOutput]:
        """`TargetModel.forward_parts`: the groups' tokens as one [1, T] batch through the
        layers' projections and MLP, each group's attention over its own inputs."""
        xs = [target.embed(p.tokens) for p in parts]
        inp = Parts([self.forward_inputs(target, cache, p.slots, p.tree_mask, p.positions, x)
                     for p, x in zip(parts, xs, strict=True)],
                    [tuple(p.tokens.shape) for p in parts])
        return split_output(self.layers(target, inp.join(xs), cache, inp), inp)

    def layers(self, target: TargetModel, x: torch.Tensor, cache: KVCache,
               inp: StepInputs | Parts) -> TargetOutput:
        """The layer stack and the final norm on the embeddings x (`module_layers` here)."""
        return module_layers(target, x, cache, inp)

    def forward_inputs(self, target: TargetModel, cache: KVCache, slots: torch.Tensor,
                       tree_mask: torch.Tensor, positions: torch.Tensor,
                       x: torch.Tensor) -> StepInputs:
        """What the layers of one `forward` share (`attention.step_inputs`): here the dense
        [B, 1, N, S] mask for SDPA; `eagle2.flex.FlexBackend`: FlexAttention's block mask."""
        return step_inputs(cache, slots, tree_mask, positions, target.rope, x)

    def logits(self, target: TargetModel, features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] in fp32 (a TP-sharded lm_head gathers itself)."""
        return target.lm_head(features).float()

    def greedy_tokens(self, target: TargetModel, features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [...]: the argmax of `logits(features)` (ties: the lowest index),
        taken on the lm_head's own output: `logits` is its exact fp32 copy (same maximum, same
        first index), which is not made."""
        return target.lm_head(features).argmax(-1)

    def head_kernels(self, head: torch.nn.Module, draft_lm_head: torch.Tensor,
                     embed: torch.Tensor, d2t: torch.Tensor | None, cache: KVCache,
                     rope_table: Callable[[], tuple[torch.Tensor, torch.Tensor]]):
        """The draft head's faster calls on this backend (`eagle2.cpu.head.HeadKernels`), or
        None: the drafter runs the head's torch modules."""
        return None
