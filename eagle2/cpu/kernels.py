"""Linear kernels chosen per row count by measuring (docs/cpu-backend.md, "CPU performance").

A decode or verification step multiplies M = B x N rows (a handful) by every weight matrix, so
it streams the weights from memory once: time = bytes / bandwidth at best. On CPUs the BLAS
kernel for M > 1 rows often packs the whole weight before multiplying, which streams it two or
three times: 2-8 rows then cost up to twice one row. Splitting a weight into row blocks that
fit the core's L2 cache keeps the packing in cache, so a few rows cost about what one does.
The best block size depends on the CPU and on M, so `measure_plan` times each candidate on the
model's own weights and `BlockPlan` picks per row count; the result is cached per machine
(`~/.cache/eagle2/kernels/`). Blocking splits the output features only: every output element
is the same dot product, so the choice changes speed, not the model.
E.g. SmolLM2-135M's gate|up weight [3072, 576] (7 MB) in blocks of 256 rows = 12 blocks of
590 KB, each multiplied by x [M, 576] and concatenated.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from eagle2.cpu.native import build_key, cpu_ops
from eagle2.machine import cache_root, cpu_info, machine_key, write_json_atomic

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # M is rounded up to one of these for the lookup
BLOCK_BYTES = (0, 256 << 10, 512 << 10, 1 << 20, 2 << 20)  # 0: the whole weight, one call
PACKED = -1  # not a block size: the whole weight pre-packed for oneDNN (bf16 on CPU)
# not a block size either: the whole weight packed for eagle2's native bf16 kernel
# (`eagle2_cpu.linear`, csrc/cpu_ops.cpp), bitwise equal to PACKED where
# `native_linear_exact` holds, and faster for the few rows of a decode step
NATIVE = -2
# nor this: the same packed weight through the native kernel's fp32-FMA variant
# (`eagle2_cpu.linear_fma`): each row's result is the same for any row count, but it is not
# bitwise PACKED / NATIVE, so a plan uses it for every row count or for none (`one_family`).
# Where vdpbf16ps is slow (an Intel Xeon without AMX: 1.2 G a second against 5.3 G 16-lane
# fp32 FMAs) it keeps 3-16 rows near the cost of one.
FMA = -3
# and this: the same packed weight on the AMX tiles (`eagle2_cpu.linear_amx`, Intel Xeon 4th
# generation and later): row-invariant as well, not bitwise FMA, so a family of its own. Up to
# 16 rows cost about one (one tile multiply takes 16 rows), where the FMA kernel's 16 rows
# cost 2.6 times its one (the target's linears, two threads: docs/cpu-backend.md "The AMX tiles").
AMX = -4
SOLO_KERNELS = (FMA, AMX)  # each row count by the same kernel, or none (`one_family`)
# Packed bf16 kernels give each output row bitwise the same for any row count only up to
# about this many input features (measured: 512-1152 yes, 1536 no, 1 and 2 threads); wider
# weights are multiplied in column chunks of at most this width and the chunks added in fp32.
PACKED_MAX_K = 1024


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 weights pre-packed for oneDNN: on this CPU they cost about the same for 1 to 32+
    rows, and each output row is bitwise the same whatever the row count (which exact bf16
    verification needs, docs/cpu-backend.md "Exact bf16 attention")."""
    return (device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())




def fma_cpu() -> bool:
    """The CPU has the vector instructions eagle2's native operations are built for: AVX2 with
    FMA (x86-64-v3: every x86 server CPU since about 2015), or AVX-512."""
    flags = cpu_info()[1]
    return {"avx2", "fma"} <= flags or "avx512f" in flags


