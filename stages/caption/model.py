"""The captioning model: a local folder loaded through transformers' image-text-to-text API (AutoProcessor +
AutoModelForImageTextToText), identified by content, and batched generation on its device.

Nothing is downloaded: loading is `local_files_only`. A folder whose processor transformers cannot build without
torchvision (Qwen2-VL-style processors insist on a video processor) is loaded from its parts instead: the
tokenizer, the image processor and the chat template, in an image-only subclass of the same processor class.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuneline.stages.caption import tiny

IDENTITY_SUFFIXES = (".json", ".jinja", ".safetensors", ".bin", ".model", ".txt", ".tiktoken")


def model_folder(ctx) -> Path:
    """The configured model's folder; the tiny models are built once under <workdir>/models/."""

    def make() -> Path:
        m = ctx.cfg.caption.model
        if tiny.is_tiny(m):
            folder = tiny.tiny_dir(m, ctx.workdir / "models")
            if not (folder / "config.json").is_file():
                folder.parent.mkdir(parents=True, exist_ok=True)
                tiny.build(m, folder)
            return folder
        folder = Path(m).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"caption.model {folder}: not a model folder (no config.json); give the local "
                f"folder of a vision-language model transformers loads (e.g. a Qwen2.5-VL or "
                f"LLaVA download), or `tiny` for the test model"
            )
        return folder.resolve()

    return ctx.memo("caption:model_folder", make)


def identity(ctx) -> str:
    """Hash of the folder's configs, processor/tokenizer files and weights by name and content: the same model in
    another folder is the same identity; any changed file is another model."""
    from tuneline.stages.families.folders import hash_cache

    def make() -> str:
        folder = model_folder(ctx)
        files = sorted(
            f
            for f in folder.rglob("*")
            if f.is_file()
            and f.name.endswith(IDENTITY_SUFFIXES)
            and not any(p.startswith(".") for p in f.relative_to(folder).parts)
        )
        cache, h = hash_cache(), hashlib.sha256()
        for f in files:
            h.update(f"{f.relative_to(folder).as_posix()}\0{cache.sha256(f)}\0".encode())
        cache.save()
        return h.hexdigest()

    return ctx.memo("caption:identity", make)


@dataclass
class Captioner:
    processor: Any
    model: Any
    device: Any
    prompt_text: str  # the chat-templated prompt, one image placeholder included

    @property
    def architecture(self) -> str:
        return type(self.model).__name__

    def inputs(self, images: list) -> dict:
        """The processor's batch for these images (same prompt each), moved to the model's device and dtype."""
        batch = self.processor(images=images, text=[self.prompt_text] * len(images), return_tensors="pt", padding=True)
        dtype = next(self.model.parameters()).dtype
        return {k: (v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device)) for k, v in batch.items()}

    def generate(self, inputs: dict, decoding: dict, seed: int) -> list[str]:
        """Captions for one processed batch: the model's own generate, new tokens only, special tokens dropped."""
        import torch

        kwargs = {k: v for k, v in decoding.items() if k != "seed"}
        tok = self.processor.tokenizer
        with torch.inference_mode():
            if decoding.get("do_sample"):
                torch.manual_seed(seed)
            out = self.model.generate(**inputs, **kwargs, pad_token_id=tok.pad_token_id)
        new = out[:, inputs["input_ids"].shape[1] :]
        return [" ".join(t.split()) for t in self.processor.batch_decode(new, skip_special_tokens=True)]


def load(folder: Path, prompt: str, device: str, dtype: str) -> Captioner:
    import torch
    from transformers import AutoModelForImageTextToText

    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("caption.device is cuda but no CUDA device is visible: set caption.device to auto or cpu")
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        dtype, torch.bfloat16 if dev.type == "cuda" else torch.float32
    )
    processor = load_processor(folder)
    # Batches are padded on the left: generation continues every row from its last real token.
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=dt, local_files_only=True).to(dev).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return Captioner(processor=processor, model=model, device=dev, prompt_text=text)


def load_processor(folder: Path):
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(folder, local_files_only=True)
    except (AttributeError, ImportError, TypeError, ValueError) as err:
        return _image_only_processor(folder, err)


def _processor_class(folder: Path) -> str | None:
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        try:
            got = json.loads((folder / name).read_text(encoding="utf-8")).get("processor_class")
        except (OSError, ValueError):
            continue
        if got:
            return got
    return None


def _image_only_processor(folder: Path, err: Exception):
    """The folder's processor class without its video processor (which needs torchvision); images only."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    base = getattr(transformers, _processor_class(folder) or "", None)
    if base is None:
        raise err

    class ImageOnly(base):  # the attributes a processor checks and sets come from its __init__ signature
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    images = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    template = folder / "chat_template.jinja"
    chat = template.read_text(encoding="utf-8") if template.is_file() else getattr(tok, "chat_template", None)
    return ImageOnly(image_processor=images, tokenizer=tok, chat_template=chat)
