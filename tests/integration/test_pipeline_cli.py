"""The whole demo through the real CLI and Prefect: exact artifacts, a skipping rerun, staleness, refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.helpers import STAGES, tuneline

pytestmark = pytest.mark.slow


def _status(workdir: Path, *extra: str) -> dict[str, dict]:
    out = tuneline("status", *extra, "--workdir", str(workdir), "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)  # stdout must be JSON only
    assert [r["stage"] for r in rows] == STAGES
    return {r["stage"]: r for r in rows}


def test_demo_publishes_exact_artifacts(demo_run):
    workdir = demo_run["workdir"]
    rows = _status(workdir)
    assert {s: r["state"] for s, r in rows.items()} == dict.fromkeys(STAGES, "fresh")
    arts = workdir / "artifacts"
    for s in STAGES:
        published = [p.name for p in (arts / s).iterdir() if not p.name.startswith(".")]
        assert published == [rows[s]["version"]], f"{s}: exactly one published version expected"
        assert Path(rows[s]["path"]) == arts / s / rows[s]["version"]
    scan = Path(rows["scan"]["path"])
    assert {"images.jsonl", "rejected.jsonl", "manifest.json"} <= {p.name for p in scan.iterdir()}
    first = json.loads((scan / "images.jsonl").read_text().splitlines()[0])
    assert {"path", "width", "height", "bucket_width", "bucket_height", "crop", "caption"} <= set(first)
    assert json.loads((scan / "manifest.json").read_text())["alignment"] == 8
    latents = Path(rows["latents"]["path"])
    assert (latents / "latents.zarr").is_dir() and (latents / "rejected.jsonl").is_file()
    final = Path(rows["train"]["path"]) / "final"
    assert (final / "model_index.json").is_file() and (final / "unet").is_dir()
    # A full fine-tune's export is the pipeline folder, listed with its total size (its files are in `files`).
    tm = json.loads((final.parent / "manifest.json").read_text())
    total = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
    assert tm["exports"] == [{"file": "final", "format": "diffusers", "bytes": total, "sha256": None}]
    validate = Path(rows["validate"]["path"])
    vm = json.loads((validate / "manifest.json").read_text())
    pngs = sorted(p.name for p in validate.glob("*.png"))
    assert pngs == sorted([i["file"] for i in vm["images"]] + [vm["grid"]])
    for m in (json.loads((arts / s / rows[s]["version"] / "manifest.json").read_text()) for s in STAGES):
        assert {"schema_version", "stage", "fingerprint", "upstream", "created_at", "tool_version", "files"} <= set(m)


def test_demo_learns(demo_run):
    vm = json.loads((Path(_status(demo_run["workdir"])["validate"]["path"]) / "manifest.json").read_text())
    assert vm["class_separation_accuracy"] >= 0.9
    assert vm["untrained_class_separation_accuracy"] <= 0.5
    # In pixels: the trained model's renders show the prompted color (the pretrained demo VAE decodes them);
    # the untrained base's do not beyond chance.
    assert vm["color_accuracy"] >= 0.9, vm
    assert vm["untrained_color_accuracy"] < vm["color_accuracy"]
    assert vm["untrained_color_accuracy"] <= 0.5, vm


def test_trained_pipeline_loads_with_stock_diffusers(demo_run):
    from diffusers import DiffusionPipeline

    final = Path(_status(demo_run["workdir"])["train"]["path"]) / "final"
    pipe = DiffusionPipeline.from_pretrained(str(final))
    out = pipe(prompt="a red square", num_inference_steps=2, height=64, width=64, output_type="np")
    assert out.images.shape == (1, 64, 64, 3)


def test_second_run_skips_everything(demo_run):
    workdir = demo_run["workdir"]
    before = {p: p.stat().st_mtime_ns for p in (workdir / "artifacts").glob("*/*/manifest.json")}
    out = tuneline("run", "--workdir", str(workdir))
    assert out.returncode == 0, out.stderr[-3000:]
    # No Prefect server configured: nothing to record a flow run on, so no (ephemeral) Prefect is started.
    assert "every stage is fresh: nothing to build" in out.stdout and "Flow run" not in out.stderr, out.stderr[-3000:]
    for s in STAGES:
        assert re.search(rf"^{s}\s+reused\b", out.stdout, re.M), f"{s} was not skipped:\n{out.stdout}"
    after = {p: p.stat().st_mtime_ns for p in (workdir / "artifacts").glob("*/*/manifest.json")}
    assert after == before


def test_train_change_leaves_upstream_fresh(demo_run, tmp_path):
    workdir = demo_run["workdir"]
    cfg = yaml.safe_load(tuneline("config", "example").stdout)
    cfg["train"]["steps"] = 7
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rows = _status(workdir, str(path))
    states = {s: r["state"] for s, r in rows.items()}
    assert states == {"scan": "fresh", "latents": "fresh", "text": "fresh", "train": "stale", "validate": "stale"}
    assert "steps" in rows["train"]["reason"]


def test_stage_refuses_missing_upstream(tmp_path):
    out = tuneline("stage", "train", "--workdir", str(tmp_path / "empty"))
    assert out.returncode != 0
    # every upstream at fault in one message, with one fix
    assert all(f"the {s} artifact is missing" in out.stderr for s in ("scan", "latents", "text")), out.stderr
    assert "`tuneline run --until train --workdir" in out.stderr
    assert not (tmp_path / "empty" / "artifacts" / "train").exists() or not [
        p for p in (tmp_path / "empty" / "artifacts" / "train").iterdir() if not p.name.startswith(".")
    ]


def test_config_example_runs_as_demo_and_schema_is_json():
    cfg = yaml.safe_load(tuneline("config", "example").stdout)
    assert cfg["dataset"]["demo"] is True and cfg["model"]["family"] == "tiny"
    schema = json.loads(tuneline("config", "schema").stdout)
    assert {"workdir", "dataset", "model", "buckets", "train"} <= set(schema["properties"])


def test_bad_config_is_refused_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepz: 3\n")
    out = tuneline("run", str(bad), "--workdir", str(tmp_path / "w"))
    assert out.returncode == 1
    assert "train.stepz" in out.stderr and "unknown key" in out.stderr
    assert not (tmp_path / "w").exists()
