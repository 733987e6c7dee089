"""Qwen-Image-Edit: Qwen-Image's transformer, VAE and Qwen2.5-VL text encoder, conditioned as diffusers'
QwenImageEditPipeline conditions them:
- the input (control) image's latents are packed 2x2 into tokens and appended to the generated image's tokens, and
  the transformer's `img_shapes` lists both (its RoPE tells them apart); the loss is on the target's tokens. The
  pipeline VAE-encodes the input at about 1024 x 1024 pixels at its aspect ratio, whatever the output size, so the
  latents stage caches controls at that size (control_size), not at the target's bucket;
- the text encoder sees the control image: the edit template around the instruction with the image's vision tokens
  (Qwen2VLProcessor), its last hidden states with the template's first 64 tokens dropped. The image is first resized
  as the pipeline resizes it (to about 1024 x 1024 pixels at its own aspect ratio, calculate_dimensions).
  The text stage caches these per (instruction, control image) (stages/text/controls.py).

With no control (dataset.control null) it is Qwen-Image: text-only prompts in Qwen-Image's template, rendered
through QwenImagePipeline built from the same components (QwenImageEditPipeline needs an input image).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import MicroCond, TextEncoders
from tuneline.stages.families.common import module_device
from tuneline.stages.families.qwen_image.adapter import (
    SCHEDULER,
    QwenImageFamily,
    pack_latents,
    tiny_qwen25vl,
    unpack_latents,
)
from tuneline.stages.families.qwen_image_edit.vocab import (
    EDIT_DROP,
    EDIT_TEMPLATE,
    VISION,
    build_edit_tokenizer,
    load_processor,
    tiny_processor,
)

# The conditioning key the training loop fills from the cached control latents (scaled like the targets).
CONTROL_KEY = "control_latents"
# QwenImagePipeline refuses longer prompt embeddings (check_inputs); its text-only rows are padding past that.
T2I_LIMIT = 1024


def prompt_image(image, area: int | None = None):
    """The control image as QwenImageEditPipeline hands it to the text encoder: resized by its image processor's
    resize to calculate_dimensions(1024 * 1024, width / height), or to `area` pixels (inputs.py)."""
    from diffusers.image_processor import VaeImageProcessor

    from tuneline.stages.families.qwen_image_edit.inputs import PIPELINE_AREA, scaled_size

    image = image.convert("RGB")
    width, height = scaled_size(area or PIPELINE_AREA, image.width, image.height)
    return VaeImageProcessor(vae_scale_factor=16).resize(image, height, width)


class QwenImageEditFamily(QwenImageFamily):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["qwen_image_edit"]
    # The training loop hands this family the batch's control latents (stages/latents/controls.py).
    takes_control: ClassVar[bool] = True
    # Its text encoder sees the control image: the text stage encodes (instruction, control image) pairs.
    text_sees_control: ClassVar[bool] = True

    # ---- tiny flavor -------------------------------------------------------------------------
    def build_tiny(self, out_dir: Path) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        tok = build_edit_tokenizer(out_dir / "tokenizer", self.facts.max_length_limit + EDIT_DROP)
        width = 32
        text_encoder = tiny_text_encoder(tok, width)
        transformer, vae = self.tiny_denoiser_and_vae(width)
        pipe = self.pipeline_class(
            scheduler=FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tok,
            processor=tiny_processor(tok),
            transformer=transformer,
        )
        pipe.save_pretrained(out_dir, safe_serialization=True)

    def control_size(self, width: int, height: int, area: int | None = None) -> tuple[int, int]:
        """The pixel size the latents stage caches a control at, for a target bucket of (width, height): the
        pipeline's calculate_dimensions(1024 * 1024, ratio), the size it VAE-encodes an input image of the target's
        aspect ratio at (the control is aligned to its target first: same crop), or `area` pixels (inputs.py)."""
        from tuneline.stages.families.qwen_image_edit.inputs import PIPELINE_AREA, scaled_size

        return scaled_size(area or PIPELINE_AREA, width, height)

    def check_folder(self, folder: Path) -> None:
        super().check_folder(folder)
        if not (folder / "processor" / "tokenizer_config.json").is_file():
            raise ValueError(
                f"model.path: {folder} lacks component 'processor' (the Qwen2-VL processor with its tokenizer) "
                f"needed by family {self.facts.name!r}"
            )

    # ---- loading -----------------------------------------------------------------------------
    def load_pipeline(
        self, model_dir: Path, dtype: torch.dtype, device: torch.device, denoiser: torch.nn.Module | None = None
    ) -> Any:
        parts: dict[str, Any] = {self.denoiser_component: denoiser} if denoiser is not None else {}
        processor = load_processor(Path(model_dir) / "processor")
        pipe = self.pipeline_class.from_pretrained(model_dir, dtype=dtype, processor=processor, **parts)
        pipe = pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def load_text_encoders(
        self, model_dir: Path, dtype: torch.dtype, device: torch.device, max_length: int | None = None
    ) -> TextEncoders:
        enc = super().load_text_encoders(model_dir, dtype, device, max_length)
        enc.extra["processor"] = load_processor(Path(model_dir) / "processor")
        return enc

    def text_encoders_of(self, pipe: Any, max_length: int | None = None) -> TextEncoders:
        enc = super().text_encoders_of(pipe, max_length)
        enc.extra["processor"] = pipe.processor
        return enc

    # ---- text --------------------------------------------------------------------------------
    def encode_text(self, enc: TextEncoders, captions: list[str], images: list[Any] | None = None):
        """Without images, Qwen-Image's text-only encoding. With one control image (PIL) per caption, as
        QwenImageEditPipeline._get_qwen_prompt_embeds: the edit template and the image through the processor, the
        last hidden states of the real tokens with the first 64 dropped; zero-padded to max_length with a 0/1 mask
        (the pipeline pads to the batch's longest; the padding is masked)."""
        if images is None:
            return super().encode_text(enc, captions)
        if len(images) != len(captions):
            raise ValueError(f"{len(images)} control images for {len(captions)} instructions")
        te, dev = enc.encoders[0], module_device(enc.encoders[0])
        texts, pictures = self.edit_inputs(captions, images, enc.input_area)
        inputs = enc.extra["processor"](
            text=texts,
            images=pictures,
            padding=True,
            return_tensors="pt",
        ).to(dev)
        with torch.no_grad():
            hidden = te(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                pixel_values=inputs["pixel_values"],
                image_grid_thw=inputs["image_grid_thw"],
                output_hidden_states=True,
            ).hidden_states[-1]
        length = enc.max_length
        embeds = hidden.new_zeros(len(captions), length, hidden.shape[-1])
        mask = torch.zeros(len(captions), length, dtype=torch.long, device=dev)
        for i, m in enumerate(inputs["attention_mask"].bool()):
            kept = hidden[i][m][EDIT_DROP:]
            if len(kept) > length:
                raise ValueError(
                    f"the instruction {captions[i]!r} with its control image takes {len(kept)} tokens (the image's "
                    f"vision tokens included), more than text.max_length {length}: raise text.max_length to at "
                    f"least {len(kept)} and run `tuneline stage text`"
                )
            embeds[i, : len(kept)], mask[i, : len(kept)] = kept, 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def edit_inputs(
        self, captions: list[str], images: list[Any], area: int | None = None
    ) -> tuple[list[str], list[Any]]:
        """The processor's texts and images: the edit template around each instruction, and each control image
        resized as the pipeline resizes it for its text encoder (to `area` pixels where the run sets one)."""
        return [EDIT_TEMPLATE.format(c) for c in captions], [prompt_image(im, area) for im in images]

    # ---- training ----------------------------------------------------------------------------
    def denoise(
        self,
        denoiser: torch.nn.Module,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        text: dict[str, torch.Tensor],
        micro: list[MicroCond] | None = None,
    ) -> torch.Tensor:
        """QwenImageFamily.denoise with the control tokens appended (QwenImageEditPipeline's
        `torch.cat([latents, image_latents], dim=1)` and its two-entry `img_shapes`); only the target tokens'
        prediction comes back."""
        control = text.get(CONTROL_KEY)
        if control is None:
            return super().denoise(denoiser, noisy, timesteps, text, micro)
        b, _, h, w = noisy.shape
        ch, cw = control.shape[-2:]
        dt, dev = noisy.dtype, noisy.device
        if control.shape[0] != b or ch % 2 or cw % 2:
            raise ValueError(f"control latents {tuple(control.shape)} do not fit the targets {tuple(noisy.shape)}")
        # (B, N, C, h, w): several references (the Plus pipeline), each packed after the last, one img_shapes entry each
        refs = control.unbind(1) if control.dim() == 5 else [control]
        target = pack_latents(noisy)
        out = denoiser(
            hidden_states=torch.cat([target, *(pack_latents(r.to(dev, dt).contiguous()) for r in refs)], dim=1),
            timestep=timesteps.to(dev, dt) / 1000,
            encoder_hidden_states=text["prompt_embeds"].to(device=dev, dtype=dt),
            encoder_hidden_states_mask=text["prompt_embeds_mask"].to(dev),
            img_shapes=[[(1, h // 2, w // 2), *[(1, ch // 2, cw // 2)] * len(refs)]] * b,
            return_dict=False,
        )[0]
        return unpack_latents(out[:, : target.shape[1]], h, w)

    # ---- validation --------------------------------------------------------------------------
    def control_kwargs(self, images: list[Any] | None, width: int, height: int) -> dict[str, Any]:
        """The input images for QwenImageEditPipeline (it resizes them itself, as the text stage did)."""
        return {"image": images} if images is not None else {}

    def edit_call(self, pipe: Any, enc: TextEncoders, kwargs: dict, prompts: list[str], negatives: list[str]):
        """(pipeline, call arguments) for one render batch. With input images: the stock edit pipeline, its prompts
        encoded with those images (encode_text, as the text cache encoded them for training), called with the
        images scaled to the run's input area where it sets one (inputs.py). Without: text to
        image through QwenImagePipeline on the same components, the text-only prompts already encoded."""
        images = kwargs.get("image")
        if images is None:
            return text_to_image(pipe), trim_padding(kwargs)
        from tuneline.stages.families.qwen_image_edit.inputs import with_input_area

        dev = pipe._execution_device
        kwargs = {k: v for k, v in kwargs.items() if not k.endswith(("prompt_embeds", "prompt_embeds_mask"))}
        kwargs.pop("max_sequence_length", None)  # QwenImageEditPipeline only checks it against 1024
        for prefix, texts in (("", prompts), ("negative_", negatives)):
            if texts:
                out = self.encode_text(enc, texts, images)
                kwargs |= {f"{prefix}{k}": out[k].to(dev) for k in self.prompt_keys}
        return with_input_area(pipe, enc.input_area), kwargs

    def rendered_latents(self, latents: torch.Tensor, width: int, height: int, vae: Any) -> torch.Tensor:
        """The pipeline's output_type="latent" result (B, tokens, C*4) as (B, C, H, W) denoiser-space latents."""
        f = self.facts.vae_factor
        return unpack_latents(latents, height // f, width // f)


def tiny_text_encoder(tok, width: int):
    """Qwen-Image's tiny Qwen2.5-VL, its vision token ids those of `tok`."""
    ids = dict(zip(("vision_start", "vision_end", "image", "video"), tok.convert_tokens_to_ids(list(VISION))))
    names = {f"{k}_token_id": v for k, v in ids.items()}
    return tiny_qwen25vl(tok, width, max_positions=4096, token_ids=names)


def text_to_image(pipe: Any) -> Any:
    """QwenImagePipeline sharing the edit pipeline's modules, made once per pipeline object."""
    t2i = getattr(pipe, "_tuneline_text_to_image", None)
    if t2i is None:
        from diffusers import QwenImagePipeline

        t2i = QwenImagePipeline(
            scheduler=pipe.scheduler,
            vae=pipe.vae,
            text_encoder=pipe.text_encoder,
            tokenizer=pipe.tokenizer,
            transformer=pipe.transformer,
        )
        t2i.set_progress_bar_config(disable=True)
        pipe._tuneline_text_to_image = t2i
    return t2i


def trim_padding(kwargs: dict) -> dict:
    """QwenImagePipeline takes at most 1024 prompt tokens; rows longer than that (this family's max_length makes
    room for vision tokens) hold only masked padding past the text, which is cut."""
    if kwargs.get("max_sequence_length", 0) <= T2I_LIMIT:
        return kwargs
    out = dict(kwargs, max_sequence_length=T2I_LIMIT)
    for prefix in ("", "negative_"):
        mask = kwargs.get(f"{prefix}prompt_embeds_mask")
        if mask is None:
            continue
        if mask[:, T2I_LIMIT:].any():
            raise ValueError(f"a prompt takes more than {T2I_LIMIT} tokens, QwenImagePipeline's limit: shorten it")
        out[f"{prefix}prompt_embeds_mask"] = mask[:, :T2I_LIMIT]
        out[f"{prefix}prompt_embeds"] = kwargs[f"{prefix}prompt_embeds"][:, :T2I_LIMIT]
    return out
