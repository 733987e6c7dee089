"""Qwen-Image-Edit Plus (2509): Qwen-Image-Edit conditioned on one or several input images, as diffusers'
QwenImageEditPlusPipeline conditions it:
- the text encoder sees every input image: the same edit system prompt, the user turn opening with
  "Picture i: <vision tokens>" per image before the instruction, each image resized to about 384 x 384 pixels at its
  own aspect ratio (CONDITION_IMAGE_SIZE), the template's first 64 tokens dropped;
- each input image's latents are packed 2x2 into tokens and appended after the target's, one img_shapes entry each
  (QwenImageEditFamily.denoise with (B, N, C, h, w) control latents); the loss is on the target's tokens. The
  pipeline VAE-encodes each at about 1024 x 1024 pixels at its own aspect ratio (VAE_IMAGE_SIZE, the edit pipeline's
  area); the latents stage caches every reference at that size for the target's aspect ratio (QwenImageEditFamily's
  control_size), since a training batch stacks
  them: references of another aspect ratio than their target are stretched to it, as they are for every family.

Several references per target come from `<control>/<stem>/*.png` folders (multiple_references), one control file
works alike. The text stage caches rows per (instruction, control images): the record's control_sha256 covers every
reference. The pipeline shares one image list across a call's prompts (and takes one prompt per call), so the
renderer renders each edit in a call of its own (one_control_per_call).
"""

from __future__ import annotations

from typing import Any, ClassVar

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import TextEncoders
from tuneline.stages.families.qwen_image_edit.adapter import QwenImageEditFamily
from tuneline.stages.families.qwen_image_edit.vocab import EDIT_TEMPLATE

# QwenImageEditPlusPipeline: its prompt_template_encode (the edit template with the user turn left open) and the
# vision block it puts there per input image (_get_qwen_prompt_embeds).
PLUS_TEMPLATE = EDIT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>{}", "{}")
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"


def condition_image(image, area: int | None = None):
    """An input image as QwenImageEditPlusPipeline hands it to the text encoder: resized by its image processor to
    calculate_dimensions(CONDITION_IMAGE_SIZE, width / height), or to `area` pixels where the run sets one (the
    edit family's inputs.py: then the VAE's input too)."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE

    from tuneline.stages.families.qwen_image_edit.inputs import scaled_size

    width, height = scaled_size(area or CONDITION_IMAGE_SIZE, image.width, image.height)
    return VaeImageProcessor(vae_scale_factor=16).resize(image.convert("RGB"), height, width)


def as_list(images: Any) -> list:
    return list(images) if isinstance(images, (list, tuple)) else [images]


class QwenImageEditPlusFamily(QwenImageEditFamily):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["qwen_image_edit_plus"]
    multiple_references: ClassVar[bool] = True  # several per image: <control>/<stem>/*.png (stages/scan/controls.py)
    one_control_per_call: ClassVar[bool] = True

    def edit_inputs(
        self, captions: list[str], images: list[Any], area: int | None = None
    ) -> tuple[list[str], list[Any]]:
        """Per caption, its control image or list of references: the Plus template with one "Picture i" vision
        block per image, and those images at the condition size (the processor takes them flat, in order)."""
        texts, pictures = [], []
        for caption, refs in zip(captions, images):
            refs = as_list(refs)
            texts.append(PLUS_TEMPLATE.format("".join(PICTURE.format(i + 1) for i in range(len(refs))) + caption))
            pictures += [condition_image(im, area) for im in refs]
        return texts, pictures

    def control_kwargs(self, images: list[Any] | None, width: int, height: int) -> dict[str, Any]:
        """One sample's input images as the pipeline's `image` list (it resizes them itself)."""
        if images is None:
            return {}
        if len(images) != 1:
            raise ValueError(f"family {self.facts.name!r} renders one sample's references per call, got {len(images)}")
        return {"image": as_list(images[0])}

    def edit_call(self, pipe: Any, enc: TextEncoders, kwargs: dict, prompts: list[str], negatives: list[str]):
        """QwenImageEditFamily.edit_call for the call's one sample: its prompt (and negative) encoded with all of its
        input images, which the pipeline takes as one list."""
        images = kwargs.get("image")
        if images is None:
            return super().edit_call(pipe, enc, kwargs, prompts, negatives)
        pipe, kwargs = super().edit_call(pipe, enc, {**kwargs, "image": [images]}, prompts, negatives)
        return pipe, {**kwargs, "image": images}
