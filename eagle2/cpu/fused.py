"""The target's decoder layers with fused projections (docs/cpu-backend.md).

The same arithmetic as `attention.decoder_layer`, in fewer and larger operations:
  - q|k|v in one matrix [(Hq + 2 KVH) Dh, H] and gate|up in one [2 I, H]; the HF modules'
    weights become views into these (no second copy), so HF `generate` and training still
    see the same parameters;
  - rotary applied to q and k together, RMSNorm as one `F.rms_norm` call;
  - every matrix multiplied through `kernels.BlockedWeight` (the block size measured per row
    count on this machine);
  - the new K/V written with one slice copy when all requests start at the same cache length;
  - in bf16 on a CPU, the norms (with the residual add before the second), RoPE with the K/V
    writes, and the exact attention as single calls of `eagle2.cpu.native` (row by row, in a
    fixed order: a token's result does not depend on the other rows, which exactness needs).
Used for plain `nn.Linear` weights without bias: the unsharded target, and a tensor-parallel
rank's shard (`eagle2.tp`: its merged column-parallel q|k|v and gate|up are used as they are,
and the row-parallel o and down products are summed over the ranks, `FusedLayer.reduce`,
before their residual adds, so the one-operator native layer does not apply); anything else
(a biased or quantized model) keeps the module path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from eagle2.attention import KVCache, Parts, StepInputs, attend_groups, cached_attention
from eagle2.cpu.kernels import AMX, FMA, BlockedWeight, BlockPlan, PackedLinear

# a bf16 CPU layer whose linears all take the FMA kernel (or all the AMX one) at this row count
# runs as one native operator (`eagle2_cpu::decoder_layer`); False: the same operators called
# one by one from Python (the tests compare the two)
NATIVE_LAYER = True
# with NATIVE_LAYER, consecutive target layers run as one `eagle2_cpu::decoder_layers` call
# (`LayerStack`); False: one `decoder_layer` call a layer (the tests compare the two)
NATIVE_STACK = True
_NO_NORM = torch.empty(0, dtype=torch.bfloat16)  # `decoder_layer` without its input norm


def can_fuse(layers: nn.ModuleList) -> bool:
    """True when every projection is a plain bias-free nn.Linear, or a tensor-parallel
    shard's (`eagle2.tp.RowParallelLinear` for o and down), not quantized."""
    def plain(m: nn.Module) -> bool:  # hooks could be another library's all-reduce
        return ((type(m) is nn.Linear or getattr(type(m), "row_parallel", False))
                and m.bias is None and not m._forward_hooks and not m._forward_pre_hooks)

    return all(
        all(plain(getattr(layer.self_attn, p)) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
        and all(plain(getattr(layer.mlp, p)) for p in ("gate_proj", "up_proj", "down_proj"))
        and getattr(layer.mlp, "act_fn", None) is not None
        for layer in layers
    )


def _fuse_into(modules: list[nn.Linear]) -> torch.Tensor:
    """Concatenate the modules' weights along the outputs; make theirs views of the result."""
    fused = torch.cat([m.weight.detach() for m in modules], dim=0).contiguous()
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(fused[start:start + rows], requires_grad=False)
        start += rows
    return fused


@dataclass
class FusedLayer:
    qkv: BlockedWeight  # [(Hq + 2 KVH) Dh, H]
    o: BlockedWeight  # [H, Hq Dh]
    gate_up: BlockedWeight  # [2 I, H]
    down: BlockedWeight  # [H, I]
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    eps: float
    act: nn.Module
    silu: bool  # act is SiLU (the native path fuses it with the multiply by up)
    # a tensor-parallel shard's all-reduce of the o and down products (in place), else None
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def from_hf(cls, layer: nn.Module, plan: BlockPlan) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        merged = getattr(attn, "qkv_proj", None), getattr(mlp, "gate_up_proj", None)
        # a shard's merged matrices (`tp.merge_projections`: the modules' weights are views of
        # them) as they are, not a second copy
        qkv = merged[0].weight.detach() if merged[0] is not None else _fuse_into(
            [attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up = merged[1].weight.detach() if merged[1] is not None else _fuse_into(
            [mlp.gate_proj, mlp.up_proj])
        norm = layer.input_layernorm
        reduce = attn.o_proj.reduce if getattr(type(attn.o_proj), "row_parallel", False) \
            else None
        return cls(BlockedWeight(qkv, plan), BlockedWeight(attn.o_proj.weight.detach(), plan),
                   BlockedWeight(gate_up, plan), BlockedWeight(mlp.down_proj.weight.detach(), plan),
                   norm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                   norm.variance_epsilon, mlp.act_fn, is_silu(mlp.act_fn), reduce)

    def summed(self, out: torch.Tensor) -> torch.Tensor:
        """A row-parallel product (o or down), summed over the ranks of a shard."""
        return out if self.reduce is None else self.reduce(out)

    def weights(self) -> list[torch.Tensor]:
        return [w.weight for w in self.linears]

    @property
    def linears(self) -> tuple[BlockedWeight, ...]:
        return self.qkv, self.o, self.gate_up, self.down

    @functools.cached_property
    def fma_arguments(self) -> tuple:
        """(packed weight, out features) of q|k|v, o, gate|up and down, as `decoder_layer`
        takes them: built on first use and kept (the packed weights are kept too)."""
        return tuple(a for w in self.linears for a in (w.fma_packed(), w.weight.shape[0]))


class LayerStack:
    """The target's fused layers as `eagle2_cpu::decoder_layers` takes them: one list a kind
    of norm and packed weight, made on first use and kept. `run` takes consecutive layers in
    one call where every layer's linears share one plan (the per-layer operator's condition,
    `one_native_kernel`, then holds for all or none); else it returns None and the caller goes
    layer by layer (`fused_layer`). The plans are compared once, when the stack is made: a
    `BlockPlan` is measured and updated in place, and every layer gets the target's own."""

    def __init__(self, layers: list[FusedLayer]):
        self.layers = layers
        first = layers[0]
        self.uniform = all(
            lw.silu and lw.eps == first.eps and lw.reduce is None
            and all(w.plan is w0.plan and w.fits_amx == w0.fits_amx
                    and w.weight.shape == w0.weight.shape
                    for w, w0 in zip(lw.linears, first.linears, strict=True))
            for lw in layers)

    @functools.cached_property
    def _lists(self) -> tuple[list[torch.Tensor], ...]:
        """(input norms, post norms, q|k|v, o, gate|up, down), each a list over the layers."""
        packed = [lw.fma_arguments[::2] for lw in self.layers]
        return ([lw.input_norm for lw in self.layers], [lw.post_norm for lw in self.layers],
                *(list(kind) for kind in zip(*packed, strict=True)))

    def run(self, ops: ModuleType, start: int, stop: int, x: torch.Tensor, cache: KVCache,
            inp: StepInputs, num_q_heads: int) -> torch.Tensor | None:
        """Layers start .. stop - 1 on x [B, N, H] as one operator (bitwise `_native_layer`
        for each in turn), or None where that operator does not apply."""
        if not (NATIVE_LAYER and NATIVE_STACK and self.uniform) or inp.base is None \
                or inp.tree_mask is None:
            return None
        first = self.layers[start]
        kernel = one_native_kernel(first.linears, x.numel() // x.shape[-1])
        if kernel is None:
            return None
        in_norms, post_norms, qkv, o, gate_up, down = (kind[start:stop] for kind in self._lists)
        features = first.fma_arguments[1::2]
        return ops.decoder_layers(
            x, in_norms, post_norms, first.eps, qkv, features[0], o, features[1], gate_up,
            features[2], down, features[3], inp.cos, inp.sin, num_q_heads, cache.k.shape[2],
            cache.k, cache.v, start, inp.slots, inp.write_pos, inp.base, inp.tree_mask,
            cache.k.shape[-1] ** -0.5, cache.key_blocks, cache.key_blocks_valid, kernel == AMX,
            **pages(cache))


def pages(cache: KVCache) -> dict:
    """The native operators' block_tables argument for a paged cache (none for a slotted
    one, so that another commit's build, `native.load_variant`, takes the same calls)."""
    return {} if cache.block_tables is None else {"block_tables": cache.block_tables}


def fused_native_layer() -> bool:
    """Whether decoder layers run as one `decoder_layer` operator where they can
    (`NATIVE_LAYER`, which tests turn off to compare with the call-by-call path)."""
    return NATIVE_LAYER


def is_silu(act: nn.Module) -> bool:
    """The activation is SiLU (the native path fuses it with the multiply by up)."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, Hx, N, Dh] with cos/sin [B, 1, N, Dh] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def fused_layer(lw: FusedLayer, layer_idx: int, x: torch.Tensor, cache: KVCache,
                inp: StepInputs | Parts, head_dim: int, num_q_heads: int,
                ops: ModuleType | None = None) -> torch.Tensor:
    """One decoder layer on x [B, N, H] that writes its K/V into the cache. ops: the fused
    CPU operations (`eagle2.cpu.native.cpu_ops()`), for a bf16 CPU target with exact attention."""
    if ops is not None:
        return _native_layer(ops, lw, layer_idx, x, cache, inp, num_q_heads)
    num_kv = cache.k.shape[2]

    def attend_one(qkv: torch.Tensor, inp: StepInputs) -> torch.Tensor:  # -> [B, N, Hq Dh]
        num_b, num_n, _ = qkv.shape
        qkv = qkv.view(num_b, num_n, num_q_heads + 2 * num_kv, head_dim).transpose(1, 2)
        qk = _rotate(qkv[:, : num_q_heads + num_kv], inp.cos[:, None], inp.sin[:, None])
        q, k = qk[:, :num_q_heads], qk[:, num_q_heads:]  # [B, Hq, N, Dh], [B, KVH, N, Dh]
        v = qkv[:, num_q_heads + num_kv:]
        out = cached_attention(q, k, v, cache, layer_idx, inp)  # [B, Hq, N, Dh]
        return out.transpose(1, 2).reshape(num_b, num_n, -1)

    qkv = lw.qkv(_rms_norm(x, lw.input_norm, lw.eps))  # [B, N, (Hq + 2 KVH) Dh]
    x = x + lw.summed(lw.o(attend_groups(inp, [qkv], attend_one)))
    gate, up = lw.gate_up(_rms_norm(x, lw.post_norm, lw.eps)).chunk(2, dim=-1)
    return x + lw.summed(lw.down(lw.act(gate) * up))


def one_native_kernel(linears: tuple[BlockedWeight, ...], rows: int) -> int | None:
    """FMA or AMX where every one of the linears takes that kernel at this row count (and,
    for AMX, fits its tiles: `BlockedWeight.fits_amx`), so `decoder_layer` can run them;
    else None."""
    kernels = {w.plan.for_rows(rows) for w in linears}
    if kernels == {FMA} or (kernels == {AMX} and all(w.fits_amx for w in linears)):
        return kernels.pop()
    return None


def _native_layer(ops: ModuleType, lw: FusedLayer, layer_idx: int, x: torch.Tensor,
                  cache: KVCache, inp: StepInputs | Parts, num_q_heads: int) -> torch.Tensor:
    """`fused_layer` with the per-row work and the exact attention in `eagle2.cpu.native` calls
    (bf16 CPU): norm -> qkv -> RoPE + K/V writes -> attention -> o -> residual add + norm ->
    MLP."""
    layer_k, layer_v, key_blocks, valid = cache.layer_views(layer_idx)
    rows = x.numel() // x.shape[-1]
    linears = lw.linears
    kernel = one_native_kernel(linears, rows)
    if lw.silu and NATIVE_LAYER and kernel is not None and lw.reduce is None \
            and isinstance(inp, StepInputs):
        # the same calls in one operator (`decoder_layer`: bitwise this function's result)
        assert inp.base is not None and inp.tree_mask is not None
        return ops.decoder_layer(
            x, lw.input_norm, lw.post_norm, lw.eps, *lw.fma_arguments, inp.cos, inp.sin,
            num_q_heads, layer_k.shape[1], layer_k, layer_v, inp.slots, inp.write_pos, inp.base,
            inp.tree_mask, layer_k.shape[-1] ** -0.5, key_blocks, valid, kernel == AMX,
            **pages(cache))

    def attend_one(qkv: torch.Tensor, inp: StepInputs) -> torch.Tensor:  # -> [B, N, Hq Dh]
        assert inp.base is not None and inp.tree_mask is not None
        q = ops.qkv_rope_write(qkv, inp.cos, inp.sin, num_q_heads, layer_k.shape[1], layer_k,
                               layer_v, inp.slots, inp.write_pos, **pages(cache))  # [B, Hq, N, Dh]
        return ops.attention(q, layer_k, layer_v, inp.slots, inp.base, inp.tree_mask,
                             q.shape[-1] ** -0.5, key_blocks, valid, **pages(cache))

    qkv = lw.qkv(ops.rms_norm(x.contiguous(), lw.input_norm, lw.eps))  # [B, N, (Hq+2KVH) Dh]
    x, h = ops.add_rms_norm(x, lw.summed(lw.o(attend_groups(inp, [qkv], attend_one))),
                            lw.post_norm, lw.eps)
    if lw.silu:
        return x + lw.summed(lw.down(ops.silu_mul(lw.gate_up(h))))
    gate, up = lw.gate_up(h).chunk(2, dim=-1)
    return x + lw.summed(lw.down(lw.act(gate) * up))


def native_head_layer(ops: ModuleType, layer: nn.Module, h: torch.Tensor, residual: torch.Tensor,
                      cache: KVCache, slots: torch.Tensor, base: torch.Tensor,
                      write_pos: torch.Tensor, tree_mask: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, fused: tuple[BlockedWeight, BlockedWeight] | None = None
                      ) -> torch.Tensor:
    """A draft head's decoder layer (HF modules; `layer_input` of the head gives h and the
    residual) through the same native calls as `_native_layer`: q|k|v -> RoPE + K/V writes at
    write_pos [B, N] -> attention over the committed [0, base) and the scratch entries of
    tree_mask [B, N, T] -> o -> residual add + norm -> MLP. It skips building the [B, N, S]
    mask and the per-call rotary and norm operations of the module path (drafts need no
    exactness; this is for speed). fused: the layer's q|k|v and gate|up weights, each one
    kernel call (the MLP's SiLU then fused with the multiply), else one call per module."""
    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    layer_k, layer_v = cache.k[0], cache.v[0]
    if fused is not None and h is residual and NATIVE_LAYER and is_silu(mlp.act_fn) \
            and isinstance(attn.o_proj, PackedLinear) and isinstance(mlp.down_proj, PackedLinear):
        # the whole layer as one operator where its linears all take the FMA kernel, or all
        # the AMX one (an EAGLE-2 head: no input norm, the fc's output both the projections'
        # input and the residual)
        linears = (fused[0], attn.o_proj.blocked(), fused[1], mlp.down_proj.blocked())
        kernel = one_native_kernel(linears, h.numel() // h.shape[-1])
        if kernel is not None:
            num_q = fused[0].weight.shape[0] // layer_k.shape[-1] - 2 * layer_k.shape[1]
            return ops.decoder_layer(
                h, _NO_NORM, norm.weight, norm.variance_epsilon,
                *(a for w in linears for a in (w.fma_packed(), w.weight.shape[0])), cos, sin,
                num_q, layer_k.shape[1], layer_k, layer_v, slots, write_pos, base, tree_mask,
                layer_k.shape[-1] ** -0.5, None, None, kernel == AMX)
    qkv = fused[0](h) if fused is not None else \
        torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)
    num_kv = layer_k.shape[1]
    num_q = qkv.shape[-1] // layer_k.shape[-1] - 2 * num_kv
    q = ops.qkv_rope_write(qkv.contiguous(), cos, sin, num_q, num_kv, layer_k, layer_v, slots,
                           write_pos)  # [B, Hq, N, Dh]
    out = ops.attention(q, layer_k, layer_v, slots, base, tree_mask, q.shape[-1] ** -0.5)
    x, y = ops.add_rms_norm(residual.contiguous(), attn.o_proj(out).contiguous(), norm.weight,
                            norm.variance_epsilon)
    if fused is not None and is_silu(mlp.act_fn):
        return x + mlp.down_proj(ops.silu_mul(fused[1](y)))
    return x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(y)) * mlp.up_proj(y))
