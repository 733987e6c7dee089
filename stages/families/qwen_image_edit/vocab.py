"""The tiny flavor's tokenizer and processor. The tokenizer is Qwen-Image's tiny one
(tuneline.stages.families.qwen_image.vocab) grown by the edit template's words and the vision specials: QwenImageEditPipeline drops the edit
template's first 64 tokens (prompt_template_encode_start_idx, counted with Qwen's tokenizer), the system prompt up to
the image; this tokenizer splits that prefix into exactly as many, and Qwen-Image's text-only template prefix into
its 34, which build_edit_tokenizer asserts.

The processor is transformers' Qwen2VLProcessor. Without torchvision transformers cannot build its video processor
(it is never used here: the pipeline passes images only), so a bare VideoProcessorMixin stands in for it."""

from __future__ import annotations

import re
from pathlib import Path

from tuneline.stages.families.qwen_image.vocab import DROP, TEMPLATE, byte_bpe_tokenizer
from tuneline.stages.families.vocab import WORDS

# QwenImageEditPipeline.prompt_template_encode and prompt_template_encode_start_idx.
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
EDIT_DROP = 64
VISION = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Pre-tokens Qwen's BPE keeps whole in the edit template (" (", "),", "'s"): the prefix then counts 64.
JOINED = (" (", "),", "'s")
# The tiny processor sees at most 112 x 112 pixels: 8 x 8 patches of 14, merged 2 x 2 into 16 image tokens.
TINY_PIXELS = (56 * 56, 112 * 112)


def build_edit_tokenizer(folder: Path, model_max_length: int):
    text = TEMPLATE + EDIT_TEMPLATE
    plain = re.sub(r"<\|[a-z_]+\|>", " ", text.replace("{}", ""))
    words = sorted(set(re.findall(r"[A-Za-z]+", plain)) | set(WORDS))
    words = [w for p in words for w in (p, " " + p)] + list(JOINED)
    tok = byte_bpe_tokenizer(folder, words, model_max_length, list(VISION))
    assert len(tok(TEMPLATE.split("{}")[0]).input_ids) == DROP, "Qwen-Image's template prefix must be 34 tokens"
    assert len(tok(EDIT_TEMPLATE.split(VISION[0])[0]).input_ids) == EDIT_DROP, "the edit prefix must be 64 tokens"
    tok.save_pretrained(str(folder))
    return tok


def _video_stand_in():
    """transformers' video processor base class, bound on the package as its torchvision build binds it."""
    import sys

    from transformers.utils import is_torchvision_available
    from transformers.video_processing_utils import VideoProcessorMixin

    if is_torchvision_available():
        from transformers import Qwen2VLVideoProcessor

        return Qwen2VLVideoProcessor()
    sys.modules["transformers"].VideoProcessorMixin = VideoProcessorMixin
    return VideoProcessorMixin()


def make_processor(tokenizer, image_processor):
    from transformers import Qwen2VLProcessor

    return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=_video_stand_in())


def tiny_processor(tokenizer):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    low, high = TINY_PIXELS
    return make_processor(tokenizer, Qwen2VLImageProcessorPil(min_pixels=low, max_pixels=high))


def load_processor(folder: Path):
    """The folder's Qwen2VLProcessor (its tokenizer and image processor; the video stand-in without torchvision)."""
    from transformers import AutoTokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return Qwen2VLProcessor.from_pretrained(folder)
    return make_processor(AutoTokenizer.from_pretrained(folder), Qwen2VLImageProcessorPil.from_pretrained(folder))
