"""Wan 2.2's tiny flavor (two experts) through the train and validate stages over the session's upstream store:
both experts trained as one run write a LoRA per expert (diffusers and ComfyUI files, listed in the manifest's
exports) that the validate stage renders as clips through the stock WanPipeline; a run of one expert holds only
that expert and draws only its share of the timesteps, also sharded over FSDP processes; block swap swaps each
expert's own blocks (both experts over FSDP: the training matrix's wan22 FSDP cells)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image

from tests.clips import write_clip
from tests.integration.matrix_cells import every_expert_seed
from tests.trainer import steps, trainer_for
from tuneline.schemas.config import parse_config
from tuneline.schemas.validate import ValidateManifest
from tuneline.stages.common.stage import run_stage
from tuneline.stages.families.common import unwrap
from tuneline.stages.families.resolve import model_dir
from tuneline.stages.families.wan22.adapter import TINY_BOUNDARY
from tuneline.stages.pipeline import PIPELINE, stage
from tuneline.stages.train.evaluation import trained_timesteps
from tuneline.stages.train.swap import BlockSwapper, ExpertSwappers


def write_clips(root, size: int = 32):
    """Two captioned clips of a moving square and a still image, `size` pixels square (also TI2V's dataset)."""
    write_clip(root / "left.mp4", frames=24, fps=16, size=(size, size))
    write_clip(root / "right.mp4", frames=24, fps=16, size=(size, size))
    Image.new("RGB", (size, size), (200, 40, 40)).save(root / "still.png")
    for name, caption in {"left": "a square moves left", "right": "a square moves right", "still": "a square"}.items():
        (root / f"{name}.txt").write_text(caption, encoding="utf-8")


def _config(tmp, data, train=None, **model):
    """The run's config through parse_config (the user's path: every check applies), `train` over the defaults."""
    return parse_config(
        {
            "dataset": {"path": str(data)},
            "model": {"family": "wan22", "path": None, "device": "cpu", **model},
            "buckets": {"resolution": 32, "fps": 8, "frames": [5]},
            "text": {"max_length": 16},
            "train": {"steps": 2, "batch_size": 1, "processes": 1, "mode": "lora", "lora_rank": 4, **(train or {})},
            "validate": {"frames": 5, "steps": 2, "learning_check": False},
        },
        workdir=str(tmp / "work"),
    )


def test_both_experts_train_as_one_run_and_validate_renders_their_loras(tmp_path, upstream_store):
    ctx = upstream_store.upstream(_config(tmp_path, upstream_store.dataset("wan22-clips", write_clips)))
    paths = {name: run_stage(ctx, stage(name), PIPELINE)[0] for name in ("train", "validate")}
    manifest = json.loads((paths["train"] / "manifest.json").read_text(encoding="utf-8"))
    assert sorted((e["file"], e["format"]) for e in manifest["exports"]) == [
        ("final/lora_kohya_high_noise.safetensors", "kohya"),
        ("final/lora_kohya_low_noise.safetensors", "kohya"),
        ("final/pytorch_lora_weights_high_noise.safetensors", "diffusers"),
        ("final/pytorch_lora_weights_low_noise.safetensors", "diffusers"),
    ]
    val = ctx.store.read(paths["validate"], ValidateManifest)
    assert [(i.frames, i.clip) for i in val.images] == [(5, "000-seed0.mp4")]
    with Image.open(paths["validate"] / val.images[0].file) as im:
        assert im.n_frames == 5


def test_one_expert_holds_only_itself_and_trains_on_its_share(tmp_path, upstream_store):
    cfg = _config(tmp_path, upstream_store.dataset("wan22-clips", write_clips), expert="low")
    trainer = trainer_for(cfg, upstream_store.upstream(cfg))
    assert list(unwrap(trainer.denoiser).experts) == ["transformer_2"]
    assert trainer.sigmas.span == (0.0, TINY_BOUNDARY)
    # held-out eval loss only at the timesteps it trains (WanPipeline's rule: t >= 875 is the other expert's)
    assert trained_timesteps(trainer, [200, 874, 875, 900]) == [200, 874]
    with pytest.raises(ValueError, match=r"train.eval.timesteps \[900\]: none is in .*model.expert low"):
        trained_timesteps(trainer, [900])
    assert trainer.names and all(n.startswith("experts.transformer_2.") for n in trainer.names)
    steps(trainer, 1)
    assert trainer.losses and math.isfinite(trainer.losses[0])


def test_block_swap_swaps_each_experts_blocks_and_trains_as_without(tmp_path, upstream_store):
    """train.blocks_to_swap with both experts: each swaps that many of its own blocks, the expert a step does not
    run keeps none on the device, and the weights after a step of each expert are those of a run without swap."""
    data = upstream_store.dataset("wan22-clips", write_clips)
    plain = _config(tmp_path, data)
    # step 1 one expert, step 2 the other
    seed = every_expert_seed(plain, model_dir(upstream_store.upstream(plain)), "wan22 block swap")
    runs = {}
    for swap in (0, 1):
        cfg = _config(tmp_path, data, {"seed": seed, "blocks_to_swap": swap})
        runs[swap] = trainer_for(cfg, upstream_store.upstream(cfg))
        steps(runs[swap], 2)
    swapper = runs[1].swapper
    assert isinstance(swapper, ExpertSwappers) and len(swapper.swappers) == 2
    assert all(len(s.blocks) == 2 and s.resident_limit == 1 for s in swapper.swappers)
    assert [len(s.loaded) for s in swapper.swappers].count(0) == 1, "the expert of the last step holds its blocks"
    for comp in ("transformer", "transformer_2"):  # each learned (LoRA's B starts at zero)
        ups = [p for n, p in runs[1].params.items() if n.startswith(f"experts.{comp}.") and "lora_B" in n]
        assert ups and any(bool(p.abs().max() > 0) for p in ups), comp
    for name, p in runs[0].params.items():
        torch.testing.assert_close(runs[1].params[name], p, rtol=0, atol=1e-6, msg=name)
    one = _config(tmp_path, data, {"blocks_to_swap": 1}, expert="high")
    trainer = trainer_for(one, upstream_store.upstream(one))
    steps(trainer, 1)
    assert isinstance(trainer.swapper, BlockSwapper) and math.isfinite(trainer.losses[0])


@pytest.mark.ddp(reason="one expert sharded over 2 FSDP processes through the train stage")
def test_one_expert_shards_over_fsdp_and_writes_only_its_files(tmp_path, upstream_store):
    data = upstream_store.dataset("wan22-clips", write_clips)
    cfg = _config(tmp_path, data, {"processes": 2, "parallelism": "fsdp"}, expert="high")
    path = run_stage(upstream_store.upstream(cfg), stage("train"), PIPELINE)[0]
    manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    assert sorted(e["file"] for e in manifest["exports"]) == [
        "final/lora_kohya_high_noise.safetensors",
        "final/pytorch_lora_weights_high_noise.safetensors",
    ]
