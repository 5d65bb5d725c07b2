"""Deployment artifacts: the Serve config, the RayService manifest, published-layout heads
(the EAGLE-3 head the configs deploy, and EAGLE-1/2 heads, which still load)."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / "deploy" / "serve-llama3-70b.yaml"
RAYSERVICE = ROOT / "deploy" / "rayservice-llama3-70b.yaml"


def serve_config() -> dict:
    return yaml.safe_load(SERVE.read_text())


def test_serve_config_resolves_to_the_app_builder_and_typed_config():
    from ray.serve import Application

    from services.config import ServiceConfig

    conf = serve_config()
    app = conf["applications"][0]
    module, attr = app["import_path"].split(":")
    builder = getattr(importlib.import_module(module), attr)
    from services.app import build_app

    assert builder is build_app
    cfg = ServiceConfig(**app["args"])
    assert cfg.tp_size == 4 and cfg.use_gpu and cfg.draft_placement == "worker"
    assert cfg.num_replicas == 2 and cfg.gpu_per_rank() == 0.9  # the draft shares a GPU
    assert cfg.target.startswith("/mnt/models/") and cfg.draft.startswith("/mnt/models/")
    assert isinstance(build_app(app["args"]), Application)  # builds the graph, deploys nothing
    grpc = conf["grpc_options"]
    assert grpc["port"] == cfg.grpc_port == 9000
    for path in grpc["grpc_servicer_functions"]:
        module, _, name = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module), name))


def _deployed_models():
    """The planner's specs for the Serve config's target and head, found by directory name
    (the Hugging Face repository names, downloaded as they are)."""
    from eagle2 import plan

    args = serve_config()["applications"][0]["args"]
    assert Path(args["target"]).name == "Llama-3.3-70B-Instruct"
    (preset,) = [p for p in plan.DRAFT_PRESETS.values()
                 if p.repo.rpartition("/")[2] == Path(args["draft"]).name]
    return args, plan.PRESETS[preset.target], preset


def test_serve_config_draft_is_the_published_eagle3_head_for_its_target():
    from eagle2 import plan

    args, model, preset = _deployed_models()
    assert preset.repo == "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B"
    assert (preset.target, preset.kind) == ("llama-3.3-70b", "eagle3")
    # what `eagle2 plan --model llama-3.3-70b` assumes by default is what is deployed
    assert plan.load_draft_spec("auto", model) == preset.spec()
    assert args["max_context"] <= model.max_position_embeddings


def test_serve_config_layout_is_the_planners_first_choice():
    """replicas x tp and the draft worker's GPU share are what `eagle2 plan --layouts` ranks
    first for Llama-3.3-70B + its EAGLE-3 head on 8 x 80 GiB, for the config's batch and tree."""
    from eagle2 import plan

    args, model, preset = _deployed_models()
    work = plan.Workload(max_batch=args["max_running"], context_len=args["max_context"],
                         tree_tokens=args["tree"]["total_tokens"], depth=args["tree"]["depth"])
    best = plan.node_layouts(model, preset.spec(), 8, plan.Hardware(80.0), work)[0]
    assert (best.replicas, best.tp_size, best.draft) == (
        args["num_replicas"], args["tp_size"], "shared")
    assert best.draft_gpu_fraction == args["draft_gpu_fraction"] and best.idle_gpus == 0
    assert best.batch == args["max_running"]


