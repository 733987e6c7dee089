"""Wan 2.2's two timestep experts: each sample goes to the expert WanPipeline would denoise it with, a one-expert run
draws only its share of the timesteps, and a run of both writes one LoRA per expert that the stock WanPipeline
loads into `transformer` / `transformer_2` and renders as trained; each expert's ComfyUI file holds only keys
ComfyUI maps for Wan."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.integration import comfy_lora_keys
from tests.integration.family_runs import lift_lora_up, tiny_models
from tuneline.schemas.train import TrainConfig
from tuneline.stages.families.registry import get_family
from tuneline.stages.families.wan22.adapter import TINY_BOUNDARY
from tuneline.stages.render.renderer import Renderer, Sample
from tuneline.stages.train.export import DIFFUSERS_FILE, KOHYA_FILE, exports, named
from tuneline.stages.train.model import prepare_denoiser, save_final
from tuneline.stages.train.timesteps import SigmaSampler

CPU = torch.device("cpu")
RANK, ALPHA, LENGTH = 4, 2.0, 16
HIGH, LOW = "_high_noise", "_low_noise"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan22")
    return get_family("wan22"), tiny_models(root)("wan22"), root


@pytest.fixture(scope="module")
def trained(built):
    """Both experts with a LoRA of random nonzero up weights, saved as the train stage saves them."""
    fam, model_dir, root = built
    t = TrainConfig(mode="lora", lora_rank=RANK, lora_alpha=ALPHA, lora_format="both")
    den, trainable = prepare_denoiser(fam, model_dir, t, torch.float32, CPU)
    lift_lora_up(trainable, 0.2)
    save_final(fam, model_dir, den, t, root / "final")
    return den.eval(), root / "final"


def test_each_sample_goes_to_its_timesteps_expert(trained):
    den, _ = trained
    gen = torch.Generator().manual_seed(0)
    x, text = torch.randn(4, 16, 2, 4, 4, generator=gen), torch.randn(4, 8, 32, generator=gen)
    t = torch.tensor([999.0, 100.0, TINY_BOUNDARY * 1000, 874.0])  # WanPipeline: t >= boundary -> high noise
    with torch.no_grad():
        got = den(x, t, text)[0]
        high = den.experts["transformer"](x, t, text, return_dict=False)[0]
        low = den.experts["transformer_2"](x, t, text, return_dict=False)[0]
    assert not torch.allclose(high, low, atol=1e-4), "the two experts must differ for the routing to show"
    torch.testing.assert_close(got, torch.stack([high[0], low[1], high[2], low[3]]))


@pytest.mark.parametrize("expert, comps", [("high", ["transformer"]), ("low", ["transformer_2"])])
def test_one_expert_holds_and_draws_only_its_share(built, expert, comps):
    fam, model_dir, _ = built
    den = fam.load_denoiser(model_dir, torch.float32, CPU, expert=expert)
    assert list(den.experts) == comps
    span = fam.sigma_range(den)
    sigmas = SigmaSampler(kind="logit_normal", shift=3.0, span=span).sample(2000, torch.Generator(), {}, 16)
    t = sigmas * 1000
    high = t >= TINY_BOUNDARY * 1000
    assert bool(high.all()) if expert == "high" else not bool(high.any())
    assert float(sigmas.max() - sigmas.min()) > 0.5 * (span[1] - span[0]), "the share is drawn over, not a point"


def _render(fam, pipe) -> torch.Tensor:
    """5-frame clip latents (16, 2, 4, 4) over enough steps that both experts denoise (boundary 0.875)."""
    renderer = Renderer(fam, pipe, fam.text_encoders_of(pipe, LENGTH), CPU)
    return renderer.render([Sample("a square moves left", "blue", 0)], 32, 32, 4, 3.0, output_type="latent", frames=5)[
        0
    ]


def test_each_experts_lora_loads_into_its_transformer_and_renders_as_trained(built, trained):
    fam, model_dir, _ = built
    den, final = trained
    assert {e["file"].rsplit("/", 1)[1] for e in exports(final.parent, final, "lora")} == {
        named(f, s) for f in (DIFFUSERS_FILE, KOHYA_FILE) for s in (HIGH, LOW)
    }
    with torch.no_grad():
        want = _render(fam, fam.load_pipeline(model_dir, torch.float32, CPU, denoiser=den))
        stock = fam.load_pipeline(model_dir, torch.float32, CPU)
        base = _render(fam, stock)
        stock.load_lora_weights(final, weight_name=named(DIFFUSERS_FILE, HIGH))
        high_only = _render(fam, stock)
        stock.load_lora_weights(final, weight_name=named(DIFFUSERS_FILE, LOW), load_into_transformer_2=True)
        got = _render(fam, stock)
    assert not torch.allclose(base, high_only, atol=1e-4), "the high-noise LoRA must change the render"
    assert not torch.allclose(high_only, got, atol=1e-4), "the low-noise LoRA must change the render"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("comp, suffix", [("transformer", HIGH), ("transformer_2", LOW)])
def test_each_experts_comfy_file_uses_only_keys_comfyui_maps_for_wan(trained, comp, suffix):
    den, final = trained
    expert = den.experts[comp]
    state = load_file(final / named(KOHYA_FILE, suffix))
    stems = comfy_lora_keys.stems(state)
    assert stems and stems <= comfy_lora_keys.unet_stems(expert), sorted(stems - comfy_lora_keys.unet_stems(expert))
    blocks = expert.blocks[0]
    mod = blocks.attn1.to_q
    up, down = (
        state["lora_unet_blocks_0_self_attn_q.lora_up.weight"],
        state["lora_unet_blocks_0_self_attn_q.lora_down.weight"],
    )
    want = (ALPHA / RANK) * mod.lora_B["default"].weight @ mod.lora_A["default"].weight
    torch.testing.assert_close(state["lora_unet_blocks_0_self_attn_q.alpha"] / RANK * up @ down, want.detach())


def _one_transformer(model_dir, out):
    """`model_dir` without its low-noise expert and boundary: a Wan 2.2 folder of one transformer."""
    import json

    out.mkdir()
    for part in model_dir.iterdir():
        if part.name != "model_index.json":
            (out / part.name).symlink_to(part)
    index = json.loads((model_dir / "model_index.json").read_text())
    index = {k: v for k, v in index.items() if k != "boundary_ratio"} | {"transformer_2": [None, None]}
    (out / "model_index.json").write_text(json.dumps(index))
    return out


def test_a_folder_with_one_transformer_trains_it_on_every_timestep_and_refuses_an_expert(built, tmp_path):
    """Its LoRA files are the whole model's: no expert suffix."""
    from tuneline.stages.families.wan22.adapter import chosen_experts

    fam, model_dir, _ = built
    one = _one_transformer(model_dir, tmp_path / "one")
    assert chosen_experts(one, None) == (("transformer",), None)
    with pytest.raises(ValueError, match=r"model.expert low: .*one transformer, so there is no.*remove model"):
        chosen_experts(one, "low")
    t = TrainConfig(mode="lora", lora_rank=RANK, lora_alpha=ALPHA, lora_format="both")
    den, _ = prepare_denoiser(fam, one, t, torch.float32, CPU)
    assert fam.sigma_range(den) == (0.0, 1.0)
    save_final(fam, one, den, t, tmp_path / "final")
    assert sorted(p.name for p in (tmp_path / "final").iterdir()) == sorted([DIFFUSERS_FILE, KOHYA_FILE])


