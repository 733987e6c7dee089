"""The shipped Wan 2.1 configs (wan: T2V 14B, wan_1_3b: T2V 1.3B): the released sizes built on the meta device, the
original-layout shapes the single-file check compares (taken back by diffusers' own converter), a file's size
picked by its shapes, and the memory plan counting a clip's video tokens (frames x latent height x width)."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors.torch import save_file

from tuneline.stages.families.shipped import SIGNATURES, resolve_config, shipped_dir
from tuneline.stages.train.memplan import planner_for
from tuneline.stages.train.planning import model_user_config, plan_command

# Parameters of the shipped configs built on the meta device: Wan2.1-T2V-14B's transformer (published as 14B),
# T2V-1.3B's (1.3B), and the Wan 2.1 VAE both share (the same architecture as Qwen-Image's, 126,892,531).
COUNTS = {"wan": 14_288_491_584, "wan_1_3b": 1_418_996_800}
VAE = 126_892_531


def _meta(cls, name: str, component: str):
    with torch.device("meta"):
        return cls.from_config(cls.load_config(shipped_dir(name) / component))


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_shipped_wan_configs_build_the_released_sizes(name):
    den = _meta(WanTransformer3DModel, name, "transformer")
    assert sum(p.numel() for p in den.parameters()) == COUNTS[name]
    assert sum(p.numel() for p in _meta(AutoencoderKLWan, name, "vae").parameters()) == VAE
    # the shapes a released file must have, renamed by diffusers' converter, are the ones this config builds
    original = {"model.diffusion_model." + k: torch.empty(v, device="meta") for k, v in SIGNATURES[name].items()}
    state = den.state_dict()
    converted = convert_wan_transformer_to_diffusers(original)
    assert len(converted) == len(SIGNATURES[name])
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(state[k].shape) for k in converted}


def test_shipped_wan22_config_has_two_14b_experts_split_at_0_875():
    """Wan2.2-T2V-A14B: both experts of the 14B's size and shapes, WanPipeline's boundary_ratio in its model index."""
    import json

    for expert in ("transformer", "transformer_2"):
        den = _meta(WanTransformer3DModel, "wan22", expert)
        assert sum(p.numel() for p in den.parameters()) == COUNTS["wan"]
    assert SIGNATURES["wan22"] == SIGNATURES["wan"]
    assert json.loads((shipped_dir("wan22") / "model_index.json").read_text())["boundary_ratio"] == 0.875


def test_a_wan_file_is_matched_to_its_released_size(tmp_path):
    for name in COUNTS:
        f = tmp_path / f"{name}.safetensors"
        save_file({k: torch.zeros(s, dtype=torch.uint8) for k, s in SIGNATURES[name].items()}, str(f))
        assert resolve_config("wan", f, None) == (str(shipped_dir(name)), True)
    with pytest.raises(ValueError, match="model.config: wan_1_3b .* does not fit"):
        resolve_config("wan", tmp_path / "wan.safetensors", "wan_1_3b")


def test_the_plan_counts_video_tokens():
    cfg = model_user_config("wan_1_3b", None)
    answer = plan_command(cfg, 24.0, "wan_1_3b")
    assert "480 px edge, clips of 81 frames" in answer.headline and answer.plan.blocks == 30
    assert any("buckets.frames: [17" in f for f in answer.plan.fixes), answer.plan.fixes
    planner = planner_for(cfg, shipped_dir("wan_1_3b"), True, "wan")
    s = planner.current()
    # 81 frames are 21 latent frames: 21 times the tokens of one frame, and about 21 times the activations
    one, clip = planner.trace(1, s.edge, 1), planner.trace(1, s.edge, 81)
    ratio = sum(clip.blocks) / sum(one.blocks)
    assert 18 < ratio < 24, ratio
    assert planner.step_figures(s)[0] == 21 * planner.step_figures(type(s)(**{**vars(s), "frames": 1}))[0]
