"""The application builder that `serve run` / `serve deploy` import:

    serve run services.app:build_app            # embedded default, CPU
    serve deploy deploy/serve-llama3-70b.yaml   # import_path: services.app:build_app
"""

from __future__ import annotations

from ray.serve import Application

from services.config import ServiceConfig
from services.draft_worker import DraftWorker
from services.engine import TargetEngine
from services.router import Router


def build_app(args: dict | None = None) -> Application:
    """Router -> TargetEngine (the target, or its tp_size rank actors) -> DraftWorker (its own
    replica/GPU)."""
    cfg = ServiceConfig(**(args or {}))
    conf = cfg.model_dump()
    draft = None
    if cfg.draft_placement == "worker" and not (cfg.tree.mode == "vanilla" and cfg.draft is None):
        draft = DraftWorker.options(
            num_replicas=cfg.num_replicas,
            ray_actor_options={"num_cpus": 1, "num_gpus": int(cfg.use_gpu) *
                               cfg.draft_gpu_fraction},
        ).bind(conf)
    engine = TargetEngine.options(
        num_replicas=cfg.num_replicas, ray_actor_options=engine_resources(cfg),
        max_queued_requests=cfg.max_queued_requests).bind(conf, draft)
    return Router.options(max_queued_requests=cfg.max_queued_requests).bind(conf, engine)


def engine_resources(cfg: ServiceConfig) -> dict:
    """The engine replica's Ray resources. Holding the target, or rank 0 of it, it reserves
    what a rank would (cpus_per_rank, the rank's GPU share); with the target on rank actors
    (their own placement group), one CPU. A head in the replica (draft_placement
    "inprocess") gets a whole GPU, shared with the target when the target is there too."""
    inprocess_head = cfg.draft_placement == "inprocess"
    gpus = 0.0
    if cfg.use_gpu and inprocess_head:
        gpus = 1.0
    elif cfg.target_in_engine():
        gpus = cfg.gpu_per_rank()
    holds_rank = cfg.resolved_target_placement() == "engine"
    return {"num_cpus": cfg.cpus_per_rank if holds_rank else 1, "num_gpus": gpus}
