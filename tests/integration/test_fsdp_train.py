"""train.parallelism fsdp beside DDP: a UNet family (tiny) and a transformer family (flux), full and LoRA, each cell
2 optimizer steps of 2 accumulated micro-batches in 2 gloo processes (tests/fsdp_worker.py: one torchrun launch
trains every cell). FSDP's weights equal DDP's and a 1-process replay within TOLERANCE, resume exactly, resume
across process counts (2 -> 1, 1 -> 2) at the same global batch, and final/ holds the files DDP writes; held-out
evaluation and in-training validation give DDP's losses and grid.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open

from tests.integration.test_train_support import ROOT, small_config
from tuneline.schemas.config import parse_config
from tuneline.schemas.demo import DEMO_CONFIG
from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.parallel import FSDP_OPTIMIZERS, NOT_SHARDED
from tuneline.schemas.text import TextManifest
from tuneline.stages.common.stage import run_stage
from tuneline.stages.families import resolve as models
from tuneline.stages.pipeline import PIPELINE, stage
from tuneline.stages.train import launch as train_launch, workers as train_workers

# fp32 weights after 2 AdamW steps: FSDP reduce-scatters the ranks' gradients where DDP all-reduces them and one
# process accumulates them, which orders the float sums differently (seen: below 5e-6).
TOLERANCE = 2e-5
TRAIN = {
    "steps": 2,
    "checkpoint_every": 1,
    "keep_checkpoints": 2,
    "batch_size": 2,
    "grad_accumulation": 2,
    "processes": 2,
    "validate_every": 0,
    "lora_rank": 4,
}
CELLS = [(family, mode) for family in ("tiny", "flux") for mode in ("full", "lora")]
# One factor more per cell, the same in both runs: EMA (every rank averages its shard, final/ gathers it), gradient
# checkpointing (a block's recompute gathers it again), the other optimizer FSDP takes, and held-out evaluation
# and in-training validation, whose forwards gather the shards on every rank: 3 prompts and an odd number of held-out
# batches, so one rank's share is padded (without it FSDP's all-gathers would wait forever).
EVAL = {"fraction": 0.1, "every_steps": 1, "timesteps": [300, 700]}
EXTRA = {
    ("tiny", "lora"): {"ema": True, "gradient_checkpointing": True, "validate_every": 2, "eval": EVAL},
    ("tiny", "full"): {"eval": EVAL, "optimizer": "adamw_schedulefree"},  # its eval weights, also under FSDP
    ("flux", "lora"): {"optimizer": "lion", "learning_rate": 1e-4},
    ("flux", "full"): {"eval": EVAL},
}
VALIDATE = {"prompts": DEMO_CONFIG["validate"]["prompts"][:3], "steps": 2}
WORKER = ROOT / "tests" / "fsdp_worker.py"


def _spec(ctx, work: Path) -> dict:
    """The worker's spec as the train stage's launcher writes it."""
    work.mkdir(parents=True, exist_ok=True)
    upstream = {}
    for name, cls in (("latents", LatentsManifest), ("text", TextManifest)):
        path, _ = run_stage(ctx, stage(name), PIPELINE)  # fresh: already built
        upstream[name] = ctx.store.read(path, cls)
    path = train_launch.write_spec(ctx, work, upstream, None, models.model_dir(ctx), uuid.uuid4().hex)
    spec = json.loads(path.read_text(encoding="utf-8"))
    path.unlink()
    return spec


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory, upstream_store, demo_data) -> Path:
    """The one launch, training the cells this session selected (`-k flux` trains flux's only)."""
    chosen = [i.callspec.params for i in request.session.items if i.function is test_fsdp_equals_ddp_and_resumes]
    chosen = chosen or [{"family": "tiny", "mode": "lora"}]  # the launch also probes the optimizers
    root = tmp_path_factory.mktemp("fsdp")
    plan = []
    for family, mode in [(c["family"], c["mode"]) for c in chosen]:
        train = TRAIN | {"mode": mode} | EXTRA.get((family, mode), {})
        model = {"family": family, "device": "cpu"}
        cfg = small_config(root / family, train, model=model, validate=VALIDATE, dataset={"path": str(demo_data)})
        ctx = upstream_store.upstream(cfg)
        out = root / "cells" / f"{family}-{mode}"
        plan.append({"name": out.name, "out": str(out), "spec": _spec(ctx, out / "spec")})
    (root / "plan.json").write_text(json.dumps({"cells": plan}), encoding="utf-8")
    cmd = train_workers.worker_command(cfg, root / "plan.json")
    cmd = cmd[: cmd.index("-m", 3)] + [str(WORKER), str(root / "plan.json")]  # our worker in place of the stage's
    train_workers.run_workers(ctx, cmd, cwd=root)
    return root / "cells"


@pytest.mark.parametrize(("family", "mode"), CELLS, ids=[f"{f}-{m}" for f, m in CELLS])
def test_fsdp_equals_ddp_and_resumes(launched, family, mode):
    out = launched / f"{family}-{mode}"
    for rank in (0, 1):
        got = _rank(out, rank)
        assert "error" not in got, got.get("traceback", got.get("error"))
        assert got["sharded"], "the trained parameters were not sharded"
        assert got["resume"] == 0.0, "resumed from step 1, step 2's weights must be identical"
        for key in ("fsdp_vs_ddp", "fsdp_vs_replay", "to_one", "from_one"):
            assert got[key] <= TOLERANCE, f"rank {rank} {key}: {got[key]}"
    _assert_same_exports(out / "fsdp" / "final", out / "ddp" / "final")
    _assert_loaded_as_shards(got["load"], mode)
    evals = got["evals"]
    if "eval" in EXTRA.get((family, mode), {}):
        shares = [_rank(out, r)["eval_share"] for r in (0, 1)]
        assert shares[0]["batches"] == shares[1]["batches"], f"ranks ran different evaluation forwards: {shares}"
        assert shares[0]["counted"] != shares[1]["counted"], f"one rank's share must be padded here: {shares}"
        assert [e["step"] for e in evals["fsdp"]] == [1, 2] == [e["step"] for e in evals["ddp"]], evals
        for fs, dd in zip(evals["fsdp"], evals["ddp"]):
            assert abs(fs["loss"] - dd["loss"]) <= TOLERANCE, evals  # the same held-out rows, summed once each
    if EXTRA.get((family, mode), {}).get("validate_every"):
        _assert_same_grid(out / "fsdp" / "samples" / "step-0000002.png", out / "ddp" / "samples" / "step-0000002.png")


def _rank(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank-{rank}.json").read_text(encoding="utf-8"))


def _assert_loaded_as_shards(load: dict, mode: str) -> None:
    """No rank held the whole denoiser while it loaded: before its shards arrived its parameters had no storage
    but the adapters' (a full fine-tune: none), and after, each rank holds its rows only."""
    assert load["before"] <= load["adapters"] < load["whole"] / 10, load
    assert mode == "lora" or load["before"] == 0, load
    assert load["after"] <= load["bound"] <= 0.6 * load["whole"], load


def test_optimizers_fsdp_takes_step_shards_as_whole_tensors(launched):
    """Every optimizer FSDP accepts steps sharded parameters as it steps whole ones (AdamW with its fused kernel);
    each one it refuses does not (its refusal says how it differs)."""
    found = json.loads((launched.parent / "optimizers.json").read_text(encoding="utf-8"))
    assert sorted(found) == sorted(FSDP_OPTIMIZERS + tuple(NOT_SHARDED)), found
    for name in FSDP_OPTIMIZERS:
        assert found[name].get("diff", 1) <= TOLERANCE and found[name]["ranks_agree"], (name, found[name])
    # torch's AdamW steps shards fused (adamw_kernel): foreach's first step there costs DTensor's sharding rules
    # several times fused's
    assert found["adamw"]["fused"], found["adamw"]
    for name in NOT_SHARDED:
        got = found[name]
        assert "error" in got or got["diff"] > TOLERANCE or not got["ranks_agree"], (name, got)


def _assert_same_grid(fsdp: Path, ddp: Path) -> None:
    """FSDP's in-training validation grid is DDP's: every prompt rendered (the padded one dropped), pixels equal but
    for rounding of the weights' float sums."""
    with Image.open(fsdp) as a, Image.open(ddp) as b:
        x, y = np.asarray(a.convert("RGB"), dtype=np.int16), np.asarray(b.convert("RGB"), dtype=np.int16)
    assert x.shape == y.shape and x.std() > 0, (x.shape, y.shape)
    assert np.abs(x - y).max() <= 2, f"the FSDP grid differs from DDP's by up to {np.abs(x - y).max()} levels"


def _assert_same_exports(fsdp: Path, ddp: Path) -> None:
    """The same files; each safetensors file with the same keys, shapes and dtypes, values within TOLERANCE."""
    files = sorted(p.relative_to(fsdp) for p in fsdp.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(ddp) for p in ddp.rglob("*") if p.is_file())
    weights = [f for f in files if f.suffix == ".safetensors"]
    assert weights, f"no weights in {fsdp}"
    for name in weights:
        with safe_open(fsdp / name, "pt") as a, safe_open(ddp / name, "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys()), name
            assert sorted(a.metadata() or {}) == sorted(b.metadata() or {}), name
            for key in a.keys():
                x, y = a.get_tensor(key), b.get_tensor(key)
                assert (x.shape, x.dtype) == (y.shape, y.dtype), f"{name} {key}"
                assert float((x.float() - y.float()).abs().max()) <= TOLERANCE, f"{name} {key}"


@pytest.mark.parametrize(
    ("train", "model", "fields"),
    [
        ({"mode": "lora"}, {"quantize": "int8"}, ("model.quantize", "train.parallelism")),
        ({"optimizer": "adafactor"}, {}, ("train.optimizer adafactor", "train.parallelism")),
        ({"optimizer": "prodigy", "learning_rate": 1.0}, {}, ("train.optimizer prodigy", "train.parallelism")),
        ({"optimizer": "adamw8bit"}, {}, ("train.optimizer adamw8bit", "train.parallelism")),
        ({"mode": "lora", "adapter": "dora"}, {}, ("train.adapter dora", "train.parallelism")),
        ({"mode": "lora", "blocks_to_swap": 1}, {}, ("train.blocks_to_swap", "train.parallelism")),
        ({"parallelism": "ddp", "fsdp_cpu_offload": True}, {}, ("train.fsdp_cpu_offload", "train.parallelism")),
    ],
)
def test_fsdp_refuses_what_cannot_shard(tmp_path, train, model, fields):
    data = small_config(tmp_path, {}).dump()
    data["train"] |= {"parallelism": "fsdp", "validate_every": 0} | train
    data["model"] |= model
    with pytest.raises(ValueError) as err:
        parse_config(data)
    assert all(f in str(err.value) for f in fields), str(err.value)


def test_the_train_stage_trains_sharded_and_publishes_what_ddp_does(tmp_path, upstream_store, demo_data):
    """The user's path: the train stage (launcher, torchrun, the worker's main) with train.parallelism fsdp."""
    from diffusers import UNet2DConditionModel

    from tests.integration.test_train_support import train

    cfg = small_config(tmp_path, TRAIN | {"parallelism": "fsdp"}, dataset={"path": str(demo_data)})
    upstream_store.upstream(cfg)
    out = train(cfg)
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["world_size"] == 2 and manifest["config"]["train"]["parallelism"] == "fsdp"
    state = json.loads((out / "checkpoints" / "step-0000002" / "state.json").read_text(encoding="utf-8"))
    assert state["format"] == "sharded-safetensors" and state["global_batch"] == 8
    assert sorted(state["files"]) == [f"shards/shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)]
    unet = UNet2DConditionModel.from_pretrained(out / "final" / "unet")
    assert all(p.isfinite().all() for p in unet.parameters())
