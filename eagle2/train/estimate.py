"""The planner's estimate for training a head on one node: memory, disk and time per stage.

See docs/training.md "A head for a target larger than one GPU". `python -m
eagle2.train.estimate --model llama-3.3-70b --gpus 8` prints it. Shapes come from the serving
planner's specs (`eagle2.plan`); the rates are the GPU's datasheet figures times assumed
efficiencies (below), so the times are estimates to size a run, not measurements.

Stages (`eagle2 train-head`):
1. data: copies of the target spread over G_c GPUs each (`--device-map`, the smallest
   divisor of the node's GPUs whose memory holds the weights), each decoding whole chunks
   with HF generate; a decode step reads every weight once (memory-bound, one GPU busy at a
   time) and a chunk takes max_new_tokens steps.
2. features: the same copies, one forward per conversation: 2 P FLOPs a token, one GPU of a
   copy busy at a time. Shards: fp16 final features (H a token) and, for EAGLE-3, the three
   layers' inputs (3H more).
3. train: DeepSpeed ZeRO-2 data parallel over all GPUs: bf16 head weights on every GPU, its
   gradients, fp32 master weights and AdamW moments partitioned; the target's embedding and
   lm_head (frozen, fp32 as loaded) on every GPU; 6 FLOPs a head parameter a token plus the
   draft logits' matmuls, plus reading the mapped shards once an epoch (not overlapped). An
   EAGLE-3 head (the training-time test on stored features): 4 unrolled steps, and the
   target's logits recomputed from the final features ([tokens, V] fp32 and their softmax).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from eagle2.plan.memory import draft_params, kv_bytes_per_token, num_params
from eagle2.plan.specs import GIB, ModelSpec, eagle3_head_for, eagle_head_for, load_model_spec


@dataclass(frozen=True)
class Node:
    """One node's GPUs (H100 SXM datasheet figures) and the efficiencies assumed."""

    num_gpus: int = 8
    memory_gib: float = 80.0
    bandwidth_tbs: float = 3.35  # HBM, TB/s
    bf16_tflops: float = 989.0  # dense
    bandwidth_efficiency: float = 0.5  # HF generate over a device_map: small kernels, hooks
    flops_efficiency: float = 0.35  # forward of the target; the head's training step
    disk_read_gbs: float = 2.0  # GB/s the node reads mapped shards at (local NVMe)

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.memory_gib <= 0:
            raise ValueError("num_gpus must be >= 1 and memory_gib > 0")
        if not (0 < self.bandwidth_efficiency <= 1 and 0 < self.flops_efficiency <= 1):
            raise ValueError("efficiencies must be in (0, 1]")


@dataclass(frozen=True)
class Data:
    """The data set: conversations and their mean token counts."""

    num_conversations: int = 68_000
    prompt_tokens: int = 200
    answer_tokens: int = 500
    max_new_tokens: int = 1024
    chunk_size: int = 64
    epochs: float = 4.0

    @property
    def tokens(self) -> int:
        return self.num_conversations * (self.prompt_tokens + self.answer_tokens)


@dataclass(frozen=True)
class Stage:
    name: str
    gpus_per_process: int
    num_processes: int
    gib_per_gpu: float
    disk_gib: float
    hours: float


def gpus_per_copy(weight_bytes: int, node: Node, headroom: float = 0.75) -> int:
    """The fewest GPUs (a divisor of the node's) whose memory x headroom holds the weights
    (the rest: KV cache and activations)."""
    need = weight_bytes / (headroom * node.memory_gib * GIB)
    for g in range(1, node.num_gpus + 1):
        if node.num_gpus % g == 0 and g >= need:
            return g
    raise ValueError(f"{weight_bytes / GIB:.0f} GiB of weights do not fit {node.num_gpus} GPUs")


def shard_bytes_per_token(hidden: int, eagle3_features: bool = False) -> int:
    """A feature shard's bytes a token: fp16 features (H; 4H with the EAGLE-3 layers), the
    token id (int32) and the loss mask (bool)."""
    return 2 * hidden * (4 if eagle3_features else 1) + 4 + 1


def train_head_params(model: ModelSpec, eagle3: bool = False) -> int:
    """The trained head's parameters: EAGLE-1/2 (fc 2H -> H, one layer) or EAGLE-3 (fc 3H -> H,
    one 2H-input layer, norms, a 32000-token lm_head)."""
    return draft_params(eagle3_head_for(model) if eagle3 else eagle_head_for(model))


