"""Which device, dtype and backend a model runs with (the one place that names backends).

`backend_for` gives the CPU backend (`eagle2.cpu`) to CPU models and the torch backend
(`eagle2.backend.Backend`) to everything else; see docs/cpu-backend.md.
"""

from __future__ import annotations

import torch

from eagle2.backend import Backend


def pick_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def exact_bf16_kernels(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 on a CPU with a linear kernel whose output rows are bitwise the same for any row
    count (what exact bf16 verification needs): `eagle2.cpu.kernels.exact_bf16_kernels`."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    from eagle2.cpu.kernels import exact_bf16_kernels as cpu_exact

    return cpu_exact(dtype, device)


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Unless told: bf16 on GPUs and on CPUs with exact bf16 kernels (oneDNN's with AMX or
    AVX512-BF16, or eagle2's native FMA kernel with AVX2: half the bytes of fp32 and a flatter
    cost in the rows, docs/cpu-backend.md; on an AVX2-only AMD EPYC one token's forward took
    18.2 ms in bf16 against 69.5 in fp32, 8 tokens 49.8 against 106.0), else fp32 (without
    them bf16 is converted and runs slower than fp32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda" or exact_bf16_kernels(torch.bfloat16, device):
            return torch.bfloat16
        return torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names)}")
    return names[dtype]


def backend_for(device: torch.device, dtype: torch.dtype) -> Backend:
    """A new backend instance for a model on this device in this dtype."""
    if device.type == "cpu":
        from eagle2.cpu import CpuBackend

        return CpuBackend(dtype, device)
    return Backend()
