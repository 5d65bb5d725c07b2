"""The data and features stages for a target larger than one device: the target spread over
devices by Hugging Face's loading (accelerate's `device_map`), one such copy per process.

See docs/training.md "A head for a target larger than one GPU".

A 70B target in bf16 (~141 GB) fits no single GPU; `from_pretrained(device_map=...)` puts
consecutive decoder layers on consecutive devices and accelerate's hooks move the residual
stream from one device to the next (a pipeline without overlap: one device computes at a
time). Several processes share a node by splitting its GPUs: under a launcher (torchrun sets
LOCAL_RANK and LOCAL_WORLD_SIZE) process r of n takes GPUs [r G / n, (r + 1) G / n) of the G
it sees, and the conversation chunks r, r + n, ... (`--worker auto`); chunks and shards are
written atomically and skipped once written, so a killed stage resumes where it stopped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch


def worker_of(spec: str) -> tuple[int, int]:
    """`--worker I/N`, or `auto`: this process's RANK / WORLD_SIZE set by a launcher (0/1
    without one)."""
    if spec == "auto":
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--worker {spec!r}: give I/N (e.g. 0/2) or auto") from None
    if not 0 <= i < n:
        raise ValueError(f"--worker {spec!r}: I must be in 0..N-1")
    return i, n


def device_share(local_rank: int, local_world: int, num_gpus: int) -> list[int]:
    """GPU indices of process `local_rank` of `local_world` on a node with num_gpus GPUs.

    E.g. 8 GPUs, 2 processes: [0, 1, 2, 3] and [4, 5, 6, 7]."""
    if num_gpus % local_world:
        raise ValueError(f"{num_gpus} GPUs do not split evenly over {local_world} processes")
    per = num_gpus // local_world
    return list(range(local_rank * per, (local_rank + 1) * per))


def local_gpus() -> list[int]:
    """This process's share of the node's GPUs (all of them without a launcher)."""
    if not torch.cuda.is_available():
        return []
    rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return device_share(rank, world, torch.cuda.device_count())


def load_across_devices(spec: str | None, dtype: torch.dtype, device_map: str | dict,
                        gpus: list[int] | None = None, offload_folder: str | None = None):
    """The target's HF model spread by accelerate over `gpus` (default: `local_gpus()`).

    device_map: "auto" / "balanced" / "sequential" (accelerate places whole decoder layers,
    filling the GPUs given and nothing else), or an explicit {module name: device} (devices:
    GPU indices, "cpu", or "disk" with offload_folder), which is how the tests split a tiny
    target over the CPU and the disk."""
    from transformers import AutoModelForCausalLM

    from eagle2.target import embedded_model_dir

    path = embedded_model_dir() if spec is None else Path(spec)
    if path.is_file():
        raise ValueError("--device-map needs a model directory (not a .gguf)")
    kwargs: dict = {"dtype": dtype, "device_map": device_map}
    if isinstance(device_map, str):
        gpus = local_gpus() if gpus is None else gpus
        if not gpus:
            raise ValueError(f"--device-map {device_map}: no GPU visible; give an explicit "
                             "map or run the features stage without --device-map")
        # 90% of what is free: the rest for activations and the allocator's slack
        kwargs["max_memory"] = {i: int(0.9 * torch.cuda.mem_get_info(i)[0]) for i in gpus}
    if offload_folder is not None:  # one folder a process: each writes its offloaded weights
        kwargs["offload_folder"] = str(Path(offload_folder) / f"rank{os.environ.get('RANK', 0)}")
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def placement(hf_model) -> dict[str, str]:
    """Where accelerate put each module ({} for a model on one device)."""
    return {k: str(v) for k, v in getattr(hf_model, "hf_device_map", {}).items()}


@dataclass(frozen=True)
class Answer:
    token_ids: list[int]  # the answer, its EOS included when it stopped there


class SpreadGenerator:
    """The data stage's answers from a target spread over devices: HF `generate` (greedy, or
    sampling seeded per chunk), the two methods `generate_conversations` calls. Slower than
    the engine (no speculation, one device busy at a time) but needs no device that holds the
    whole target. Answers stop at EOS (kept, as the engine keeps it) or max_tokens."""

    def __init__(self, hf_model, tokenizer, eos_ids: frozenset[int]):
        self.hf, self.tokenizer, self.eos_ids = hf_model, tokenizer, eos_ids

    def encode(self, prompt: str) -> list[int]:
        from eagle2.text import encode_prompt

        return encode_prompt(self.tokenizer, prompt)

    @torch.inference_mode()
    def generate(self, prompts: list[str], params, mode: str = "vanilla") -> list[Answer]:
        assert mode == "vanilla", mode
        ids = [self.encode(p) for p in prompts]
        width = max(len(x) for x in ids)
        pad = 0
        batch = torch.tensor([[pad] * (width - len(x)) + x for x in ids])  # left-padded
        attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        if params.seed is not None:
            torch.manual_seed(params.seed)
        sample = params.temperature > 0
        out = self.hf.generate(
            batch.to(self.hf.device), attention_mask=attn.to(self.hf.device),
            max_new_tokens=params.max_tokens, do_sample=sample,
            temperature=params.temperature if sample else None, top_p=params.top_p,
            top_k=params.top_k or None, pad_token_id=pad,
            eos_token_id=sorted(self.eos_ids) or None)
        return [Answer(self._cut(row[width:].tolist())) for row in out.cpu()]

    def _cut(self, tokens: list[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t in self.eos_ids:
                return tokens[:i + 1]
        return tokens
