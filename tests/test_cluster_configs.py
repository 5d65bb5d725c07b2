"""cluster/*.yaml (`ray up` configs) and deploy/Dockerfile.

Each cluster file must pass the JSON schema shipped in the ray wheel and the same
prepare/validate steps `ray up` runs before it contacts a cloud; GPU node types must ask for
GPUs; every image must be a rayproject/ray GPU tag; the wheel installed must be the version
in pyproject.toml.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_FILES = sorted((ROOT / "cluster").glob("*.yaml"))
# {Ray version}-{Python version}-{gpu | cuXXX}, e.g. rayproject/ray:2.60.0-py311-gpu
RAY_GPU_IMAGE = re.compile(r"^rayproject/ray:(\d+\.\d+\.\d+)-py3\d+-(gpu|cu\d+)$")


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _images(cfg: dict) -> list[str]:
    docker = cfg.get("docker", {})
    return [docker[k] for k in ("image", "head_image", "worker_image") if k in docker]


def _pyproject_version() -> str:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    path = ROOT / "pyproject.toml"
    if not path.is_file():
        pytest.skip("no pyproject.toml yet")
    return tomllib.loads(path.read_text())["project"]["version"]


def test_all_cluster_files_present():
    assert {p.name for p in CLUSTER_FILES} >= {"aws.yaml", "gcp.yaml", "local.yaml"}


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_cluster_file_validates_against_ray_schema(path):
    schema_path = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    jsonschema.validate(_load(path), schema)


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_cluster_file_passes_ray_up_preparation(path):
    """What `ray up` does before contacting the provider: fill defaults, then validate."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(_load(path)))


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_images_are_rayproject_ray_gpu_tags(path):
    images = _images(_load(path))
    assert images, f"{path.name} runs no container image"
    for image in images:
        assert RAY_GPU_IMAGE.match(image), f"{path.name}: {image} is not a rayproject/ray GPU tag"


def test_one_ray_image_everywhere():
    """Cluster files and the Dockerfile use the same Ray image (Ray versions must match)."""
    images = {image for path in CLUSTER_FILES for image in _images(_load(path))}
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    images |= set(re.findall(r"^ARG RAY_IMAGE=(\S+)$", dockerfile, re.MULTILINE))
    assert len(images) == 1, images


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_cloud_gpu_worker_type_asks_for_8_gpus(name):
    cfg = _load(ROOT / "cluster" / name)
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0, "the head node is a CPU node"
    workers = {k: t for k, t in types.items() if k != cfg["head_node_type"]}
    gpu_workers = [t for t in workers.values() if t["resources"].get("GPU", 0) >= 8]
    assert gpu_workers, f"{name}: no worker type with 8 GPUs"
    for t in gpu_workers:
        assert 1 <= t["min_workers"] <= t["max_workers"] <= cfg["max_workers"]
    machine = {"aws.yaml": ("InstanceType", "p5.48xlarge"),
               "gcp.yaml": ("machineType", "a3-highgpu-8g")}[name]
    assert any(t["node_config"].get(machine[0]) == machine[1] for t in gpu_workers)


def test_local_is_one_machine():
    cfg = _load(ROOT / "cluster" / "local.yaml")
    assert cfg["provider"]["type"] == "local"
    assert cfg["provider"]["worker_ips"] == [] and cfg["max_workers"] == 0
    assert "available_node_types" not in cfg  # `ray up` rejects it for the local provider


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_cluster_installs_this_version_and_starts_ray(path):
    cfg = _load(path)
    wheel = f"eagle2-{_pyproject_version()}-py3-none-any.whl"
    assert any(wheel in cmd for cmd in cfg["setup_commands"]), f"{path.name} installs no {wheel}"
    assert "./dist" in cfg["file_mounts"].values()
    assert any("ray start --head" in cmd for cmd in cfg["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP" in c for c in cfg["worker_start_ray_commands"])


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_cluster_turns_on_rays_token_authentication(path):
    """Ray's control plane runs code for whoever reaches it: every `ray up` config starts its
    containers with RAY_AUTH_MODE=token (so `ray start`, `ray exec` and the Serve replicas all
    see it) and file-mounts the launching machine's token where Ray reads it by default
    (deploy/DEPLOY.md, Security)."""
    cfg = _load(path)
    assert "--env RAY_AUTH_MODE=token" in cfg["docker"]["run_options"]
    assert cfg["file_mounts"]["/home/ray/.ray/auth_token"] == "~/.ray/auth_token"
    starts = " ".join(cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=disabled" not in starts


def _dockerfile_env() -> dict[str, str]:
    text = (ROOT / "deploy" / "Dockerfile").read_text().replace("\\\n", " ")
    return dict(pair.split("=", 1) for line in re.findall(r"^ENV (.+)$", text, re.MULTILINE)
                for pair in line.split())


@pytest.mark.parametrize("where", [p.name for p in CLUSTER_FILES] + ["Dockerfile"])
def test_deployments_run_serve_with_the_settings_eagle2_serve_uses(where):
    """A cluster that `serve deploy` or KubeRay starts never runs `eagle2 serve`, whose
    `ray.init` hands Serve its settings (services/cli_serve.py SERVE_ENV: gRPC between the
    proxies and replicas, the replicas' user code on their main loop, the controller's 0.5 s
    loop, the 1 s metrics refresh; the HAProxy ingress, `use_ha_proxy`) and Ray's (RAY_ENV:
    workers at niceness 0): the `ray up` containers and the image set every one of them, with
    the same value."""
    from services.cli_serve import HA_PROXY_VAR, RAY_ENV, SERVE_ENV

    if where == "Dockerfile":
        env = _dockerfile_env()
    else:
        options = _load(ROOT / "cluster" / where)["docker"]["run_options"]
        env = dict(o.removeprefix("--env ").split("=", 1) for o in options
                   if o.startswith("--env "))
    expected = {**SERVE_ENV, **RAY_ENV, HA_PROXY_VAR: "1"}
    assert {k: env.get(k) for k in expected} == expected


def test_dockerfile_builds_from_ray_gpu_image_and_installs_pyproject_version():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    (ray_image,) = re.findall(r"^ARG RAY_IMAGE=(\S+)$", dockerfile, re.MULTILINE)
    assert RAY_GPU_IMAGE.match(ray_image)
    assert re.search(r"^FROM \$\{RAY_IMAGE\}", dockerfile, re.MULTILINE)
    (version,) = re.findall(r"^ARG EAGLE2_VERSION=(\S+)$", dockerfile, re.MULTILINE)
    assert version == _pyproject_version()
    assert "eagle2-${EAGLE2_VERSION}-py3-none-any.whl[serve]" in dockerfile
