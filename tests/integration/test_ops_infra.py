"""Deployment-as-code files stay consistent with the code: prefect.yaml, compose, the k8s job template, the
compose config, the ops schema, and the UI artifacts' text."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import yaml

from tests.helpers import STAGES
from tuneline.schemas.config import ConfigError, demo_config, load_config, parse_config

INFRA = Path(__file__).resolve().parents[2] / "infra"


def test_prefect_yaml_matches_the_flows():
    spec = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    by_name = {d["name"]: d for d in spec["deployments"]}
    assert sorted(by_name) == sorted(f"tuneline-{s}" for s in [*STAGES, "pipeline"])
    for name, d in by_name.items():
        path, func = d["entrypoint"].split(":")
        module = path.removesuffix(".py").replace("/", ".")
        fl = getattr(importlib.import_module(module), func)
        assert fl.name == name, f"{d['entrypoint']} is flow {fl.name}"
        assert d["work_pool"]["name"] == "tuneline"
        cfg = parse_config(d["parameters"]["config"], f"prefect.yaml {name}")  # a valid config, the demo's data
        assert cfg.dataset.demo and cfg.model.family == "tiny" and cfg.workdir == demo_config().workdir
    assert by_name["tuneline-train"]["concurrency_limit"] == 1
    assert [s["cron"] for s in by_name["tuneline-pipeline"]["schedules"]] == ["0 3 * * *"]


def test_compose_has_postgres_server_worker_and_a_valid_config():
    spec = yaml.safe_load((INFRA / "compose.yaml").read_text())
    services = spec["services"]
    assert {"postgres", "server", "worker", "deploy"} <= set(services)
    assert "postgresql+asyncpg://" in services["server"]["environment"]["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
    assert "PREFECT_SERVER_API_AUTH_STRING" in services["server"]["environment"]
    assert services["worker"]["environment"]["PREFECT_API_URL"] == "http://server:4200/api"
    cfg = load_config(INFRA / "pipeline.yaml")
    assert cfg.workdir == "/work" and cfg.ops.schedule.cron == "0 3 * * *"


def test_k8s_gpu_template_is_a_work_pool_base_job_template():
    t = json.loads((INFRA / "k8s-gpu-job-template.json").read_text())
    assert set(t) == {"job_configuration", "variables"}
    container = t["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert container["args"] == "{{ command }}" and container["image"] == "{{ image }}"
    used = json.dumps(t["job_configuration"])
    for var in t["variables"]["properties"]:
        assert "{{ " + var + " }}" in used, f"variable {var} is declared but never used"


@pytest.mark.parametrize(
    ("ops", "field"),
    [
        ({"schedule": {"cron": "every night"}}, "ops.schedule.cron"),
        ({"lock_timeout": -1}, "ops.lock_timeout"),
        ({"keep": 3}, "ops.keep"),
    ],
)
def test_ops_config_errors_name_the_field(ops, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(demo_config().dump() | {"ops": ops})


def test_ops_section_never_changes_a_stage_version():
    from tuneline.stages.pipeline import PIPELINE

    base = demo_config()
    other = parse_config(
        base.dump()
        | {"ops": {"schedule": {"cron": "@daily"}, "remote": "s3://b/p", "train_concurrency": 3, "lock_timeout": 5}}
    )
    for sd in PIPELINE:  # what each stage fingerprints from the config
        assert sd.config(base) == sd.config(other), sd.name


def test_loss_plot_and_cache_text():
    from tuneline.flows.results import loss_markdown, loss_plot
    from tuneline.flows.visibility import cache_description

    plot = loss_plot([1.0 - i / 100 for i in range(100)], width=20, height=5).splitlines()
    assert len(plot) == 7 and plot[0].startswith("   0.9800 |*") and plot[4].startswith("   0.0300 |")
    assert plot[0].endswith("*" + " " * 17) and plot[4].endswith("*" * 3)  # falling: top left to bottom right
    assert "last 0.0100" in loss_markdown([1.0, 0.5, 0.01]) and "```" in loss_markdown([0.3])
    text = cache_description({"count": 10, "encoded": 4, "reused": 6, "resumed": 0, "rejected": 1})
    assert "4 encoded, 6 reused" in text and "reuse rate 60%" in text


def test_deployments_carry_schedule_pools_and_an_absolute_workdir(tmp_path, monkeypatch):
    from tuneline.flows.deploy import deployments

    monkeypatch.chdir(tmp_path)
    cfg = parse_config(
        demo_config().dump()
        | {"ops": {"schedule": {"cron": "0 3 * * *", "active": False}, "gpu_pool": "gpu", "train_concurrency": 2}}
    )
    by_stage = {d.name.removeprefix("tuneline-"): d for d in deployments(cfg)}
    assert sorted(by_stage) == sorted([*STAGES, "pipeline", "shard"])
    assert {s: d.work_pool_name for s, d in by_stage.items()} == {
        s: "tuneline" if s == "scan" else "gpu" for s in by_stage
    }
    pipeline = by_stage["pipeline"]
    assert [(s.schedule.cron, s.active) for s in pipeline.schedules] == [("0 3 * * *", False)]
    assert all(d.schedules == [] for s, d in by_stage.items() if s != "pipeline")  # [] clears an old schedule
    assert by_stage["train"].concurrency_limit == 2
    assert pipeline.entrypoint == "tuneline.flows.pipeline.pipeline_flow"
    assert pipeline.parameters["config"]["workdir"] == str(tmp_path / "tuneline-work")
    assert "PipelineConfig" in pipeline._parameter_openapi_schema.definitions
    unscheduled = deployments(demo_config())[0]
    assert unscheduled.schedules == [] and unscheduled.work_pool_name == "tuneline"
