"""Background load for benchmarks: N busy-loop processes, bounded in time, always killed.

A laptop or server always has other busy processes; `eagle2 bench --background-load 1` measures
what they do to speculation instead of assuming it (docs/cpu-backend.md, "CPU performance").
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

# each process spins until this deadline even if the parent dies without cleaning up
_SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def busy_processes(count: int, max_seconds: float = 4 * 3600) -> Iterator[list[int]]:
    """Run `count` single-threaded busy loops (lowest priority is *not* used: they compete as
    an ordinary process would) for the duration of the block; yields their pids."""
    if count < 0:
        raise ValueError(f"background load must be >= 0 processes, got {count}")
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN.format(seconds=max_seconds)])
             for _ in range(count)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