@pytest.mark.parametrize(
    "index, match",
    [
        ({"transformer_2": ["diffusers", "WanTransformer3DModel"]}, r"boundary_ratio is missing.*add .*0.875"),
        (
            {"expand_timesteps": True},
            r"expand_timesteps is true.*TI2V 5B.*does not train.*set model.config wan22_ti2v.*Wan2.2-T2V-A14B",
        ),
    ],
)
def test_a_folder_wan22_cannot_train_is_refused_naming_the_fix(tmp_path, index, match):
    import json

    from tuneline.stages.families.wan22.adapter import folder_experts

    base = {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"]}
    (tmp_path / "model_index.json").write_text(json.dumps(base | index))
    with pytest.raises(ValueError, match=rf"model_index.json: .*{match}"):
        folder_experts(tmp_path)


def _planner(model_dir, tmp_path, expert):
    from tuneline.schemas.config import parse_config
    from tuneline.stages.train.memplan import planner_for

    model = {"family": "wan22", "path": str(model_dir), "device": "cpu", "expert": expert}
    train = {"mode": "lora", "steps": 2, "validate_every": 1}
    data = {"model": model, "train": train, "buckets": {"resolution": 32, "frames": [5]}, "text": {"max_length": 16}}
    return planner_for(parse_config(data, workdir=str(tmp_path)), model_dir, False)


def test_the_plan_counts_the_experts_a_run_holds_and_renders_with(built, tmp_path):
    """A one-expert run's render loads the other expert too (Family.load_pipeline); a one-transformer folder
    holds one denoiser."""
    from tuneline.stages.train.memcheck import stored_params

    _, model_dir, _ = built
    both, low = _planner(model_dir, tmp_path, None), _planner(model_dir, tmp_path, "low")
    one = _planner(_one_transformer(model_dir, tmp_path / "one"), tmp_path, None)
    assert (both.held, low.held, one.held) == (2, 1, 1)
    high_noise = stored_params(model_dir / "transformer")
    assert low.render_bytes - both.render_bytes == 4 * high_noise > 0  # float32 on the CPU
    assert one.render_bytes == both.render_bytes
    assert one.describe(None)[2] == low.describe(None)[2] == both.describe(None)[2] // 2


def test_the_plan_of_swapped_experts_keeps_one_experts_blocks_on_the_device(built, tmp_path):
    """train.blocks_to_swap with both experts: the expert a step does not run frees its blocks (swap.ExpertSwappers),
    so beside one expert's resident blocks the device holds only the other's parts outside the blocks."""
    from dataclasses import replace

    _, model_dir, _ = built
    resident = {}
    for expert in (None, "low"):
        planner = _planner(model_dir, tmp_path, expert)
        terms = dict(planner.terms(replace(planner.current(), blocks_to_swap=1)))
        resident[expert] = sum(v for k, v in terms.items() if k.startswith(("weights", "swapped blocks")))
    outside = _planner(model_dir, tmp_path, "low").describe(None)[1]
    assert resident[None] - resident["low"] == outside > 0


def test_a_quantized_base_reaches_the_device_one_expert_at_a_time(built, monkeypatch):
    """Over model.quantize each expert is quantized on its way to the device as soon as it is built, so the host
    never holds both experts' 16-bit weights (A14B: about 27 GiB each). The meta device stands in for a GPU."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    from tuneline.stages.train.quantize import quantize_base

    fam, model_dir, _ = built
    events, load = [], fam.denoiser_class.from_pretrained

    def loading(*args, **kwargs):
        events.append("load")
        return load(*args, **kwargs)

    def placing(module):
        events.append("place")
        return quantize_base(module, quantize="int8", device=torch.device("meta"))

    monkeypatch.setattr(fam.denoiser_class, "from_pretrained", loading)
    den = fam.load_denoiser(model_dir, torch.bfloat16, torch.device("meta"), place=placing)
    assert events == ["load", "place", "load", "place"]
    assert {p.device.type for p in den.parameters()} == {"meta"}
    events.clear()
    t = TrainConfig(mode="lora", lora_rank=RANK)
    quantized, _ = prepare_denoiser(fam, model_dir, t, torch.bfloat16, CPU, quantize="int8")  # the training path
    assert events == ["load", "load"]
    for expert in quantized.experts.values():
        assert any(is_traceable_wrapper_subclass(m.weight) for m in expert.modules() if hasattr(m, "weight"))
