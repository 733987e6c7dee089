"""The one renderer every family uses: the validation stage, the learning check and in-training validation.

Prompts are encoded through the family adapter and handed to the pipeline as embeddings (the adapter also says
which keyword arguments carry them and the negative prompt); seeds become per-sample generators on the device of
the tensors they feed. Several prompts render in one pipeline call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from tuneline.schemas.families import facts as family_facts
from tuneline.stages.common.sizing import render_size
from tuneline.stages.families.common import unwrap
from tuneline.stages.render.prompts import batch_of, encode_prompts

MAX_BATCH = 16  # samples per pipeline call (x2 with classifier-free guidance)


class BadRender(ValueError):
    """A rendered image is NaN or one flat color: published, it would be a black square with exit code 0."""


@dataclass(frozen=True)
class Sample:
    prompt: str
    negative_prompt: str
    seed: int
    image: Any = None  # an edit's input (control) image at the render size, for families that take one


class Renderer:
    """A loaded pipeline + live text encoders. Build it with `Renderer.load`."""

    def __init__(
        self,
        fam,
        pipe,
        encoders,
        device: torch.device,
        autocast: torch.dtype | None = None,
        prompt_cache: tuple[Path, str] | None = None,
    ):
        self.fam, self.pipe, self.enc, self.device, self.autocast = fam, pipe, encoders, device, autocast
        self.prompt_cache = prompt_cache

    @classmethod
    def load(
        cls,
        fam,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        *,
        adapt: Callable[[Any], None] | None = None,
        denoiser: torch.nn.Module | None = None,
        autocast: torch.dtype | None = None,
        max_length: int | None = None,
        prompt_cache: tuple[Path, str] | None = None,
        input_area: int | None = None,
    ) -> Renderer:
        """The pipeline in `model_dir`, changed by `adapt` (validate loads the trained LoRA weights with it:
        stages/train/export.load_lora, which this layer below the stages does not import), or with a live `denoiser` (in training)
        in place of the folder's own. `max_length` must be the one training used, so prompts condition alike;
        `prompt_cache` = (file, key): encoded prompts kept across runs (stages/render/prompts.py); `input_area`:
        the pixels an edit family's input images are scaled to, as training's were (resolve.input_area)."""
        pipe = fam.load_pipeline(model_dir, dtype, device, unwrap(denoiser) if denoiser is not None else None)
        if adapt is not None:
            adapt(pipe)
        # Rendering only decodes; an empty module rather than None, as some VAEs (Qwen-Image) walk theirs when decoding.
        if not fam.takes_control:  # an edit family's pipeline encodes its input image
            pipe.vae.encoder = torch.nn.Module()
        pipe.set_progress_bar_config(disable=True)
        encoders = fam.text_encoders_of(pipe, max_length)
        encoders.input_area = input_area
        return cls(fam, pipe, encoders, device, autocast, prompt_cache)

    def render(
        self,
        samples: Sequence[Sample],
        width: int,
        height: int,
        steps: int,
        guidance: float,
        output_type: str = "pil",
        frames: int = 1,
    ) -> list:
        """One output per sample, in order (PIL images, or latent tensors for output_type='latent'); a video
        family's `frames` > 1: each a clip, its frames as a list of PIL images."""
        out: list = [None] * len(samples)
        # A sample without a negative prompt lets the pipeline use its own unconditional input, so those and the
        # ones with a negative render in separate calls (mixing them would change what "no negative" means).
        groups = [[i for i, s in enumerate(samples) if bool(s.negative_prompt) == neg] for neg in (False, True)]
        # A pipeline whose input images are shared by every prompt of a call (FLUX.2's references) renders each
        # sample with its own images in a call of its own.
        shared = samples and samples[0].image is not None and self.fam.one_control_per_call
        # A clip's activations are its frames' (81 frames of Wan 14B with guidance fill a large card): one per call.
        size = 1 if shared or frames > 1 else MAX_BATCH
        for group in groups:
            for start in range(0, len(group), size):
                idx = group[start : start + size]
                for i, result in zip(
                    idx, self._call([samples[i] for i in idx], width, height, steps, guidance, output_type, frames)
                ):
                    out[i] = result
        return out

    def decode(self, latents: torch.Tensor) -> list[Image.Image]:
        """PIL images of denoiser-space (C, H, W) latents, decoded as the pipeline's own last step does (so a check
        can look at the pixels of latents it already rendered instead of sampling them again)."""
        vae = self.pipe.vae
        scale, shift = self.fam.vae_factors(vae)
        param = next(vae.parameters())
        with torch.no_grad():
            pixels = vae.decode(latents.to(param.device, param.dtype) / scale + shift, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(pixels.float(), output_type="pil")

    def _call(
        self, batch: list[Sample], width: int, height: int, steps: int, guidance: float, output_type: str, frames: int
    ) -> list:
        amp = torch.autocast(self.device.type, self.autocast) if self.autocast else nullcontext()
        with torch.no_grad(), amp:
            prompts = [s.prompt for s in batch]
            negatives = [s.negative_prompt for s in batch] if batch[0].negative_prompt else []
            if not negatives and self.fam.negative_required:
                negatives = [""] * len(batch)  # what such a pipeline encodes itself for a missing negative
            file, key = self.prompt_cache or (None, "")
            encoded = encode_prompts(self.fam, self.enc, prompts + negatives, cache=file, key=key)
            text = batch_of(encoded, prompts, self.device)
            neg = batch_of(encoded, negatives, self.device) if negatives else None
            gens = [torch.Generator(device=self.device).manual_seed(s.seed) for s in batch]
            # Pictures come back as floats first: NaN would silently turn black in the 8-bit conversion.
            # An edit family's input images (if any) and size, and its call (prompts encoded with the images).
            images = [s.image for s in batch] if batch[0].image is not None else None
            edit = self.fam.control_kwargs(images, width, height)
            kwargs = {**self.fam.prompt_kwargs(text, neg), **edit}
            pipe, kwargs = self.fam.edit_call(self.pipe, self.enc, kwargs, prompts, negatives)
            # a clip: diffusers' video pipelines take num_frames and return frames (B, F, H, W, 3)
            clip = {"num_frames": frames} if frames > 1 else self.fam.render_kwargs
            out = pipe(
                **kwargs,
                **clip,
                width=width,
                height=height,
                num_inference_steps=steps,
                guidance_scale=guidance,
                generator=gens,
                output_type="np" if output_type == "pil" else output_type,
            )
            images = self.fam.rendered(out) if frames == 1 else out.frames
        if output_type != "pil":
            return list(images)
        for s, img in zip(batch, images):
            check_render(img, s)
        if frames > 1:
            return [list(self.pipe.numpy_to_pil(clip)) for clip in images]
        return list(self.pipe.numpy_to_pil(images))


def check_render(pixels, sample: Sample) -> None:
    """Refuse an image that is NaN/Inf anywhere or a single flat color, as a NaN loss is refused."""
    import numpy as np

    arr = np.asarray(pixels, dtype=np.float32)
    what = (
        "holds NaN or infinite values"
        if not np.isfinite(arr).all()
        else "is one flat color"
        if arr.size and float(arr.max()) == float(arr.min())
        else None
    )
    if what:
        raise BadRender(
            f"the render of validation prompt {sample.prompt!r} (seed {sample.seed}) {what}: the weights "
            f"or the encoded prompts hold non-finite values (a diverged training: lower "
            f"train.learning_rate; or a damaged <workdir>/.cache, which can be deleted); nothing "
            f"was published"
        )


def grid(images: list[Image.Image], cols: int = 4) -> Image.Image:
    cols = max(1, min(cols, len(images)))
    rows = (len(images) + cols - 1) // cols
    w = max(i.width for i in images)
    h = max(i.height for i in images)
    canvas = Image.new("RGB", (cols * w, rows * h), (0, 0, 0))
    for n, img in enumerate(images):
        canvas.paste(img, ((n % cols) * w, (n // cols) * h))
    return canvas


def render_size_for(cfg, aspect: float | None = None) -> tuple[int, int]:
    """Pixel or area units, converted and aligned by the same function the scan uses."""
    v, b = cfg.validate_, cfg.buckets
    align = b.alignment or family_facts(cfg.model.family).alignment
    return render_size(
        v.resolution or b.resolution,
        v.resolution_type or b.resolution_type,
        align,
        v.aspect if aspect is None else aspect,
    )
