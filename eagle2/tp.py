"""Tensor parallelism for the target (docs/DESIGN.md "Tensor parallelism"): one process per rank, DeepSpeed AutoTP.

Every rank calls `init_tp` (joins the process group), loads the whole target, then
`shard_target` (AutoTP keeps its own slice of every decoder layer and of lm_head). The
returned `TargetModel` drives the sharded HF sub-modules unchanged: q/k/v_proj hold this
rank's KV-head groups (so its KV cache holds only those heads), o_proj, down_proj and lm_head
all-reduce inside, so features and logits come out whole on every rank. All ranks must run the
same calls with the same inputs in lockstep (`services.tp_runner` drives them).

Pure torch/DeepSpeed: this module knows nothing of Ray; DeepSpeed is imported on first use.
"""

from __future__ import annotations

import os

import torch

from eagle2.target import TargetModel, pick_device


def init_tp(rank: int, world_size: int, master_addr: str, master_port: int,
            backend: str | None = None) -> None:
    """Join the tensor-parallel process group as `rank` of `world_size`.

    backend: "nccl" when this process sees a GPU, else "gloo". A Ray actor sees only its own
    GPU, so the local rank is always 0 (device cuda:0), whatever the global rank.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if backend == "nccl" else "cpu")
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_SIZE="1")
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    # DeepSpeed's CPU shared-memory all-reduce kernel SIGSEGVs on some CPUs (docs/DESIGN.md "Environment notes"); level 0
    # makes inference_all_reduce fall back to the process group's all_reduce.
    ds_comm.cdb.shm_vector_kernel_level = 0


def check_tp_size(config, tp_size: int) -> None:
    """ValueError unless AutoTP splits `config` (a Llama config) evenly over tp_size ranks."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if tp_size > num_kv_heads:
        raise ValueError(f"tp_size={tp_size} exceeds the model's {num_kv_heads} KV heads: AutoTP "
                         "splits by whole KV-head groups; use a tp_size that divides it")
    if num_kv_heads % tp_size or num_heads % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the model's {num_heads} attention "
                         f"/ {num_kv_heads} KV heads; the rank with an extra head group would "
                         "slow every step: use a divisor of the KV-head count")


def shard_target(target: TargetModel, tp_size: int, device: str | None = None) -> TargetModel:
    """This rank's shard of `target` (AutoTP, no kernel injection), placed on `device`.

    device: default cuda:0 when this process sees a GPU (the one a Ray actor was given),
    else CPU. The dtype stays the target's. Needs `init_tp` first when tp_size > 1.
    """
    check_tp_size(target.config, tp_size)
    dev = pick_device(device)
    if tp_size == 1:
        return TargetModel(target.hf.to(dev), target.tokenizer, target.name)
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() != tp_size:
        world = dist.get_world_size() if dist.is_initialized() else None
        raise ValueError(f"shard_target(tp_size={tp_size}) needs init_tp with world_size "
                         f"{tp_size} first (process group world size: {world})")
    engine = deepspeed.init_inference(target.hf, tensor_parallel={"tp_size": tp_size},
                                      replace_with_kernel_inject=False, dtype=target.dtype)
    sharded = TargetModel(engine.module.to(dev).eval(), target.tokenizer, target.name)
    sharded.lm_head = AnyShapeLmHead(sharded.lm_head)
    return sharded


class AnyShapeLmHead(torch.nn.Module):
    """AutoTP's sharded lm_head (LmHeadLinearAllreduce) slices its input as x[:, :, shard], so
    it takes [B, N, H] only; this one takes [..., H] (e.g. the [B, H] of a prefill's last token).
    """

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        out = self.inner(x.reshape(-1, 1, x.shape[-1]))  # [M, 1, V]
        return out.reshape(*x.shape[:-1], out.shape[-1])
