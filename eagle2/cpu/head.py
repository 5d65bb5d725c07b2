"""The draft head on a bf16 CPU: packed linears, the native decoder layer, one-operator calls.

`Drafter` (device-independent) asks the backend for a `HeadKernels` (`Backend.head_kernels`);
on a bf16 CPU with exact kernels it gets this one, elsewhere None and the torch module path.
Drafts need no exactness: everything here is for speed (docs/cpu-backend.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from eagle2.attention import KVCache
from eagle2.cpu.fused import fused_native_layer, is_silu, native_head_layer, one_native_kernel
from eagle2.cpu.kernels import (
    AMX,
    FMA,
    BlockedWeight,
    PackedLinear,
    native_linear_ops,
    pack_linears,
    small_rows_plan,
    weights_stamp,
)
from eagle2.cpu.native import build_key, cpu_ops
from eagle2.head import DraftHead


class HeadStep:
    """An EAGLE-1/2 head's call as one `head_step` operator (csrc/cpu_ops.cpp): the embedding,
    fc, decoder layer and draft-vocabulary log-probs that `Drafter` runs one by one, bitwise
    theirs, for ~0.5 ms less Python and dispatch a call at the few rows of a draft level.
    Holds the constant arguments; each linear takes the kernel its plan names for the call's
    row count."""

    def __init__(self, ops, head: DraftHead, embed: torch.Tensor, fused: tuple[BlockedWeight, ...],
                 vocab: BlockedWeight, rope: tuple[torch.Tensor, torch.Tensor], cache,
                 d2t: torch.Tensor | None):
        layer = head.decoder
        attn, norm = layer.self_attn, layer.post_attention_layernorm
        self.ops, self.embed, self.vocab, self.rope, self.cache, self.d2t = \
            ops, embed, vocab, rope, cache, d2t
        self.fc = head.fc.blocked()
        self.layer = (fused[0], attn.o_proj.blocked(), fused[1], layer.mlp.down_proj.blocked())
        head_dim = cache.k.shape[-1]
        num_kv = cache.k.shape[2]
        self.norm = norm.weight, norm.variance_epsilon
        self.heads = self.layer[0].weight.shape[0] // head_dim - 2 * num_kv, num_kv
        self.scale = head_dim ** -0.5
        self._kernels: dict[tuple[int, int], tuple[bool, bool, bool] | None] = {}

    def kernels(self, rows: int, logit_rows: int) -> tuple[bool, bool, bool] | None:
        """(fc, layer, vocab) on AMX (else FMA) at these row counts, None where a plan names
        another kernel (the module path then runs the call)."""
        key = rows, logit_rows
        if key not in self._kernels:
            def solo(w: BlockedWeight, n: int) -> bool | None:
                kernel = w.plan.for_rows(n)
                return None if kernel not in (FMA, AMX) else kernel == AMX and w.fits_amx
            layer = one_native_kernel(self.layer, rows)
            found = (solo(self.fc, rows), None if layer is None else layer == AMX,
                     solo(self.vocab, logit_rows) if logit_rows else False)
            self._kernels[key] = None if None in found else found
        return self._kernels[key]

    def __call__(self, slots, base, tokens, features, positions, mask, append_eye: bool, k: int,
                 logit_rows: torch.Tensor | None = None):
        """-> (outputs [B, N, H], the mask [B, N, T], top-k log-probs [B, N, k] ([B, k] with
        logit_rows) and their tokens, or Nones for k = 0), or None where the kernels do not
        fit (`kernels`)."""
        num_logits = 0 if not k else tokens.numel() if logit_rows is None else tokens.shape[0]
        kernels = self.kernels(tokens.numel(), num_logits)
        if kernels is None:
            return None
        qkv, o, gate_up, down = self.layer
        k_cache, v_cache = self.cache.k[0], self.cache.v[0]
        out, mask, logp, toks = self.ops.head_step(
            tokens, features, self.embed, self.fc.fma_packed(), self.fc.weight.shape[0],
            kernels[0], self.norm[0], self.norm[1], qkv.fma_packed(), qkv.weight.shape[0],
            o.fma_packed(), o.weight.shape[0], gate_up.fma_packed(), gate_up.weight.shape[0],
            down.fma_packed(), down.weight.shape[0], kernels[1], self.rope[0], self.rope[1],
            positions, self.heads[0], self.heads[1], k_cache, v_cache, slots, base, mask,
            append_eye, self.scale, self.vocab.fma_packed(), self.vocab.weight.shape[0],
            kernels[2], k, self.d2t, logit_rows)
        return (out, mask, logp, toks) if k else (out, mask, None, None)


class HeadKernels:
    """A draft head's calls on a bf16 CPU (what `Drafter` asks of the CPU backend): its
    linears packed (`kernels.small_rows_plan`; 3-5x faster than F.linear for these small, hot
    weights), the draft vocabulary's projection blocked the same way, its decoder layer through
    `eagle2.cpu.native` (`fused.native_head_layer`), the top k of the log-probs in one pass, and
    the whole call as one `head_step` operator where it applies (`HeadStep`)."""

    def __init__(self, head: DraftHead | nn.Module, draft_lm_head: torch.Tensor,
                 embed: torch.Tensor, d2t: torch.Tensor | None, cache: KVCache,
                 rope_table: Callable[[], tuple[torch.Tensor, torch.Tensor]]):
        """draft_lm_head [Vd, H]; embed [V, H]: the target's embedding weight; rope_table:
        -> cos, sin [>= S, Dh] of every cache position of the head's cache."""
        pack_linears(head)
        self.head, self.embed, self.d2t, self.cache = head, embed, d2t, cache
        self.rope_table = rope_table
        self.vocab_proj = BlockedWeight(draft_lm_head, small_rows_plan())
        self.native = cpu_ops()  # None: the module path with packed linears
        # (the weights' versions, (q|k|v, gate|up)) of `fused_weights`
        self._fused: tuple[tuple, tuple[BlockedWeight, BlockedWeight]] | None = None
        # this draft call's one-operator head call (`prepare_step`), None where it does not apply
        self.step: HeadStep | None = None

    def cost_key(self) -> str:
        """What the head's speed depends on here: the native build and the linears' plan."""
        if self.native is None:
            return ""
        key = f"|native-{build_key()}" + ("-linear" if native_linear_ops() else "")
        plan = small_rows_plan().block_bytes
        return key + "-plan" + ",".join(f"{rows}:{kernel}" for rows, kernel in sorted(plan.items()))

    def top_log_probs(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] (after the head's pre_logits) -> top-k (log-prob, draft-vocabulary
        index) over the draft vocabulary: the sum of exponentials and the top k in one pass."""
        logits = self.vocab_proj(x).float()
        if self.native is not None:
            return self.native.top_log_probs(logits, k)
        return torch.log_softmax(logits, dim=-1).topk(k, dim=-1)

    def run(self, slots: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
            positions: torch.Tensor, tree_mask: torch.Tensor, window: int
            ) -> torch.Tensor | None:
        """The head over [B, N] new entries through `fused.native_head_layer`, or None where
        the module path must run (no native operators, or the sliding window hides entries)."""
        if self.native is None:
            return None
        base = self.cache.lengths[slots]
        if int(base.max()) > window:
            return None
        cos, sin = self.rope_table()
        num_t, num_n = tree_mask.shape[2], positions.shape[1]
        write_pos = base[:, None] + torch.arange(num_t - num_n, num_t, device=base.device)
        h, residual = self.head.layer_input(embeds, features)
        return native_head_layer(self.native, self.head.decoder, h, residual, self.cache, slots,
                                 base, write_pos, tree_mask, cos[positions], sin[positions],
                                 self.fused_weights())

    def prepare_step(self, end: torch.Tensor, window: int) -> None:
        """Set `step` to the one-operator head call for this draft (`HeadStep`), or None where
        the module path or the call-by-call native path must run: an EAGLE-3 head, a
        projection with a bias, or the sliding window hides entries (end: [B] cache lengths
        after this call's new pairs)."""
        self.step = self._head_step(end, window)

    def _head_step(self, end: torch.Tensor, window: int) -> HeadStep | None:
        ops, head = self.native, self.head
        if ops is None or not hasattr(ops, "head_step") or not isinstance(head, DraftHead) \
                or int(end.max()) > window:
            return None
        layer = head.decoder
        fused = self.fused_weights()
        if fused is None or not fused_native_layer() or not is_silu(layer.mlp.act_fn) or not all(
                isinstance(m, PackedLinear)
                for m in (head.fc, layer.self_attn.o_proj, layer.mlp.down_proj)):
            return None
        step = self.step
        if step is None or step.layer[0] is not fused[0] or step.layer[2] is not fused[1] \
                or step.fc is not head.fc.blocked() \
                or step.layer[1] is not layer.self_attn.o_proj.blocked() \
                or step.layer[3] is not layer.mlp.down_proj.blocked():
            step = HeadStep(ops, head, self.embed, fused, self.vocab_proj, self.rope_table(),
                            self.cache, self.d2t)
        return step

    def fused_weights(self) -> tuple[BlockedWeight, BlockedWeight] | None:
        """The head layer's q|k|v and gate|up weights, each concatenated into one packed
        weight (one kernel call instead of three and two), packed again when the head's
        weights change (a head trained in this process). None where a projection has a bias."""
        layer = self.head.decoder
        attn, mlp = layer.self_attn, layer.mlp
        groups = ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj))
        if any(getattr(m, "bias", None) is not None for g in groups for m in g):
            return None
        seen = weights_stamp(*(m.weight for g in groups for m in g))
        if self._fused is None or self._fused[0] != seen:
            plan = small_rows_plan()
            qkv, gate_up = (BlockedWeight(torch.cat([m.weight.detach() for m in g]).contiguous(),
                                          plan) for g in groups)
            self._fused = seen, (qkv, gate_up)
        return self._fused[1]