def test_serve_config_layout_fits_by_the_planners_memory_accounting():
    """What the processes allocate on the GPU a rank shares with its draft worker, in the
    planner's per-tensor sizes: the rank's shard and its share of the paged KV cache
    (kv_cache_memory / tp_size), the worker's head, the target's embedding (EAGLE-3) it loads,
    d2t and its KV cache (DraftWorker: 2 x max_running slots of max_context + the drafter's
    margin)."""
    import inspect

    from eagle2 import plan
    from eagle2.drafter import Drafter
    from eagle2.engine import Engine

    args, model, preset = _deployed_models()
    draft, nbytes, gpu = preset.spec(), 2, 80 * plan.GIB  # bf16, 80 GiB H100
    tp, batch, context = args["tp_size"], args["max_running"], args["max_context"]
    rank = plan.rank_params(model, tp, 0) * nbytes + args["kv_cache_memory"] // tp
    # the rank's blocks hold every running request at its whole context
    per_request = -(-(context + Engine.tree_margin) // 32) * 32 * plan.kv_bytes_per_token(
        model, 2, tp)
    assert batch * per_request <= args["kv_cache_memory"] // tp
    margin = inspect.signature(Drafter).parameters["tree_margin"].default
    worker = (plan.draft_worker_params(model, draft) * nbytes + plan.draft_buffer_bytes(draft)
              + 2 * batch * (context + margin) * plan.kv_bytes_per_token(draft.model, 2))
    assert worker == 4_907_657_216 + 32 * 8448 * 4096 == 6_014_953_472  # 5.60 GiB
    assert worker <= args["draft_gpu_fraction"] * gpu  # its Ray share: 8 GiB
    assert rank + worker <= gpu * (1 - plan.Hardware().reserve_fraction)  # 69.4 of 72 GiB