def exact_bf16_kernels(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 on a CPU with a linear kernel whose output rows are bitwise the same for any row
    count (what exact bf16 verification needs): oneDNN's packed kernel, or eagle2's native
    FMA kernel (`fma_linear_ops`; e.g. a CPU with AVX2 only, where oneDNN does not pack
    bf16)."""
    return (device.type == "cpu" and dtype == torch.bfloat16
            and (packing_supported(dtype, device) or fma_linear_ops() is not None))


def native_bf16_cpu() -> bool:
    """The CPU has bf16 dot-product instructions (AMX-BF16 or AVX512-BF16) and oneDNN uses
    them (so bf16 weights can be packed)."""
    return (bool({"amx_bf16", "avx512_bf16"} & cpu_info()[1])
            and packing_supported(torch.bfloat16, torch.device("cpu")))


@dataclass
class BlockPlan:
    """Block size in bytes per row bucket (0 = no blocking); buckets beyond the last use it."""

    block_bytes: dict[int, int] = field(default_factory=dict)

    def for_rows(self, num_rows: int) -> int:
        for bucket in ROW_BUCKETS:
            if num_rows <= bucket:
                return self.block_bytes.get(bucket, 0)
        return self.block_bytes.get(ROW_BUCKETS[-1], 0)


class BlockedWeight:
    """A weight [O, K] and its row blocks (views, no copies), multiplied as the plan says."""

    def __init__(self, weight: torch.Tensor, plan: BlockPlan):
        self.weight, self.plan = weight, plan
        self._blocks: dict[int, tuple[torch.Tensor, ...]] = {}
        self._packed: list[torch.Tensor] | None = None
        self._native: tuple[object, torch.Tensor] | None = None  # (ops, packed weight)
        self.fits_amx = amx_fits([weight])  # (known once, asked every call)
        k = weight.shape[1]
        self.chunk_width = -(-k // -(-k // PACKED_MAX_K))  # column chunks of equal widths

    def blocks(self, block_bytes: int) -> tuple[torch.Tensor, ...]:
        if block_bytes not in self._blocks:
            rows = max(16, block_bytes // (self.weight.shape[1] * self.weight.element_size()))
            self._blocks[block_bytes] = tuple(self.weight.split(rows, 0))
        return self._blocks[block_bytes]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., O]."""
        num_rows = x.numel() // x.shape[-1]
        block_bytes = self.plan.for_rows(num_rows) if x.device.type == "cpu" else 0
        if block_bytes == PACKED:
            return self.packed(x)
        if block_bytes == NATIVE:
            return self.native(x)
        if block_bytes == FMA:
            return self.fma(x)
        if block_bytes == AMX:  # (a draft head's plan names it for weights that fit)
            return self.amx(x) if self.fits_amx else self.fma(x)
        if block_bytes == 0 or block_bytes >= self.weight.numel() * self.weight.element_size():
            return F.linear(x, self.weight)
        return torch.cat([F.linear(x, w) for w in self.blocks(block_bytes)], dim=-1)

    def _chunks(self) -> tuple[torch.Tensor, ...]:
        """The weight in column chunks of at most PACKED_MAX_K features (equal widths)."""
        return tuple(w.contiguous() for w in self.weight.split(self.chunk_width, dim=1))

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T through oneDNN's packed bf16 kernel, in column chunks of at most
        PACKED_MAX_K features (exactness, see PACKED_MAX_K)."""
        if self._packed is None:
            self._packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in self._chunks()]
        return _chunked(x, self._packed, lambda part, w: torch.ops.mkldnn._linear_pointwise(
            part, w, None, "none", [], ""))

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T through eagle2's native bf16 kernel, one call that adds the column
        chunks of `packed` the same way: bitwise `packed`'s result where
        `native_linear_exact()`. (Odd widths, which it does not pack, take `packed`.)"""
        if self.weight.shape[1] % 2 or self.chunk_width % 2:
            return self.packed(x)
        if self._native is None:
            ops = native_linear_ops()
            assert ops is not None, "the native bf16 linear is not available here"
            self._native = ops, ops.pack_linear(self.weight)
        ops, packed = self._native
        return ops.linear(x, packed, self.weight.shape[0], self.chunk_width)

    def fma(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T through the native kernel's fp32-FMA variant (the same packed weight
        as `native`; one fp32 sum per output over all K, no column chunks)."""
        ops, packed = self._fma_native()
        return ops.linear_fma(x, packed, self.weight.shape[0])

    def amx(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T on the AMX tiles (`linear_amx`: the FMA kernel's packed weight, the
        tile unit's fp32 sums)."""
        ops, packed = self._fma_native()
        return ops.linear_amx(x, packed, self.weight.shape[0])

    def fma_packed(self) -> torch.Tensor:
        """The weight as `fma` multiplies it (packed on first use)."""
        return self._fma_native()[1]

    def _fma_native(self) -> tuple[object, torch.Tensor]:
        """(the operators with linear_fma, the packed weight), packed on first use."""
        if self._native is None:
            ops = fma_linear_ops() or amx_linear_ops()
            assert ops is not None, "the native FMA / AMX linears are not available here"
            self._native = ops, ops.pack_linear(self.weight)
        return self._native


class GreedyArgmax:
    """Greedy tokens of a bf16 lm_head without its logits (docs/cpu-backend.md "Exact greedy
    tokens"): an int8 copy of the weight bounds every logit, and only the few outputs that
    could be the largest are computed as `BlockedWeight.fma` computes them, so the token is
    bitwise `proj.fma(x).float().argmax(-1)` (ties: the lowest index) for about half the
    lm_head's time. For a plan that multiplies every row count by the FMA kernel
    (`greedy_argmax_ops`); the int8 copy takes half the bf16 weight's memory."""

    # from how many rows the int8 pass runs on the AMX tiles, where it can: the same sums, so
    # the choice is speed alone. The whole greedy argmax of the embedded model's hidden
    # states, caches flushed, Xeon VM, ms for 1 / 4 / 8 / 12 / 16 / 32 rows, two threads: VNNI
    # 1.40-1.47 / 1.70 / 2.01 / 2.36-2.47 / 3.80 / 7.70, tiles 1.44-1.46 / 1.65 / 2.07 / 2.12-2.17
    # / 3.25 / 5.85-6.15; one thread: VNNI 3.34-3.43 at 8, 6.17-6.30 at 16, tiles 3.47-3.56,
    # 5.06-5.12 (`runs`-only script over `LocalRunner.head_seconds`). The bounds and the exact
    # pass, which grow with the rows on both, are most of what 16-32 rows cost.
    tile_rows = 9

    def __init__(self, proj: BlockedWeight, ops):
        if proj._native is None:
            proj._native = ops, ops.pack_linear(proj.weight)
        self.proj, self.ops = proj, ops
        # the exact pass reads candidates' rows of the weight itself (contiguous: a view of
        # the lm_head's weight where it is, no copy)
        self.weight = proj.weight.contiguous()
        self.q, self.stats = ops.pack_argmax(self.weight)
        # the int8 weight as AMX tiles (empty without them): the same int32 sums for
        # `tile_rows` rows and more, up to 16 a pass (`greedy_argmax`)
        tiles = ops.pack_argmax_tiles(self.q) if hasattr(ops, "pack_argmax_tiles") else None
        self.q_tiles = tiles if tiles is not None and tiles.numel() else None
        # rows a greedy verification's first round takes (`verify.verify_greedy_lazily`):
        # one tile pass, where 16 rows cost about what 9 do and a later round of 1-2 rows
        # reads the whole int8 copy again; with the vpdpwssd pass every row costs more, and
        # the first round keeps to the roots and their children
        self.first_rows = 16 if self.q_tiles is not None else 0

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [..., H] bf16 -> tokens [...] (int64); None where the lm_head's plan does not
        multiply this many rows by the FMA kernel (a plan changed after fusing), or a row is
        not finite (its logits then decide, as torch.argmax would)."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        if self.proj.plan.for_rows(rows.shape[0]) != FMA:
            return None
        tokens = self.ops.greedy_argmax(rows, self.q, self.stats, self.weight,
                                        self.proj.weight.shape[0], self.q_tiles, self.tile_rows)
        if bool((tokens < 0).any()):
            return None
        return tokens.reshape(hidden.shape[:-1])


def greedy_argmax_ops(plan: BlockPlan, dtype: torch.dtype, device: torch.device):
    """The native operators where `GreedyArgmax` applies to an lm_head multiplied by `plan`:
    bf16 on a CPU, the FMA kernel for every row count (its sums are what the exact outputs
    repeat), and not switched off by EAGLE2_GREEDY_ARGMAX=0; else None."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    if os.environ.get("EAGLE2_GREEDY_ARGMAX", "1") == "0":
        return None
    if any(plan.for_rows(rows) != FMA for rows in ROW_BUCKETS):
        return None
    ops = fma_linear_ops()
    return ops if ops is not None and hasattr(ops, "greedy_argmax") else None


def _chunked(x: torch.Tensor, weights: list[torch.Tensor], multiply) -> torch.Tensor:
    """x @ W.T for W in column chunks: each chunk's bf16 product, added in fp32."""
    if len(weights) == 1:
        return multiply(x, weights[0])
    parts = x.split(-(-x.shape[-1] // len(weights)), dim=-1)
    out = None
    for part, w in zip(parts, weights, strict=True):
        y = multiply(part.contiguous(), w).float()  # (a strided row is slow)
        out = y if out is None else out.add_(y)
    return out.to(x.dtype)


@functools.cache
def native_linear_ops():
    """`torch.ops.eagle2_cpu` where its bf16 linear was built and gives bitwise oneDNN's
    packed result on this machine (`native_linear_exact`), else None (also where
    EAGLE2_NATIVE_LINEAR=0: oneDNN's kernel alone, for comparison)."""
    if os.environ.get("EAGLE2_NATIVE_LINEAR", "1") == "0":
        return None
    ops = cpu_ops() if native_bf16_cpu() else None
    if ops is None or not native_linear_exact(ops):
        return None
    return ops


@functools.cache
def fma_linear_ops():
    """`torch.ops.eagle2_cpu` where its fp32-FMA linear was built and passes
    `fma_linear_exact` here, else None (also where EAGLE2_FMA_LINEAR=0: the bf16 kernels
    only, for comparison)."""
    if os.environ.get("EAGLE2_FMA_LINEAR", "1") == "0":
        return None
    ops = cpu_ops() if fma_cpu() else None
    if ops is None or not hasattr(ops, "linear_fma") or not fma_linear_exact(ops):
        return None
    return ops


@functools.cache
def amx_linear_ops():
    """`torch.ops.eagle2_cpu` where its AMX linear was built, the OS lets the process use the
    tiles and `linear_exact` holds for it, else None (also where EAGLE2_AMX_LINEAR=0)."""
    if os.environ.get("EAGLE2_AMX_LINEAR", "1") == "0" or "amx_bf16" not in cpu_info()[1]:
        return None
    ops = cpu_ops()
    if ops is None or not hasattr(ops, "linear_amx") or not ops.amx_ready():
        return None
    return ops if linear_exact(ops, ops.linear_amx, (64, 576, 1536)) else None


def amx_fits(weights: Sequence[torch.Tensor]) -> bool:
    """The AMX linear takes inputs of a multiple of 32 features (one tile row a step)."""
    return all(w.shape[1] % 32 == 0 for w in weights)


def fma_linear_exact(ops) -> bool:
    """Is the FMA kernel row-invariant and right here? (`linear_exact`)"""
    return linear_exact(ops, ops.linear_fma, (64, 576, 1536))


def linear_exact(ops, linear, widths: tuple[int, ...]) -> bool:
    """Is `linear` (x, packed, out_features) row-invariant and right here? Random weights and
    inputs of these widths, row counts 1 to 33: every row bitwise what it gives alone, and
    within bf16 rounding (plus fp32 summation) of an fp64 reference."""
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for out_features, k in zip((200, 72, 130), widths, strict=True):
            w = torch.randn(out_features, k, generator=g).bfloat16()
            x = (torch.randn(33, k, generator=g) * 3).bfloat16()
            packed = ops.pack_linear(w)
            full = linear(x, packed, out_features)
            reference = x.double() @ w.double().T
            if not torch.allclose(full.double(), reference, rtol=1 / 128, atol=1e-3 * k ** 0.5):
                return False
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 33):
                if not torch.equal(linear(x[:rows], packed, out_features), full[:rows]):
                    return False
            if not all(torch.equal(linear(x[i:i + 1], packed, out_features), full[i:i + 1])
                       for i in range(33)):
                return False
    return True


def native_linear_exact(ops) -> bool:
    """Does the native kernel sum in oneDNN's order here? Random weights and inputs of the
    widths a chunk can have, row counts 1 to 33: every output bitwise equal. (oneDNN picks its
    kernel by CPU: with AMX its order differs, and then only oneDNN is used.)"""
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for out_features, k in ((200, 64), (72, 576), (130, 768), (64, 1024)):
            w = torch.randn(out_features, k, generator=g).bfloat16()
            x = (torch.randn(33, k, generator=g) * 3).bfloat16()
            reference = torch.ops.mkldnn._linear_pointwise(
                x, torch.ops.mkldnn._reorder_linear_weight(w, 1), None, "none", [], "")
            packed = ops.pack_linear(w)
            for rows in (1, 2, 3, 4, 7, 33):
                if not torch.equal(ops.linear(x[:rows], packed, out_features, 0),
                                   reference[:rows]):
                    return False
    return True


def packed_plan() -> BlockPlan:
    """The plan that multiplies every row count through an exact bf16 kernel: oneDNN's packed
    one, or the native FMA kernel where oneDNN does not pack bf16."""
    kernel = PACKED if packing_supported(torch.bfloat16, torch.device("cpu")) else FMA
    return BlockPlan({rows: kernel for rows in ROW_BUCKETS})


@functools.cache
def small_rows_plan() -> BlockPlan:
    """For small, cache-hot bf16 weights (a draft head, whose drafts need no exactness): a
    native kernel where one is available (the bf16 one was 1.3-2.5x faster than oneDNN's on the
    head's linears, 1-32 rows, on an AMD EPYC without AMX), else oneDNN's packed one; and the
    FMA variant or the AMX one at each row count where it is faster on a head layer's and a
    draft vocabulary's weight (drafts need no exactness, so they mix), measured once per
    machine and cached, so every process drafts alike; the FMA variant alone where oneDNN
    does not pack bf16 (AVX2 only). On the Intel Xeon VM of session 30 (AMX, which oneDNN's
    kernel uses slowly for few rows) the FMA variant costs half of oneDNN's at the 1-2 rows a
    narrow draft level has at batch 1 (a level's linears, caches flushed, 1.08 -> 0.53 ms),
    the AMX one wins at 4-32 rows and oneDNN's at 64 (a catch-up over many positions);
    measured at 8 rows alone, oneDNN's had won by a hair and taken every row count."""
    if not packing_supported(torch.bfloat16, torch.device("cpu")):
        return BlockPlan({rows: FMA for rows in ROW_BUCKETS})  # (exact_bf16_kernels holds)
    kernel = NATIVE if native_linear_ops() is not None else PACKED
    if fma_linear_ops() is None:
        return BlockPlan({rows: kernel for rows in ROW_BUCKETS})
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(rows, 576, generator=gen).bfloat16() for rows in (1536, 8192)]
    amx = (AMX,) if amx_linear_ops() is not None else ()
    return cached_plan(weights, "draft-head", cache_root() / "kernels",
                       candidates=(kernel, FMA, *amx), exact=False)


def exact_bf16_candidates(weights: Sequence[torch.Tensor] = ()) -> tuple[int, ...]:
    """The bf16 kernels that give each output row bitwise the same for any row count: a plan
    mixes oneDNN's packed kernel and the native one where it sums in the same order on this
    CPU, or takes the FMA variant or the AMX one for every row count (`one_family`; AMX where
    every weight's input width fits its tiles, `amx_fits`)."""
    solo = (FMA,) if fma_linear_ops() is not None else ()
    if amx_linear_ops() is not None and amx_fits(weights):
        solo += (AMX,)
    if not packing_supported(torch.bfloat16, torch.device("cpu")):
        return solo
    found = (PACKED, NATIVE) if native_linear_ops() is not None else (PACKED,)
    return found + solo


def one_family(timings: dict[int, dict[int, float]]) -> BlockPlan:
    """{rows: {kernel: ms}} -> the plan of the fastest family: the fastest of PACKED / NATIVE
    per row count, or FMA for all of them, or AMX for all of them (the three give results that
    differ in the last bits, so they never mix). Decided by the sum over the row counts a
    decode or verify step has (up to 16: the trees the budget keeps); wider batches follow."""
    small = [rows for rows in timings if rows <= 16] or list(timings)
    plans: list[tuple[float, BlockPlan]] = []
    if all(any(k not in SOLO_KERNELS for k in t) for t in timings.values()):
        bf16 = {rows: min((k for k in t if k not in SOLO_KERNELS), key=t.get)
                for rows, t in timings.items()}
        plans.append((sum(timings[r][bf16[r]] for r in small), BlockPlan(bf16)))
    for kernel in SOLO_KERNELS:
        if all(kernel in t for t in timings.values()):
            plans.append((sum(timings[r][kernel] for r in small),
                          BlockPlan({rows: kernel for rows in timings})))
    return min(plans, key=lambda p: p[0])[1]


def weights_stamp(*weights: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """What tells whether weights packed earlier are still these: each one's version counter
    (changed in place) and storage (replaced)."""
    return tuple((w._version, w.data_ptr()) for w in weights)


class PackedLinear(nn.Module):
    """A bias-free `nn.Linear` whose inference forward multiplies through a packed bf16
    kernel (`small_rows_plan`: the native one, else oneDNN's). The draft head's small weights
    stay hot in the cache, where the unpacked bf16 matmul re-lays them out every call: on a CPU
    without AMX a head layer at 8 rows took 1.7 ms that way. The weight stays the same
    Parameter (state dicts, training); it is packed again when it changes (its version counter
    or its storage), and a forward that needs gradients, or in a dtype oneDNN does not pack,
    takes `F.linear`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [O, K]
        self._packed: BlockedWeight | None = None
        self._seen: tuple[tuple[int, int], ...] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad)) \
                or not exact_bf16_kernels(self.weight.dtype, self.weight.device):
            return F.linear(x, self.weight)
        return self.blocked()(x)

    def blocked(self) -> BlockedWeight:
        """The packed weight, packed again if the weight changed since."""
        seen = weights_stamp(self.weight)
        if self._packed is None or self._seen != seen:
            self._packed = BlockedWeight(self.weight.detach(), small_rows_plan())
            self._seen = seen
        return self._packed


def pack_linears(module: nn.Module) -> int:
    """Swap every bias-free bf16 CPU `nn.Linear` inside `module` for a `PackedLinear` (where
    oneDNN packs bf16). Idempotent. -> how many were swapped."""
    swapped = 0
    for name, child in list(module.named_children()):
        if (type(child) is nn.Linear and child.bias is None
                and exact_bf16_kernels(child.weight.dtype, child.weight.device)):
            setattr(module, name, PackedLinear(child))
            swapped += 1
        else:
            swapped += pack_linears(child)
    return swapped


def measure_plan(weights: Sequence[torch.Tensor], row_buckets: Sequence[int] = ROW_BUCKETS,
                 candidates: Sequence[int] = BLOCK_BYTES,
                 repeats: int = 3, exact: bool = True) -> tuple[BlockPlan, dict]:
    """Time one pass over `weights` per (row bucket, block size); keep the fastest per bucket.
    exact: FMA, AMX and the bf16 kernels never mix (`one_family`); False (a draft head's weights,
    whose outputs need not be the same at every row count): the fastest at each.

    -> (plan, {bucket: {block_bytes: ms}}). Best of `repeats` after one warm-up pass."""
    dtype, device = weights[0].dtype, weights[0].device
    timings: dict[int, dict[int, float]] = {}
    plan = BlockPlan()
    with torch.inference_mode():
        for rows in row_buckets:
            xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype, device=device)
                  for w in weights}
            timings[rows] = {}
            for block in candidates:
                blocked = [BlockedWeight(w, BlockPlan({b: block for b in ROW_BUCKETS}))
                           for w in weights]
                best = float("inf")
                for i in range(repeats + 1):
                    t0 = time.perf_counter()
                    for bw in blocked:
                        bw(xs[bw.weight.shape[1]])
                    if i:
                        best = min(best, time.perf_counter() - t0)
                timings[rows][block] = round(best * 1e3, 3)
            plan.block_bytes[rows] = min(timings[rows], key=timings[rows].get)
    if exact and set(SOLO_KERNELS) & set(candidates) and len(candidates) > 1:
        plan = one_family(timings)
    return plan, timings




def cached_plan(weights: Sequence[torch.Tensor], name: str, cache_dir: Path,
                refresh: bool = False, candidates: Sequence[int] = BLOCK_BYTES,
                row_buckets: Sequence[int] = ROW_BUCKETS, exact: bool = True) -> BlockPlan:
    """The plan for these weights on this machine: from the cache, else measured and saved."""
    shapes = sorted({tuple(w.shape) for w in weights})
    kernels = tuple(candidates)
    if {NATIVE, FMA, AMX} & set(kernels):  # a changed native kernel is measured again
        kernels += (build_key(),)
    key = machine_key(f"{name}|{shapes}|{weights[0].dtype}|{kernels}"
                      + ("" if tuple(row_buckets) == ROW_BUCKETS else f"|{tuple(row_buckets)}")
                      + ("" if exact else "|mixed"))
    path = cache_dir / f"{key}.json"
    if path.exists() and not refresh:
        data = json.loads(path.read_text())
        return BlockPlan({int(k): v for k, v in data["block_bytes"].items()})
    plan, timings = measure_plan(weights, row_buckets=row_buckets, candidates=candidates,
                                 exact=exact)
    write_json_atomic(path, {"name": name, "shapes": shapes, "threads": torch.get_num_threads(),
                             "block_bytes": plan.block_bytes, "timings_ms": timings})
    return plan

