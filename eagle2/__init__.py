"""eagle2: lossless EAGLE-2 speculative decoding for Llama-family models.

The algorithm package: no Ray, no gRPC. `services/` adapts it to Ray Serve and gRPC.
Names are imported lazily so that light submodules (prompts, planner) load without torch.

OpenMP threads that spin while they wait collapse as soon as another process wants a core
(docs/cpu-backend.md, "CPU performance"): every entry point imports this package before torch, so
passive waiting is put into the environment here, where the OpenMP runtime that torch loads
still reads it. Passive alone makes every parallel region wake its threads from sleep (~120
regions a forward: two threads had decoded slower than one), so a thread that finishes a region
first spins for a short, bounded while (GOMP_SPINCOUNT, ~0.2 ms), long enough to catch the
layer's next region, too short to hold a core between steps. An explicit OMP_WAIT_POLICY or
GOMP_SPINCOUNT is kept.
"""

import os as _os
import sys as _sys

# libgomp spins (~9 ns each: a `pause`, Xeon VM) before a waiting thread sleeps. 5,000 (~50
# us) let the thread sleep within a verified tree's forward (10-16 tokens: the serial parts
# of a layer and the threads' uneven shares of its attention), and the next region woke it:
# forwards of 10 / 16 tokens 11.3 / 13.1 ms at 5,000, 10.7 / 12.0 at 20,000 (docs/cpu-backend.md
# "CPU performance")
SPIN_COUNT = "20000"

if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    if "torch" in _sys.modules:
        import warnings as _warnings

        _warnings.warn("torch was imported before eagle2, so its OpenMP threads spin while they "
                       "wait and slow down sharply beside other busy processes; import eagle2 "
                       "first or set OMP_WAIT_POLICY=PASSIVE", RuntimeWarning, stacklevel=2)

__version__ = "0.1.0"
__all__ = ["Completion", "Eagle2", "SamplingParams", "TreeConfig"]


def __getattr__(name: str):
    if name in ("Eagle2", "Completion"):
        from eagle2 import api

        return getattr(api, name)
    if name in ("SamplingParams", "TreeConfig"):
        from eagle2 import config

        return getattr(config, name)
    raise AttributeError(f"module 'eagle2' has no attribute {name!r}")