def test_rayservice_carries_the_same_serve_config_and_enough_gpus():
    manifest = yaml.safe_load(RAYSERVICE.read_text())
    assert manifest["kind"] == "RayService" and manifest["apiVersion"] == "ray.io/v1"
    spec = manifest["spec"]
    assert yaml.safe_load(spec["serveConfigV2"]) == serve_config()
    args = serve_config()["applications"][0]["args"]
    groups = spec["rayClusterConfig"]["workerGroupSpecs"]
    gpus = [int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
            for g in groups for c in g["template"]["spec"]["containers"]]
    # every replica's ranks; the draft workers share their GPUs (draft_gpu_fraction < 1)
    assert max(gpus) >= args["tp_size"] * args["num_replicas"]
    head = spec["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "serve-grpc", "containerPort": 9000} in head["ports"]
    worker = groups[0]["template"]["spec"]["containers"][0]
    assert "readinessProbe" in worker


def test_head_in_published_llama3_70b_layout_loads(tmp_path):
    """EAGLE-LLaMA3-Instruct-70B's key names and config fields, at shrunk dimensions."""
    import json

    from conftest import make_engine, random_prompts, run, tiny_target

    from eagle2.config import SamplingParams, TreeConfig
    from eagle2.drafter import Drafter
    from eagle2.engine import Engine
    from eagle2.head import load_head
    from eagle2.runner import LocalRunner

    h, inter, heads, kv, vocab = 64, 128, 4, 2, 48
    config = {  # the published config.json's fields (values shrunk)
        "architectures": ["LlamaForCausalLM"], "bias": False, "bos_token_id": 128000,
        "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": h,
        "initializer_range": 0.02, "intermediate_size": inter, "max_position_embeddings": 8192,
        "model_type": "llama", "num_attention_heads": heads, "num_hidden_layers": 1,
        "num_key_value_heads": kv, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
        "vocab_size": vocab,
    }
    g = torch.Generator().manual_seed(0)
    d = h // heads
    shapes = {
        "fc.weight": (h, 2 * h), "embed_tokens.weight": (vocab, h),
        "layers.0.self_attn.q_proj.weight": (heads * d, h),
        "layers.0.self_attn.k_proj.weight": (kv * d, h),
        "layers.0.self_attn.v_proj.weight": (kv * d, h),
        "layers.0.self_attn.o_proj.weight": (h, heads * d),
        "layers.0.mlp.gate_proj.weight": (inter, h), "layers.0.mlp.up_proj.weight": (inter, h),
        "layers.0.mlp.down_proj.weight": (h, inter),
        "layers.0.post_attention_layernorm.weight": (h,),
    }
    state = {k: (torch.randn(s, generator=g) * 0.05).half() for k, s in shapes.items()}
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save(state, tmp_path / "pytorch_model.bin")
    head = load_head(tmp_path, dtype=torch.float32)
    assert head.fc.bias is None
    torch.testing.assert_close(head.fc.weight, state["fc.weight"].float())
    # ... and drives a lossless generation through the engine like any head
    target = tiny_target(vocab=vocab, hidden=h, heads=heads, kv_heads=kv, seed=2)
    drafter = Drafter(head, target.embed, target.lm_head, max_slots=2, max_len=256)
    engine = Engine(LocalRunner(target, 2, 256 + Engine.tree_margin), drafter, 2, 256)
    prompts = random_prompts(2, vocab, seed=1)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    tree = TreeConfig("eagle2", total_tokens=10, depth=3, top_k=3, budget="fixed")
    assert run(engine, prompts, greedy, tree) == run(make_engine(target, None), prompts, greedy,
                                                     TreeConfig("vanilla"))


def test_eagle3_head_directory_planner_and_loader_agree(tmp_path):
    """A head directory in the EAGLE-3 release's layout (shrunk): `eagle2 plan --draft DIR`
    and the loader the service uses read the same kind and the same parameter count."""
    import json
    import math

    from eagle2 import plan
    from eagle2.head import head_feature_layers, load_head

    h, inter, heads, kv, vocab, draft_vocab = 64, 128, 4, 2, 48, 16
    config = {  # yuhuili/EAGLE3-LLaMA3.3-Instruct-70B's fields, values shrunk
        "architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": 128001,
        "hidden_act": "silu", "hidden_size": h, "intermediate_size": inter,
        "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": heads,
        "num_key_value_heads": kv, "num_hidden_layers": 1, "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
    }
    g = torch.Generator().manual_seed(0)
    d, ids = h // heads, torch.arange(0, vocab, 3)
    shapes = {
        "fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * d),
        "midlayer.mlp.gate_proj.weight": (inter, h), "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter), "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,), "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,), "lm_head.weight": (draft_vocab, h),
    }
    state = {k: (torch.randn(s, generator=g) * 0.05).half() for k, s in shapes.items()}
    state["d2t"] = ids - torch.arange(draft_vocab)
    state["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    head_dir = tmp_path / "EAGLE3-LLaMA3.3-Instruct-70B"
    head_dir.mkdir()
    (head_dir / "config.json").write_text(json.dumps(config))
    torch.save(state, head_dir / "pytorch_model.bin")
    head = load_head(head_dir)
    target = plan.ModelSpec("tiny", h, inter, 8, heads, kv, vocab, 2048)
    spec = plan.load_draft_spec(str(head_dir), target)
    assert head.kind == spec.kind == "eagle3"
    assert head.lm_head.weight.shape[0] == spec.draft_vocab_size == draft_vocab
    assert sum(math.prod(p.shape) for p in head.parameters()) == plan.draft_params(spec)
    assert head.d2t.numel() * head.d2t.element_size() == plan.draft_buffer_bytes(spec)
    assert head_feature_layers(head_dir, 8) == (2, 4, 5)  # the target emits three layers


def test_grafana_dashboard_queries_only_metrics_the_service_exports():
    import json
    import re

    import services.metrics

    dash = json.loads((ROOT / "deploy" / "grafana-eagle2.json").read_text())
    exported = set(re.findall(r"eagle2_\w+", services.metrics.__doc__))
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"ray_(eagle2_\w+)", target["expr"]):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                assert base in exported, (panel["title"], name)


def test_rayservice_turns_on_rays_token_authentication():
    spec = yaml.safe_load(RAYSERVICE.read_text())["spec"]
    assert spec["rayClusterConfig"]["authOptions"] == {"mode": "token"}


def test_no_ray_token_is_committed():
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert not [f for f in tracked if f.endswith("auth_token")]
