"""Clips: the scan's header probe of video files, their cutting into bucketed clips, and `load_clip`, the one way
later stages decode a clip's frames.

A video family (FamilyFacts.temporal_factor > 0) trains on video files and animated GIF/WebP as clips and on still
images as one-frame clips; an image family rejects video files with a reason and reads an animated GIF/WebP as its
first frame. The probe reads the container's headers only (PyAV); frame rate and count never need the pixels.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

from PIL import Image

from tuneline.schemas.config import PipelineConfig
from tuneline.schemas.families import facts, family_list
from tuneline.schemas.scan import VIDEO_EXTENSIONS, ImageRecord, Rejected
from tuneline.stages.common.sizing import FramePolicy, clip_ranges, frame_indices
from tuneline.stages.scan import images
from tuneline.stages.scan.images import TRANSPOSE, Probe
from tuneline.stages.scan.listing import Entry

ANIMATED = ("GIF", "WEBP")
VIDEO_FAMILIES = family_list(lambda f: f.video)
# A display matrix's counter-clockwise rotation (PyAV's convention) -> the EXIF orientation that shows the frames
# upright, so a clip's frames are turned by the same table as an image's.
ROTATION_ORIENTATION = {0: 1, 90: 8, 180: 3, 270: 6}


def is_video(rel: str) -> bool:
    return os.path.splitext(rel)[1].lower() in VIDEO_EXTENSIONS


def image_family_refusal(family: str) -> str:
    return (
        f"a video file, and model.family {family!r} trains on images: move it out of the dataset, or train a video "
        f"family (model.family {VIDEO_FAMILIES})"
    )


def probe(e: Entry, family: str) -> Probe:
    """The probe of a listed file: a video's container headers, an image's header (with its frame count and rate
    when it is an animated GIF/WebP). An image family refuses a video by its name: hashing and parsing a large clip
    only to refuse it would cost the scan minutes."""
    if is_video(e.rel):
        if not facts(family).video:
            return Probe(e.rel, e.size, e.mtime_ns, error=image_family_refusal(family), kind="video")
        return probe_video(e.path, e.rel, e.size, e.mtime_ns)
    p = images.probe_file(e.path, e.rel, e.size, e.mtime_ns)
    return _animation(p, e.path) if p.format in ANIMATED and not p.error else p


def _animation(p: Probe, path: str) -> Probe:
    """Frame count and mean rate of an animated GIF/WebP from its frame headers (seeking parses, never decodes)."""
    try:
        with Image.open(path) as im:
            frames = getattr(im, "n_frames", 1)
            if frames < 2:
                return p
            total_ms = 0.0
            for i in range(frames):
                im.seek(i)
                total_ms += im.info.get("duration") or 100  # browsers show a frame without a delay for 100 ms
    except (OSError, EOFError, ValueError) as err:
        return replace(p, error=f"unreadable animation ({type(err).__name__}: {err}): re-export it", kind="unreadable")
    return replace(p, frames=frames, fps=round(frames * 1000 / total_ms, 6))


def probe_video(path: str | Path, rel: str, size_bytes: int, mtime_ns: int) -> Probe:
    """Content hash + size, frame count, frame rate and rotation of a video file, or the reason it cannot be
    used."""
    import av  # here: a scan of images never pays for PyAV's import

    base = Probe(rel, size_bytes, mtime_ns)
    try:
        with open(path, "rb") as f:
            sha = hashlib.file_digest(f, "sha256").hexdigest()
        base = replace(base, sha256=sha, size_bytes=os.path.getsize(path))
        if base.size_bytes == 0:
            return replace(base, error="zero-byte file (an interrupted copy?): re-copy or remove it", kind="empty-file")
        with av.open(str(path)) as container:
            return _stream_facts(base, container)
    except (OSError, av.FFmpegError) as err:  # a corrupt container: InvalidDataError, EOF, a decoder's error
        return replace(
            base,
            error=f"unreadable video ({type(err).__name__}: {err}): re-encode it (e.g. H.264 in .mp4) or remove it",
            kind="unreadable",
        )


def _stream_facts(base: Probe, container) -> Probe:
    if not container.streams.video:
        return replace(base, error="no video stream (audio only?): remove it from the dataset", kind="not-video")
    stream = container.streams.video[0]
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    frames = stream.frames  # MP4/MOV index every frame; Matroska/WebM give the duration only
    if not frames and fps:
        seconds = container.duration / 1_000_000 if container.duration else 0.0
        frames = round(seconds * fps)
    if not frames or not fps or not stream.width:
        return replace(
            base,
            error=f"the {stream.codec_context.name} stream's header gives no frame count, rate or size: "
            f"re-encode it (e.g. H.264 in .mp4)",
            kind="unreadable",
        )
    orientation = ROTATION_ORIENTATION.get(_rotation(container, stream) % 360, 1)
    w, h = stream.width, stream.height
    if orientation >= 5:
        w, h = h, w
    return replace(
        base,
        format=f"{container.format.name.split(',')[0].upper()}/{stream.codec_context.name}",
        mode="RGB",
        width=w,
        height=h,
        orientation=orientation,
        frames=frames,
        fps=round(fps, 6),
    )


def _rotation(container, stream) -> int:
    """The display matrix's rotation. PyAV 18 exposes it on decoded frames only, so the first frame is decoded:
    one frame, where the hash already read the whole file."""
    for frame in container.decode(stream):
        return round(frame.rotation / 90) * 90
    return 0


def frame_policy(cfg: PipelineConfig) -> FramePolicy:
    """The bucketing of a video family's clips: buckets.fps, buckets.frames, buckets.clip over the family's defaults
    (the config check holds buckets.frames to the family's frame rule: schemas/checks.py)."""
    f = facts(cfg.model.family)
    budgets = tuple(sorted(cfg.buckets.frames or f.frame_buckets))
    return FramePolicy(fps=cfg.buckets.fps or f.fps, budgets=budgets, factor=f.temporal_factor, clip=cfg.buckets.clip)


def clips(record: ImageRecord, p: Probe, cfg: PipelineConfig) -> list[ImageRecord] | Rejected:
    """A scan record as the family trains it: unchanged for an image family (which rejects video files); for a
    video family one record per clip cut from the file (an image: one frame)."""
    if not facts(cfg.model.family).video:
        if is_video(p.path):
            return Rejected(path=p.path, kind="video", reason=image_family_refusal(cfg.model.family))
        return [record]
    if p.frames < 2:
        return [record.model_copy(update={"frames": 1})]
    policy = frame_policy(cfg)
    return [
        record.model_copy(
            update={
                "frames": frames,
                "fps": policy.fps,
                "start": start,
                "end": end,
                "source_frames": p.frames,
                "source_fps": p.fps,
            }
        )
        for frames, start, end in clip_ranges(p.frames, p.fps, policy)
    ]


class ClipChanged(ValueError):
    """The clip's file no longer holds what the scan measured: the fix is a new scan, not a re-export."""


def load_clip(path: Path, record: ImageRecord) -> list[Image.Image]:
    """The clip's frames as RGB images, upright, exactly as the scan measured them: `record.frames` frames from
    `record.start` at `record.fps` (an image or a one-frame record: its first frame)."""
    if record.start is None:
        return [images.load_rgb(path, record)]
    wanted = frame_indices(record.start, record.frames, record.fps, record.source_fps, record.source_frames)
    got = _decode(path, set(wanted), record)
    if missing := sorted(set(wanted) - set(got)):
        raise ClipChanged(
            f"clip {record.ref}: frames {missing[:5]} of {record.source_frames} are missing from the file: it "
            f"changed since the scan, or its header overstates its length; run `tuneline stage scan`"
        )
    frames = [got[i] for i in wanted]
    if frames[0].size != (record.width, record.height):
        raise ClipChanged(
            f"clip {record.ref} is {frames[0].size[0]}x{frames[0].size[1]} but the scan recorded "
            f"{record.width}x{record.height}: the file changed since the scan; run `tuneline stage scan`"
        )
    return frames


def _decode(path: Path, wanted: set[int], record: ImageRecord) -> dict[int, Image.Image]:
    """Frames by index in the file, decoded in order up to the last one wanted."""
    last, out = max(wanted), {}
    if is_video(record.path):
        import av

        with av.open(str(path)) as container:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i in wanted:
                    out[i] = _upright(frame.to_image(), record.orientation)
                if i >= last:
                    break
        return out
    with Image.open(path) as im:  # an animated GIF/WebP
        for i in range(min(last + 1, getattr(im, "n_frames", 1))):
            im.seek(i)
            if i in wanted:
                out[i] = im.convert("RGB")
    return out


def _upright(im: Image.Image, orientation: int) -> Image.Image:
    return im.transpose(TRANSPOSE[orientation]) if orientation in TRANSPOSE else im
