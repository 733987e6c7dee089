"""train.adapter lokr/loha/dora: the exported LyCORIS-layout file, read with ComfyUI's formulas
(comfy/weight_adapter/lokr.py, loha.py, lora.py + base.weight_decompose), gives each module exactly the update
peft applies (its merged weight minus the base), for a UNet (sd15) and transformer families with a kohya layout
(flux) and without one (z_image, flux2: ComfyUI maps their diffusers names); refusals."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.unit.test_config_checks import refused
from tuneline.schemas.train import TrainConfig
from tuneline.stages.families.registry import get_family
from tuneline.stages.train import adapters
from tuneline.stages.train.export import KOHYA_FILE
from tuneline.stages.train.model import prepare_denoiser, save_final

CPU = torch.device("cpu")
FAMILIES = ("sd15", "flux", "z_image", "flux2")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    return {name: (get_family(name), get_family(name).ensure_model(None, cache)) for name in FAMILIES}


def comfy_delta(f: dict[str, torch.Tensor], base: torch.Tensor) -> torch.Tensor:
    """The weight change ComfyUI applies at strength 1 from one module's keys (its published formulas)."""
    alpha = f["alpha"].item() if "alpha" in f else None
    if "hada_w1_a" in f:
        m1, m2 = f["hada_w1_a"] @ f["hada_w1_b"], f["hada_w2_a"] @ f["hada_w2_b"]
        return (m1 * m2).reshape(base.shape) * (alpha / f["hada_w1_b"].shape[0])
    if any(k.startswith("lokr_") for k in f):
        dim = None
        w1 = f.get("lokr_w1")
        if w1 is None:
            dim, w1 = f["lokr_w1_b"].shape[0], f["lokr_w1_a"] @ f["lokr_w1_b"]
        w2 = f.get("lokr_w2")
        if w2 is None:
            dim, w2 = f["lokr_w2_b"].shape[0], f["lokr_w2_a"] @ f["lokr_w2_b"]
        if w2.dim() == 4:
            w1 = w1.unsqueeze(2).unsqueeze(2)
        scale = alpha / dim if alpha is not None and dim is not None else 1.0
        return torch.kron(w1, w2).reshape(base.shape) * scale
    down, up = f["lora_down.weight"], f["lora_up.weight"]
    diff = (up.flatten(1) @ down.flatten(1)).reshape(base.shape) * (alpha / down.shape[0])
    scale = f["dora_scale"]
    calc = base + diff
    norm = base.reshape(base.shape[0], -1).norm(dim=1, keepdim=True).reshape(base.shape[0], *[1] * (base.dim() - 1))
    return calc * (scale / (norm + torch.finfo(base.dtype).eps)) - base


def trained_deltas(den) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module path -> (base weight, merged weight - base) through peft's own merge."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    out = {}
    for path, layer in den.named_modules():
        if isinstance(layer, BaseTunerLayer):
            base = layer.get_base_layer().weight.detach().clone()
            layer.merge()
            out[path] = (base, layer.get_base_layer().weight.detach() - base)
            layer.unmerge()
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "adapter,extra", [("lokr", {}), ("lokr", {"lokr_factor": 4, "lora_rank": 2}), ("loha", {}), ("dora", {})]
)
def test_exported_file_recomputes_the_trained_delta(models, tmp_path, family, adapter, extra):
    fam, model_dir = models[family]
    t = TrainConfig(mode="lora", adapter=adapter, lora_alpha=3.0, processes=1, **{"lora_rank": 4, **extra})
    den, params = prepare_denoiser(fam, model_dir, t, torch.float32, CPU)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a trained adapter: every factor (and DoRA's magnitude) away from its init
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    den.eval()
    exports = save_final(fam, model_dir, den, t, tmp_path / "final")
    assert [e["format"] for e in exports] == (["diffusers", "kohya"] if adapter == "dora" else ["kohya"])
    assert adapters.not_exported(t) == (
        [] if adapter == "dora" else [{"format": "diffusers", "reason": adapters.not_exported(t)[0]["reason"]}]
    )
    state = load_file(str(tmp_path / "final" / KOHYA_FILE))
    deltas = trained_deltas(den)
    by_stem = {adapters.stem(family, path, den): path for path in deltas}
    stems = {k.split(".", 1)[0] for k in state}
    assert stems == set(by_stem)  # every trained module, and nothing else
    suffixes = {k.split(".", 1)[1] for k in state}
    assert suffixes & {"lokr": {"lokr_w1", "lokr_w1_a"}, "loha": {"hada_w1_a"}, "dora": {"dora_scale"}}[adapter]
    if family == "flux":  # fused q/k/v keep their diffusers names, as ComfyUI maps SimpleTuner's LyCORIS files
        assert any(s.startswith("lycoris_") for s in stems) and any(s.startswith("lora_unet_") for s in stems)
    if family in ("z_image", "flux2"):  # the SimpleTuner LyCORIS names ComfyUI maps for Lumina2 and Flux models
        assert all(s.startswith("lycoris_") for s in stems), sorted(stems)[:4]
    for name, path in by_stem.items():
        base, delta = deltas[path]
        keys = {k.split(".", 1)[1]: v for k, v in state.items() if k.split(".", 1)[0] == name}
        assert delta.abs().max() > 0
        torch.testing.assert_close(comfy_delta(keys, base), delta, rtol=1e-4, atol=1e-5)
    # validation's loader for the file (diffusers has none for lokr/loha) gives the trained weights too
    fresh = fam.load_denoiser(model_dir, torch.float32, CPU)
    assert adapters.apply_file(family, fresh, state) == len(deltas)
    modules = dict(fresh.named_modules())
    for path, (base, delta) in deltas.items():
        torch.testing.assert_close(modules[path].weight.detach(), base + delta, rtol=1e-4, atol=1e-5)


def test_adapter_settings_refused_naming_fields():
    with pytest.raises(ValueError, match="train.adapter lokr.*train.mode"):
        TrainConfig(mode="full", adapter="lokr")
    with pytest.raises(ValueError, match="train.lokr_factor"):
        TrainConfig(mode="lora", adapter="loha", lokr_factor=4)
    refused({"train": {"mode": "lora", "adapter": "lycoris"}}, "train.adapter")
    TrainConfig(mode="lora", adapter="dora")
    refused(
        {"model": {"quantize": "int8"}, "train": {"mode": "lora", "adapter": "loha"}},
        "train.adapter loha",
        "model.quantize int8",
    )


def test_dora_diffusers_file_loads_with_load_lora_weights_exactly(models, tmp_path):
    """dora keeps the diffusers file: stock load_lora_weights + fuse_lora gives peft's merged weights."""
    from diffusers import DiffusionPipeline

    fam, model_dir = models["sd15"]
    t = TrainConfig(mode="lora", adapter="dora", lora_rank=4, lora_alpha=3.0, processes=1)
    den, params = prepare_denoiser(fam, model_dir, t, torch.float32, CPU)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    den.eval()
    save_final(fam, model_dir, den, t, tmp_path / "final")
    pipe = DiffusionPipeline.from_pretrained(model_dir, safety_checker=None, requires_safety_checker=False)
    pipe.load_lora_weights(tmp_path / "final")
    pipe.fuse_lora()
    loaded = dict(pipe.unet.named_modules())
    deltas = trained_deltas(den)
    for path, (base, delta) in deltas.items():
        layer = loaded[path]
        torch.testing.assert_close(getattr(layer, "base_layer", layer).weight.detach(), base + delta)
    assert deltas
