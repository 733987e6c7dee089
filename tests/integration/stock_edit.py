"""Test helpers shared by the edit families' tests: a trained edit LoRA read by the stock diffusers pipeline must
edit as the trained model does.

- FLUX.1 Kontext and FLUX.2 (`trained_edit`, `StockEdit`): the instruction "make it red" with seed 3 at 64 px,
  2 steps, guidance 2, as latents, from the product's renderer (the run's LoRA) and from the stock pipeline.
- Qwen-Image-Edit (Plus) (`assert_qwen_edit_renders_as_validated`): the LoRA changes the stock transformer, the
  stock pipeline renders validation's edit with the same pixels, and the ComfyUI file is in Qwen-Image's layout;
  `stock_qwen_edit_forward`: the stock pipeline's transformer call, to compare the family's denoise with;
- `validated_edit_grid`: a paired run's cached controls and validation grid.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open

from tuneline.schemas.validate import ValidateManifest
from tuneline.stages.families.registry import get_family
from tuneline.stages.train.export import DIFFUSERS_FILE, KOHYA_FILE, lora_loader
from tuneline.stages.validate.edits import LABEL_HEIGHT

CPU = torch.device("cpu")
PROMPT, SEED, EDGE, STEPS, GUIDANCE = "make it red", 3, 64, 2, 2.0


def trained_edit(ctx, family: str, final: Path, image) -> torch.Tensor:
    """The edit as validation renders it with the trained LoRA in `final`."""
    from tuneline.stages.render.renderer import Renderer, Sample
    from tuneline.stages.text import effective_max_length

    fam = get_family(family)
    model_dir = fam.ensure_model(None, ctx.workdir / "models")
    trained = Renderer.load(
        fam,
        model_dir,
        CPU,
        torch.float32,
        adapt=lora_loader(family, final),
        max_length=effective_max_length(ctx.cfg),
    )
    return torch.as_tensor(trained.render([Sample(PROMPT, "", SEED, image)], EDGE, EDGE, STEPS, GUIDANCE, "latent")[0])


class StockEdit:
    """The stock diffusers pipeline `pipeline` (a class) of the run's model, with or without its LoRA."""

    def __init__(self, ctx, family: str, pipeline, final: Path, **call):
        from tuneline.stages.text import effective_max_length

        self.model_dir = get_family(family).ensure_model(None, ctx.workdir / "models")
        self.pipeline, self.final = pipeline, final
        self.call = {"max_sequence_length": effective_max_length(ctx.cfg), **call}

    def load(self, lora: bool = True):
        pipe = self.pipeline.from_pretrained(self.model_dir, torch_dtype=torch.float32)
        if lora:
            pipe.load_lora_weights(self.final, weight_name=DIFFUSERS_FILE)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def render(self, pipe, image) -> torch.Tensor:
        size = {"width": EDGE, "height": EDGE, "num_inference_steps": STEPS, "guidance_scale": GUIDANCE}
        gen = torch.Generator().manual_seed(SEED)
        return pipe(prompt=PROMPT, image=image, generator=gen, output_type="latent", **size, **self.call).images[0]


def assert_qwen_edit_renders_as_validated(ctx, paths: dict, family: str, pipeline, image) -> None:
    """`pipeline` (QwenImageEditPipeline or the Plus one) with the run's LoRA: the LoRA changes its transformer and
    it renders validation's one edit (`image` as validation handed it) with the same pixels."""
    from tuneline.stages.families.qwen_image_edit.vocab import load_processor

    model_dir = get_family(family).ensure_model(None, ctx.workdir / "models")
    pipe = pipeline.from_pretrained(model_dir, processor=load_processor(model_dir / "processor"))
    pipe.set_progress_bar_config(disable=True)
    gen = torch.Generator().manual_seed(0)
    probe = {"hidden_states": torch.randn(1, 4, 64, generator=gen), "timestep": torch.tensor([0.5])}
    probe |= {"encoder_hidden_states": torch.randn(1, 5, 32, generator=gen), "img_shapes": [[(1, 2, 2)]]}
    with torch.no_grad():
        base = pipe.transformer(**probe, return_dict=False)[0]
        pipe.load_lora_weights(paths["train"] / "final", weight_name=DIFFUSERS_FILE)
        assert not torch.allclose(pipe.transformer(**probe, return_dict=False)[0], base), "the LoRA must change it"
    [shown] = ctx.store.read(paths["validate"], ValidateManifest).images
    gen = [torch.Generator().manual_seed(shown.seed)]
    size = {"width": EDGE, "height": EDGE, "num_inference_steps": ctx.cfg.validate_.steps}
    out = pipe(prompt=shown.prompt, image=image, generator=gen, output_type="np", **size)
    got = np.asarray(pipe.numpy_to_pil(out.images)[0], dtype=np.int16)
    with Image.open(paths["validate"] / shown.file) as v:
        want = np.asarray(v.convert("RGB"), dtype=np.int16)
    assert np.abs(got - want).max() <= 1  # 8-bit rounding of the same floats
    # The ComfyUI (kohya) file in Qwen-Image's layout: lora_unet_ + the diffusers module path.
    with safe_open(str(paths["train"] / "final" / KOHYA_FILE), framework="pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert "lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight" in keys
    assert meta["ss_base_model_version"] == family


def stock_qwen_edit_forward(
    pipe, latents, image_latents, text: dict, t: torch.Tensor, img_shapes: list
) -> torch.Tensor:
    """The stock Qwen-Image-Edit (Plus) pipeline's transformer call: the target's tokens, then the images' (their
    `img_shapes` after the target's), the output at the target's tokens."""
    with torch.no_grad():
        out = pipe.transformer(
            hidden_states=torch.cat([latents, image_latents], dim=1),
            timestep=t / 1000,
            encoder_hidden_states=text["prompt_embeds"],
            encoder_hidden_states_mask=text["prompt_embeds_mask"],
            img_shapes=[img_shapes],
            return_dict=False,
        )
    return out[0][:, : latents.shape[1]]


def validated_edit_grid(ctx, paths: dict, count: int, prompts: list[str]) -> np.ndarray:
    """The latents hold `count` controls, each encoded; validation rendered two edits with `prompts`, each beside
    its control under a band naming its instruction: the grid's pictures (2 x 2 images of 64 px, bands left out) as
    an array."""
    from tuneline.schemas.latents import LatentsManifest

    lat = ctx.store.read(paths["latents"], LatentsManifest)
    assert lat.controls == lat.count == count and lat.controls_encoded == count
    val = ctx.store.read(paths["validate"], ValidateManifest)
    assert [i.prompt for i in val.images] == prompts
    assert val.controls == ["000-control.png", "001-control.png"]
    return grid_pictures(paths["validate"] / "grid.png", 2)


def grid_pictures(path: Path, rows: int) -> np.ndarray:
    """An edit grid of `rows` rows (control | result, each under its instruction's band) without the bands."""
    with Image.open(path) as g:
        assert g.size == (2 * EDGE, rows * (EDGE + LABEL_HEIGHT))
        grid = np.asarray(g.convert("RGB"))
    return np.concatenate([grid[r * (EDGE + LABEL_HEIGHT) + LABEL_HEIGHT :][:EDGE] for r in range(rows)])
