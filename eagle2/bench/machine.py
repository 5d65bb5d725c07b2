"""What a benchmark run records about where it ran: the head, the machine and its load."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def head_name(args, llm) -> str:
    from eagle2.api import shipped_head_dir
    from eagle2.target import EMBEDDED_NAME

    if args.draft:
        return args.draft
    name = llm.target.name
    shipped = shipped_head_dir(EMBEDDED_NAME if name == EMBEDDED_NAME else Path(name).name)
    return str(shipped) if shipped else "untrained (no shipped head)"


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info(llm, load_start) -> dict:
    import transformers

    return {
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        # the engine's thread count following other processes' load (auto threads only)
        "threads_follow_load": llm.engine.threads is not None,
        "thread_switches": list(llm.engine.stats.thread_switches),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else None,
        "device": str(llm.target.device), "dtype": str(llm.target.dtype).removeprefix("torch."),
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "loadavg_start": load_start, "loadavg_end": loadavg(),
    }
