"""CUDA graphs of the target forward for fixed token-count buckets (docs/architecture.md
"On GPUs"); eager everywhere else.

A verification step launches hundreds of small kernels; at batch 1 on a GPU the launch time
can exceed the kernels' own. A CUDA graph replays the whole forward as one launch, but only
for fixed shapes and with no host synchronisation inside. So a bucket is a fixed
(batch B, tokens N) pair, and the graph-safe forward differs from `TargetModel.forward` in one
way: the attention mask spans the whole cache (S = max_len) instead of the used prefix, so
no shape depends on the cache lengths. Slots must be 0..B-1 (the engine's compact slots).

`GraphedForward(target, cache, buckets)` captures each bucket once; calling it replays the
bucket's graph when (B, N) matches one and the device is CUDA, else runs the eager forward.
"""

from __future__ import annotations

import torch

from eagle2.attention import KVCache, StepInputs, decoder_layer
from eagle2.target import TargetModel


def static_step_inputs(cache: KVCache, tree_mask: torch.Tensor, positions: torch.Tensor,
                       rotary: torch.nn.Module, like: torch.Tensor) -> StepInputs:
    """StepInputs for slots 0..B-1 over the whole cache, with no host synchronisation.
    tree_mask [B, N, N], positions [B, N]; the mask is [B, 1, N, S_max]."""
    num_b, num_n = positions.shape
    dev = positions.device
    base = cache.lengths[:num_b]  # [B]
    write_pos = base[:, None] + torch.arange(num_n, device=dev)  # [B, N]
    cols = torch.arange(cache.max_len, device=dev)  # [S]
    mask = (cols[None, None, :] < base[:, None, None]).expand(num_b, num_n, cache.max_len)
    mask = mask.clone()
    mask.scatter_(2, write_pos[:, None, :].expand(num_b, num_n, num_n), tree_mask)
    cos, sin = rotary(like, positions)
    slots = torch.arange(num_b, device=dev)
    return StepInputs(slots, write_pos, mask[:, None], cos, sin, True)


def static_forward(target: TargetModel, cache: KVCache, tokens: torch.Tensor,
                   positions: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
    """`TargetModel.forward` for slots 0..B-1, graph-safe. -> features [B, N, H]."""
    x = target.embed(tokens)  # [B, N, H]
    inp = static_step_inputs(cache, tree_mask, positions, target.rotary, x)
    for i, layer in enumerate(target.layers):
        x = decoder_layer(layer, i, x, cache, inp, target.head_dim)
    return target.norm(x)


class GraphedForward:
    """The target forward with one CUDA graph per (batch, tokens) bucket."""

    def __init__(self, target: TargetModel, cache: KVCache, buckets: list[tuple[int, int]],
                 warmup: int = 2):
        self.target, self.cache = target, cache
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.enabled = target.device.type == "cuda"
        if self.enabled:
            for num_b, num_n in buckets:
                self.graphs[(num_b, num_n)] = self._capture(num_b, num_n, warmup)

    @torch.inference_mode()
    def _capture(self, num_b: int, num_n: int, warmup: int) -> tuple:
        dev = self.target.device
        tokens = torch.zeros(num_b, num_n, dtype=torch.long, device=dev)
        positions = torch.arange(num_n, device=dev).expand(num_b, num_n).contiguous()
        tree_mask = torch.ones(num_n, num_n, dtype=torch.bool, device=dev).tril()
        tree_mask = tree_mask.expand(num_b, num_n, num_n).contiguous()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                static_forward(self.target, self.cache, tokens, positions, tree_mask)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = static_forward(self.target, self.cache, tokens, positions, tree_mask)
        return graph, tokens, positions, tree_mask, out

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor,
                 tree_mask: torch.Tensor) -> torch.Tensor:
        """features [B, N, H] for slots 0..B-1 (the graph's output buffer when replayed:
        copy it before the next call)."""
        entry = self.graphs.get(tuple(tokens.shape)) if self.enabled else None
        if entry is None:
            return static_forward(self.target, self.cache, tokens, positions, tree_mask)
        graph, s_tokens, s_positions, s_mask, out = entry
        s_tokens.copy_(tokens)
        s_positions.copy_(positions)
        s_mask.copy_(tree_mask)
        graph.replay()
        return out
