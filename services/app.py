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
    """Router -> TargetEngine (tp_size rank actors) -> DraftWorker (its own replica/GPU)."""
    cfg = ServiceConfig(**(args or {}))
    conf = cfg.model_dump()
    gpu = 1 if cfg.use_gpu else 0
    draft = None
    if cfg.draft_placement == "worker" and not (cfg.tree.mode == "vanilla" and cfg.draft is None):
        draft = DraftWorker.options(
            num_replicas=cfg.num_replicas,
            ray_actor_options={"num_cpus": 1, "num_gpus": gpu * cfg.draft_gpu_fraction},
        ).bind(conf)
    engine = TargetEngine.options(
        num_replicas=cfg.num_replicas,
        ray_actor_options={"num_cpus": 1, "num_gpus": gpu if draft is None and
                           cfg.draft_placement == "inprocess" else 0},
        max_queued_requests=cfg.max_queued_requests).bind(conf, draft)
    return Router.options(max_queued_requests=cfg.max_queued_requests).bind(conf, engine)