def head_memory_bytes(head_params: int, world: int) -> int:
    """ZeRO-2 with bf16: weights (2 B) whole on every GPU; gradients (2 B), fp32 master
    weights (4 B) and AdamW's two moments (8 B) partitioned over the world."""
    return 2 * head_params + (2 + 4 + 8) * head_params // world


def estimate(model: ModelSpec, node: Node = Node(), data: Data = Data(),
             eagle3_features: bool = False, batch_tokens: int = 16384) -> list[Stage]:
    """The three stages' estimates (see the module doc)."""
    params = num_params(model)
    weights = 2 * params  # bf16
    per_copy = gpus_per_copy(weights, node)
    copies = node.num_gpus // per_copy
    hidden = model.hidden_size
    # data: a chunk = max_new_tokens decode steps, each reading all weights once
    chunks = math.ceil(data.num_conversations / data.chunk_size)
    step_s = weights / (node.bandwidth_tbs * 1e12 * node.bandwidth_efficiency)
    data_h = math.ceil(chunks / copies) * data.max_new_tokens * step_s / 3600
    kv = kv_bytes_per_token(model, 2) * data.chunk_size * (data.prompt_tokens
                                                            + data.max_new_tokens)
    data_gib = (weights + kv) / per_copy / GIB
    text_gib = data.tokens * 4 / GIB  # int32 ids in the chunk files (json: a few times this)
    # features: 2 P FLOPs a token; shards: fp16 features (+ three layers for EAGLE-3)
    flops = node.bf16_tflops * 1e12 * node.flops_efficiency
    feat_h = 2 * params * data.tokens / (copies * flops) / 3600
    shard_gib = data.tokens * shard_bytes_per_token(hidden, eagle3_features) / GIB
    act = batch_tokens * hidden * 2 * 8  # residual stream and its transients, bf16
    feat_gib = (weights + act) / per_copy / GIB
    # train: ZeRO-2 over all GPUs
    head_params = train_head_params(model, eagle3_features)
    vocab = 2 * model.vocab_size * hidden * 4  # embedding + lm_head, fp32
    step_flops = 6 * head_params + 3 * 2 * hidden * model.vocab_size  # + draft logits
    if eagle3_features:  # the training-time test: 4 unrolled steps; target logits [T, V] fp32
        step_flops = 4 * 6 * head_params + 2 * hidden * model.vocab_size
        vocab += 2 * batch_tokens * model.vocab_size * 4  # logits and their softmax
    compute_s = data.epochs * data.tokens * step_flops / (node.num_gpus * flops)
    read_s = data.epochs * shard_gib * GIB / (node.disk_read_gbs * 1e9)  # not overlapped
    train_h = (compute_s + read_s) / 3600
    train_gib = (head_memory_bytes(head_params, node.num_gpus) + vocab
                 + batch_tokens * hidden * 4 * 16) / GIB
    return [Stage("data", per_copy, copies, data_gib, text_gib, data_h),
            Stage("features", per_copy, copies, feat_gib, shard_gib, feat_h),
            Stage("train", 1, node.num_gpus, train_gib, 0.0, train_h)]


def format_estimate(model: ModelSpec, stages: list[Stage], data: Data) -> str:
    lines = [f"{model.name}: {num_params(model) / 1e9:.1f}B parameters, "
             f"{data.num_conversations} conversations, {data.tokens / 1e6:.1f}M tokens",
             f"{'stage':<9} {'processes':>9} {'GPUs each':>9} {'GiB/GPU':>8} "
             f"{'disk GiB':>9} {'hours':>7}"]
    for s in stages:
        lines.append(f"{s.name:<9} {s.num_processes:>9} {s.gpus_per_process:>9} "
                     f"{s.gib_per_gpu:>8.1f} {s.disk_gib:>9.1f} {s.hours:>7.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle2.train.estimate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.3-70b", help="a planner preset or config.json")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    p.add_argument("--conversations", type=int, default=68_000)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--answer-tokens", type=int, default=500)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--eagle3-features", action="store_true",
                   help="an EAGLE-3 head: the features stage stores the three layers' inputs "
                        "too (--arch eagle3), training runs the training-time test on them "
                        "(--stored-features)")
    args = p.parse_args(argv)
    model = load_model_spec(args.model)
    data = Data(args.conversations, args.prompt_tokens, args.answer_tokens,
                args.max_new_tokens, epochs=args.epochs)
    node = Node(num_gpus=args.gpus, memory_gib=args.gpu_memory_gib)
    print(format_estimate(model, estimate(model, node, data, args.eagle3_features), data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
