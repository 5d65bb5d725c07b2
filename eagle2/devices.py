"""Which device, dtype and backend a model runs with (the one place that names backends).

`backend_for` gives the CPU backend (`eagle2.cpu`) to CPU models, the torch backend with
FlexAttention tree attention (`eagle2.flex.FlexBackend`) to CUDA models and the torch backend
(`eagle2.backend.Backend`, SDPA over a dense mask) to others; the attention can be chosen
(`backend_for(..., attention=)` or the EAGLE2_ATTENTION environment variable: "flex" on any
device, "sdpa" for the dense mask); see docs/cpu-backend.md.
"""

from __future__ import annotations

import logging
import os

import torch

from eagle2.backend import Backend

log = logging.getLogger(__name__)

# the attention a model's backend uses: "auto" (the CPU backend on CPUs, FlexAttention on
# CUDA, SDPA over a dense mask elsewhere), "flex" (FlexAttention on any device: compiled on
# CUDA, eager elsewhere, e.g. for the CPU tests) or "sdpa" (SDPA over a dense mask: the torch
# backend; on a CPU the CPU backend, which keeps its own kernels)
ATTENTION_ENV = "EAGLE2_ATTENTION"
ATTENTIONS = ("auto", "flex", "sdpa")


def pick_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_lost(error: BaseException) -> str | None:
    """What `error` says where it leaves this process's GPU unusable (its type and the start
    of its message), else None: a CUDA error (an illegal memory access, a device-side assert:
    `torch.AcceleratorError`) poisons the process's CUDA context, so every later call fails
    too and only a new process recovers. Running out of memory is not one (the allocator
    frees the failed step's tensors)."""
    if isinstance(error, torch.OutOfMemoryError):
        return None
    accelerator_error = getattr(torch, "AcceleratorError", None)
    lost = (accelerator_error is not None and isinstance(error, accelerator_error)) or (
        isinstance(error, RuntimeError) and "CUDA error" in str(error))
    return f"{type(error).__name__}: {str(error)[:200]}" if lost else None


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


def attention_choice(attention: str | None = None) -> str:
    """The attention asked for: `attention`, else $EAGLE2_ATTENTION, else "auto"."""
    choice = attention or os.environ.get(ATTENTION_ENV) or "auto"
    if choice not in ATTENTIONS:
        where = "the argument" if attention else ATTENTION_ENV
        raise ValueError(f"unknown attention {choice!r} (from {where}); use one of {ATTENTIONS}")
    return choice


def _flex_backend(device: torch.device, dtype: torch.dtype, choice: str
                  ) -> tuple[Backend, str]:
    """FlexBackend, compiled where it compiles by default (CUDA). Where its compile fails
    (`flex.compile_failure`): an error if FlexAttention was asked for by name, else SDPA over
    a dense mask, with a warning (eager FlexAttention would materialize every score)."""
    from eagle2.flex import FlexBackend, compile_failure

    backend = FlexBackend()
    if not backend.compiles(device):
        return backend, "FlexAttention (eager)"
    failed = compile_failure(device, dtype)
    if failed is None:
        return backend, "FlexAttention (compiled)"
    if choice == "flex":
        raise RuntimeError(f"FlexAttention (asked for by {ATTENTION_ENV} or the argument) does "
                           f"not compile on {device}: {failed}")
    log.warning("FlexAttention does not compile on %s (%s): SDPA over a dense mask instead",
                device, failed)
    return Backend(), "SDPA over a dense mask (FlexAttention did not compile)"


def backend_for(device: torch.device, dtype: torch.dtype,
                attention: str | None = None) -> Backend:
    """A new backend instance for a model on this device in this dtype (the choice is logged:
    once per model loaded). attention: see `ATTENTIONS` (None: $EAGLE2_ATTENTION, else
    "auto")."""
    choice = attention_choice(attention)
    if choice == "flex" or (choice == "auto" and device.type == "cuda"):
        backend, what = _flex_backend(device, dtype, choice)
    elif device.type == "cpu":
        from eagle2.cpu import CpuBackend

        backend = CpuBackend(dtype, device)
        what = "the CPU backend's (exact or SDPA, chosen when the layers are prepared)"
    else:
        backend = Backend()
        what = "SDPA over a dense mask"
    log.info("attention for a %s model on %s: %s", str(dtype).removeprefix("torch."), device,
             what)
    return backend
