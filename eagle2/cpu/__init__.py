"""The CPU backend: measured kernel plans, the native operators and exact bf16 attention.

`CpuBackend` is what `eagle2.devices.backend_for` gives a model on the CPU. It keeps the
target's fused layers (`fused.FusedLayer`: q|k|v and gate|up merged, every matrix through a
`kernels.BlockedWeight` whose kernel per row count was measured on this machine), the lm_head's
blocked weight and its greedy argmax without logits (`kernels.GreedyArgmax`), and, in bf16 on a
CPU with exact kernels, runs the layers through `native.cpu_ops()` with attention that gives a
token bitwise the same result in a tree as in plain decoding (`attention.canonical_attention`
and its native twin). docs/cpu-backend.md describes each piece.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from eagle2.attention import KVCache, Parts, StepInputs, decoder_layer, step_inputs
from eagle2.backend import Backend, TargetOutput
from eagle2.cpu.attention import canonical_window, with_key_blocks
from eagle2.cpu.fused import FusedLayer, LayerStack, can_fuse, fused_layer
from eagle2.cpu.head import HeadKernels
from eagle2.cpu.kernels import (
    AMX,
    FMA,
    NATIVE,
    ROW_BUCKETS,
    BlockedWeight,
    BlockPlan,
    GreedyArgmax,
    cached_plan,
    exact_bf16_candidates,
    exact_bf16_kernels,
    fma_linear_ops,
    greedy_argmax_ops,
    packed_plan,
)
from eagle2.cpu.native import build_key, cpu_ops
from eagle2.machine import cache_root

if TYPE_CHECKING:
    from eagle2.target import TargetModel

MEASURE_KERNELS_ABOVE = 32 << 20  # bytes of weights; smaller models run from the caches


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, dtype: torch.dtype, device: torch.device):
        # bf16 on a CPU with exact bf16 kernels: attention that gives a token bitwise the
        # same result in a tree as in plain decoding (`attention.canonical_attention`; with
        # bf16 rounding, SDPA's differences flip greedy tokens); fp32 keeps SDPA
        self.exact = exact_bf16_kernels(dtype, device)
        self.fused: list[FusedLayer] | None = None
        self.head_proj: BlockedWeight | None = None
        self.greedy_head: GreedyArgmax | None = None  # greedy tokens without logits (`prepare`)
        self.plan = BlockPlan()
        self.native: ModuleType | None = None  # fused CPU operations (set by `prepare`)

    def prepare(self, target: TargetModel, measure: bool | None = None,
                refresh: bool = False) -> None:
        """Switch to the fused layers (`fused`) when the model allows it. The linear kernel
        per row count is measured on this machine (cached): bf16 on a CPU with exact kernels
        chooses between them (oneDNN's packed kernel and the native kernel where it equals it
        bitwise, or the native FMA variant for every row count: `kernels.one_family`; packed
        where not measured; the FMA variant alone where oneDNN does not pack bf16, e.g. AVX2
        only), other dtypes between block sizes. measure None: only for models of more than
        MEASURE_KERNELS_ABOVE bytes. Idempotent."""
        if self.fused is not None or not can_fuse(target.layers):
            return
        self.fused = [FusedLayer.from_hf(layer, self.plan) for layer in target.layers]
        head = target.lm_head
        if type(head) is torch.nn.Linear and head.bias is None:
            self.head_proj = BlockedWeight(head.weight.detach(), self.plan)
        weights = [w for lw in self.fused for w in lw.weights()]
        if self.head_proj is not None:
            weights.append(self.head_proj.weight)
        size = sum(w.numel() * w.element_size() for w in weights)
        if measure is None:
            measure = size > MEASURE_KERNELS_ABOVE
        if self.exact:  # exact kernels only (bf16)
            self.plan.block_bytes.update(packed_plan().block_bytes)
            candidates = exact_bf16_candidates(weights) if measure else ()
            if len(candidates) > 1:  # which one per row count: measured
                found = cached_plan(weights, target.name, cache_root() / "kernels",
                                    refresh=refresh, candidates=candidates)
                self.plan.block_bytes.update(found.block_bytes)
            self.native = cpu_ops()
            if AMX in self.plan.block_bytes.values() and self.head_proj is not None \
                    and fma_linear_ops() is not None:
                # the lm_head by the FMA kernel (its own family: plain and speculative steps
                # both take its tokens from it): greedy tokens from its int8 copy at half the
                # bytes (`GreedyArgmax`), where the AMX kernel would read all of its bf16
                self.head_proj.plan = BlockPlan({rows: FMA for rows in ROW_BUCKETS})
            ops = greedy_argmax_ops(self.head_proj.plan if self.head_proj is not None
                                    else self.plan, target.dtype, target.device)
            if self.head_proj is not None and ops is not None:
                self.greedy_head = GreedyArgmax(self.head_proj, ops)
            return
        if measure:
            found = cached_plan(weights, target.name, cache_root() / "kernels", refresh=refresh)
            self.plan.block_bytes.update(found.block_bytes)

    def info(self, target: TargetModel) -> dict:
        native = self.native_attention is not None
        return {"backend": self.name,
                "attention": "native-exact" if native else "exact" if self.exact else "sdpa",
                "fused": self.fused is not None, "native": self.native is not None}

    def cost_key(self, target: TargetModel) -> str:
        key = f"|native-{build_key()}" if self.native is not None else ""
        kernels = self.plan.block_bytes.values()
        if NATIVE in kernels:
            key += "|native-linear"
        if FMA in kernels:
            key += "|fma-linear"
        if AMX in kernels:
            key += "|amx-linear"
        return key

    @property
    def layer_stack(self) -> LayerStack:
        """The fused layers as one native call's arguments (`fused.LayerStack`), made once
        per list of fused layers."""
        if self.__dict__.get("_stack_of") is not self.fused:
            self.__dict__["_stack"] = LayerStack(self.fused)
            self.__dict__["_stack_of"] = self.fused
        return self.__dict__["_stack"]

    @property
    def native_attention(self) -> ModuleType | None:
        """The fused CPU operations where the layers run them with their exact attention
        (bf16, fused layers, `native` built), else None. A tensor-parallel shard runs them
        one by one (`fused._native_layer`: its o and down products are summed over the ranks
        between them, `FusedLayer.reduce`), never as the one-operator layer."""
        if not self.exact or self.fused is None:
            return None
        return self.native

    def allocate_cache(self, target: TargetModel, num_slots: int, max_len: int) -> KVCache:
        cache = KVCache.allocate(target.num_layers, num_slots, target.local_kv_heads(),
                                 max_len, target.head_dim, target.dtype, target.device,
                                 ones_column=self.exact)
        native = self.native_attention
        if native is not None:
            with_key_blocks(cache, value_tiles=native.amx_ready())
        return cache

    def allocate_paged_cache(self, target: TargetModel, num_slots: int, num_blocks: int,
                             block_size: int, max_len: int) -> KVCache:
        """With the native attention, room for its kept key blocks per block (the values are
        not kept as AMX tiles in a paged cache)."""
        cache = super().allocate_paged_cache(target, num_slots, num_blocks, block_size,
                                             max_len)
        if self.native_attention is not None:
            with_key_blocks(cache)
        return cache

    def kv_bytes_per_token(self, target: TargetModel) -> int:
        """K and V, and with the native attention the keys again, kept transposed
        (`with_key_blocks`)."""
        per_token = super().kv_bytes_per_token(target)
        if self.native_attention is not None:
            per_token += (target.num_layers * target.local_kv_heads() * target.head_dim
                          * torch.finfo(target.dtype).bits // 8)
        return per_token

    def forward_inputs(self, target: TargetModel, cache: KVCache, slots: torch.Tensor,
                       tree_mask: torch.Tensor, positions: torch.Tensor,
                       x: torch.Tensor) -> StepInputs:
        """Exact bf16 attention: the fused CPU operations' own kernel (no dense mask), else
        `canonical_attention`."""
        native = self.native_attention
        return step_inputs(cache, slots, tree_mask, positions, target.rope, x,
                           exact_window=canonical_window if self.exact and native is None
                           else None, dense_mask=native is None)

    def layers(self, target: TargetModel, x: torch.Tensor, cache: KVCache,
               inp: StepInputs | Parts) -> TargetOutput:
        """The fused layers (the native operators' where built) and the final norm on the
        embeddings x [B, N, H]; a `Parts` forward's [1, T, H] goes layer by layer, never
        through the native stack, whose operator attends one group."""
        native = self.native_attention
        keep = target.feature_layers or ()
        kept: dict[int, torch.Tensor] = {}
        num_heads, num_layers = target.local_heads(), target.num_layers  # (a shard's own)
        stack = self.layer_stack if native is not None and isinstance(inp, StepInputs) \
            else None
        i = 0
        while i < num_layers:
            if i in keep:
                kept[i] = x
            if stack is not None:  # up to the next kept layer's input in one native call
                stop = min([k for k in keep if k > i] + [num_layers])
                out = stack.run(native, i, stop, x, cache, inp, num_heads)
                if out is not None:
                    x, i = out, stop
                    continue
            if self.fused is not None:
                x = fused_layer(self.fused[i], i, x, cache, inp, target.head_dim, num_heads,
                                native)
            else:
                x = decoder_layer(target.layers[i], i, x, cache, inp, target.head_dim)
            i += 1
        if native is not None:  # the layers' own norm: one call for the module's six
            # (~0.1 ms of a step: the first operations after the layers run on cold caches)
            norm = target.norm
            hidden = native.rms_norm(x.contiguous(), norm.weight, norm.variance_epsilon)
        else:
            hidden = target.norm(x)
        return TargetOutput(hidden, torch.cat([kept[i] for i in keep], dim=-1) if keep else hidden)

    def logits(self, target: TargetModel, features: torch.Tensor) -> torch.Tensor:
        if self.head_proj is not None:
            return self.head_proj(features).float()
        return target.lm_head(features).float()

    def greedy_tokens(self, target: TargetModel, features: torch.Tensor) -> torch.Tensor:
        """Through `GreedyArgmax` where the fused lm_head allows it (about half the lm_head's
        time)."""
        if self.greedy_head is not None:
            tokens = self.greedy_head(features)
            if tokens is not None:
                return tokens
        return self.logits(target, features).argmax(-1)

    def head_kernels(self, head: torch.nn.Module, draft_lm_head: torch.Tensor,
                     embed: torch.Tensor, d2t: torch.Tensor | None, cache: KVCache,
                     rope_table: Callable[[], tuple[torch.Tensor, torch.Tensor]]):
        if not self.exact:
            return None
        return HeadKernels(head, draft_lm_head, embed, d2t, cache, rope_table)
