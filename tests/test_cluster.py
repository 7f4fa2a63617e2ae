"""The scale-out files: the Ray cluster-launcher YAML against the schema shipped with Ray, the
KubeRay RayJob's structure, and the Dockerfile's wiring."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "cluster" / "aws-spot-gpu.yaml"
RAYJOB = ROOT / "cluster" / "rayjob.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def ray_schema() -> dict:
    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def test_launcher_config_matches_rays_schema():
    config = yaml.safe_load(LAUNCHER.read_text())
    jsonschema.validate(config, ray_schema())
    nodes = config["available_node_types"]
    assert config["head_node_type"] in nodes
    workers = [n for name, n in nodes.items() if name != config["head_node_type"]]
    assert workers and all(n["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot" for n in workers)
    assert "InstanceMarketOptions" not in nodes[config["head_node_type"]]["node_config"]  # the driver stays
    assert nodes[config["head_node_type"]]["resources"] == {"CPU": 0}
    assert all(w["max_workers"] <= config["max_workers"] for w in workers)
    assert "--dashboard-host=127.0.0.1" in " ".join(config["head_start_ray_commands"])


def test_schema_catches_a_broken_launcher_config():
    config = yaml.safe_load(LAUNCHER.read_text())
    config["available_node_types"]["gpu_spot"]["max_wokers"] = 4
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, ray_schema())


def test_rayjob():
    job = yaml.safe_load(RAYJOB.read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["python", "sweeps/format_ablation.py"] and (ROOT / argv[1]).is_file()
    storage = argv[argv.index("--storage-path") + 1]
    assert storage.startswith("s3://")
    assert "preset=gpu" in argv  # the head has no GPU: auto would pick the cpu preset
    assert spec["backoffLimit"] >= 1  # a retried job resumes the sweep of the same name
    assert spec["shutdownAfterJobFinishes"] is True
    assert yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]["WANDB_MODE"] == "offline"
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    assert len(images) == 1
    for g in groups:  # KubeRay wants every rayStartParams value as a string
        assert all(isinstance(v, str) for v in g["rayStartParams"].values())
    (worker,) = cluster["workerGroupSpecs"]
    assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]
    (container,) = worker["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "SPOT" in worker["template"]["spec"]["nodeSelector"].values()


def test_dockerfile_ships_what_the_cluster_runs():
    text = DOCKERFILE.read_text()
    assert f"rayproject/ray:{ray.__version__}-py311-gpu" in text  # the same Ray as the driver
    for path in ("altgrad", "sweeps", "pyproject.toml"):
        assert f"COPY --chown=ray:users {path}" in text or f" {path} " in text
        assert (ROOT / path).exists()
    ignored = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignored and "experiments" in ignored
