"""eagle2: lossless EAGLE-2 speculative decoding for Llama-family models.

The algorithm package: no Ray, no gRPC. `services/` adapts it to Ray Serve and gRPC.
Names are imported lazily so that light submodules (prompts, planner) load without torch.
"""

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
