"""Bad configs: each invalid or conflicting config is refused at load by the CLI (exit 1), the message names the
offending field, and nothing is written (neither --workdir nor the config's own workdir exists afterwards)."""

from __future__ import annotations

import copy
import subprocess

import pytest
import yaml

from tests.reliability.faultlib import ROOT, cli_args

# (id, {dotted key: value}, text stderr must contain): each case starts from the valid `tuneline config example`
# and breaks one field, or sets two that conflict.
CASES = [
    ("unknown-section", {"trian": {"steps": 5}}, "trian"),
    ("unknown-key", {"train.stepz": 5}, "train.stepz"),
    ("steps-zero", {"train.steps": 0}, "train.steps"),
    ("steps-text", {"train.steps": "many"}, "train.steps"),
    ("batch-negative", {"train.batch_size": -1}, "train.batch_size"),
    ("lr-zero", {"train.learning_rate": 0}, "train.learning_rate"),
    ("dropout-above-one", {"train.caption_dropout": 1.5}, "train.caption_dropout"),
    ("mode-unknown", {"train.mode": "dreambooth"}, "train.mode"),
    ("processes-zero", {"train.processes": 0}, "train.processes"),
    ("checkpoint-every-zero", {"train.checkpoint_every": 0}, "train.checkpoint_every"),
    ("nodes-without-endpoint", {"train.nodes": 2}, "train.rdzv_endpoint"),
    (
        "node-rank-past-nodes",
        {"train.nodes": 2, "train.rdzv_endpoint": "n0:29500", "train.node_rank": 2},
        "train.node_rank",
    ),
    ("endpoint-not-host-port", {"train.nodes": 2, "train.rdzv_endpoint": "node0"}, "train.rdzv_endpoint"),
    ("resume-blank", {"train.resume": "  "}, "train.resume"),
    ("family-unknown", {"model.family": "sd99"}, "model.family"),
    ("fp16-on-cpu", {"model.dtype": "float16", "model.device": "cpu"}, "model.dtype"),
    ("fp8-weights", {"model.dtype": "float8_e4m3fn"}, "model.dtype"),
    ("device-unknown", {"model.device": "tpu"}, "model.device"),
    ("resolution-negative", {"buckets.resolution": -64}, "buckets.resolution"),
    ("resolution-type-unknown", {"buckets.resolution_type": "megapixel"}, "buckets.resolution_type"),
    ("area-in-pixels", {"buckets.resolution": 1024, "buckets.resolution_type": "area"}, "buckets.resolution"),
    ("resolution-below-alignment", {"buckets.resolution": 2}, "buckets.resolution"),
    ("aspects-crossed", {"buckets.min_aspect": 5.0, "buckets.max_aspect": 4.0}, "buckets.min_aspect"),
    ("alignment-not-multiple", {"buckets.alignment": 12}, "buckets.alignment"),
    ("crop-unknown", {"buckets.crop": "diagonal"}, "buckets.crop"),
    ("extension-unsupported", {"dataset.extensions": [".exe"]}, "dataset.extensions"),
    ("caption-extension-no-dot", {"dataset.caption_extension": "txt"}, "dataset.caption_extension"),
    ("max-pixels-zero", {"dataset.max_image_pixels": 0}, "dataset.max_image_pixels"),
    ("max-pixels-above-pil", {"dataset.max_image_pixels": 10**12}, "dataset.max_image_pixels"),
    ("empty-caption-unknown", {"dataset.empty_caption": "maybe"}, "dataset.empty_caption"),
    ("background-two-channels", {"dataset.background": [255, 255]}, "dataset.background"),
    ("dataset-not-a-mapping", {"dataset": "images/"}, "dataset"),
    ("latent-dtype-bf16", {"latents.dtype": "bfloat16"}, "latents.dtype"),
    ("block-rows-zero", {"latents.block_rows": 0}, "latents.block_rows"),
    ("text-too-long", {"text.max_length": 100000}, "text.max_length"),
    ("shuffle-without-variants", {"text.shuffle_tags": True, "text.caption_variants": 1}, "text.caption_variants"),
    ("tag-dropout-one", {"text.tag_dropout": 1.0}, "text.tag_dropout"),
    ("no-prompts", {"validate.prompts": []}, "validate.prompts"),
    ("validate-steps-zero", {"validate.steps": 0}, "validate.steps"),
    ("validate-type-without-resolution", {"validate.resolution_type": "area"}, "validate.resolution"),
    (
        "negative-without-guidance",
        {"validate.guidance_scale": 1.0, "validate.prompts": [{"prompt": "a cat", "negative_prompt": "blurry"}]},
        "validate.guidance_scale",
    ),
    ("lock-timeout-negative", {"ops.lock_timeout": -1}, "ops.lock_timeout"),
    ("cron-garbage", {"ops.schedule.cron": "every day"}, "ops.schedule.cron"),
]


def _example() -> dict:
    out = subprocess.run(cli_args("config", "example"), capture_output=True, text=True, cwd=ROOT, check=True)
    return yaml.safe_load(out.stdout)


@pytest.fixture(scope="module")
def example() -> dict:
    return _example()


def _apply(cfg: dict, edits: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    for dotted, value in edits.items():
        *parents, last = dotted.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return cfg


def _refused(tmp_path, text: str | bytes, command: str, expect: str) -> None:
    cfg_path = tmp_path / "bad.yaml"
    cfg_path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    workdir = tmp_path / "w"
    out = subprocess.run(
        cli_args(command, str(cfg_path), "--workdir", str(workdir)),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=180,
    )
    assert out.returncode == 1, f"{command} accepted the config (exit {out.returncode}):\n{out.stderr[-1500:]}"
    assert expect in out.stderr, f"stderr does not name {expect!r}:\n{out.stderr[-1500:]}"
    assert "Traceback" not in out.stderr, out.stderr[-1500:]
    assert not workdir.exists(), f"{command} wrote {sorted(p.name for p in workdir.rglob('*'))[:10]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"], "something was written next to the config"


@pytest.mark.parametrize("edits,expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_is_refused_by_run(tmp_path, example, edits, expect):
    cfg = _apply(example, edits)
    cfg["workdir"] = str(tmp_path / "cfg-workdir")  # must not be created either
    _refused(tmp_path, yaml.safe_dump(cfg), "run", expect)


@pytest.mark.parametrize("edits,expect", [c[1:] for c in CASES[::6]], ids=[c[0] for c in CASES[::6]])
def test_bad_config_is_refused_by_status(tmp_path, example, edits, expect):
    _refused(tmp_path, yaml.safe_dump(_apply(example, edits)), "status", expect)


@pytest.mark.parametrize(
    "text,expect",
    [
        ("- a\n- list\n", "top level"),
        ("train: {steps: 5\n", "YAML"),
        (b"train:\n  steps: \xff\xfe\n", "bad.yaml"),
    ],
    ids=["top-level-list", "yaml-syntax", "invalid-utf8"],
)
def test_malformed_file_is_refused(tmp_path, text, expect):
    _refused(tmp_path, text, "run", expect)
