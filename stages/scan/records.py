"""One probed file to its training record (size, bucket, crop, caption) or the reason it is rejected."""

from __future__ import annotations

from tuneline.schemas.config import PipelineConfig
from tuneline.schemas.scan import ImageRecord, Rejected
from tuneline.stages.common.sizing import SizePolicy, bucket_size, crop_box, size_problem
from tuneline.stages.scan import images
from tuneline.stages.scan.captions import CaptionError, Captions


def make_record(
    probe: images.Probe, captions: Captions, policy: SizePolicy, cfg: PipelineConfig
) -> ImageRecord | Rejected:
    def reject(kind: str, reason: str) -> Rejected:
        return Rejected(path=probe.path, kind=kind, reason=reason)

    if probe.error:
        return reject(probe.kind, probe.error)
    w, h, limit = probe.width, probe.height, cfg.dataset.max_image_pixels
    if w * h > limit:
        return reject(
            "bomb",
            f"decompression-bomb guard: {w}x{h} = {w * h} pixels exceeds "
            f"dataset.max_image_pixels ({limit}); raise the limit if the image is genuine",
        )
    problem = size_problem(w, h, policy)
    if problem:
        return reject("too-small", problem)
    try:
        caption, source = captions.caption_for(probe.path)
    except CaptionError as err:
        return reject("caption", str(err))
    bw, bh = bucket_size(w, h, policy)
    return ImageRecord(
        **probe.record_facts(cfg.dataset.background),
        bucket_width=bw,
        bucket_height=bh,
        crop=crop_box(w, h, bw, bh, cfg.buckets.crop, cfg.buckets.seed, key=probe.path),
        caption=caption,
        caption_source=source,
    )
