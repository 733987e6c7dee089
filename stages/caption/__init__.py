"""Caption stage: captions from a local vision-language model, between scan and text, on when caption.model is set.

Its artifact, captions.jsonl, holds one row per image: the caption training sees (caption.trigger included), its
`source` (user | model) and the user's and the model's parts. With the stage on, text, train and validate list it as
an upstream (its fingerprint is in their keys) and take captions from it instead of the scan's records. The
dataset folder is never written. A model caption is reused from the previous version when the image's content, the
model (by content), the prompt and the decoding settings are the same, so an added image is the only one captioned.
"""

from __future__ import annotations

from pathlib import Path

from tuneline.schemas.caption import CaptionManifest
from tuneline.stages.common.codeident import code_version
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.stage import StageDef, built_by

CODE_VERSION = code_version("caption")  # stages/code_versions.json
CAPTIONS = "captions.jsonl"


def generation_settings(cfg) -> dict:
    """What decides a model caption besides the image and the model: reuse needs all of it equal."""
    c = cfg.caption
    return {"prompt": c.prompt, "decoding": c.decoding(), "image_size": c.image_size, "dtype": c.dtype}


def _config(cfg) -> dict:
    # The folder's path is not keyed (the model's content is, in the inputs); batch size and device only change
    # how fast captions come.
    c = cfg.caption
    return {
        "caption": {
            "policy": c.policy,
            "trigger": c.trigger,
            "tiny": c.model if c.model and c.model.startswith("tiny") else None,
            **generation_settings(cfg),
        },
        "dataset": {"empty_caption": cfg.dataset.empty_caption},
    }


def _inputs(ctx, upstream) -> dict:
    from tuneline.stages.caption.model import identity

    return {"caption_model": identity(ctx)}


def generation_key(model_identity: str, cfg) -> str:
    return digest({"model": model_identity, **generation_settings(cfg)})


def captions_by_ref(caption_dir: Path) -> dict[str, str]:
    """Image ref -> the caption training sees, from a caption artifact."""
    return {r["ref"]: r["caption"] for r in read_jsonl(Path(caption_dir) / CAPTIONS)}


def upstream_captions(ctx, upstream: dict) -> dict[str, str] | None:
    """Captions by image ref from the caption artifact among `upstream` manifests, or None when the stage is off."""
    m = upstream.get("caption")
    if m is None:
        return None
    return captions_by_ref(ctx.store.version_dir("caption", m.fingerprint))


STAGE = StageDef(
    name="caption",
    upstream=("scan",),
    code_version=CODE_VERSION,
    manifest_cls=CaptionManifest,
    config=_config,
    inputs=_inputs,
    build=built_by("tuneline.stages.caption.core"),
    enabled=lambda cfg: cfg.caption.enabled,
)
