"""A clip written as an MP4 file: the validation clips and the video demo's training clips alike."""

from __future__ import annotations

from pathlib import Path

from PIL import Image


def write_mp4(frames: list[Image.Image], path: Path, fps: float) -> None:
    """H.264 in yuv420p (what browsers and players decode), which needs even sizes: odd edges lose a pixel."""
    import av
    import numpy as np

    w, h = frames[0].width // 2 * 2, frames[0].height // 2 * 2
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=round(fps))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for f in frames:
            pixels = np.asarray(f.convert("RGB"))[:h, :w]
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")))
        out.mux(stream.encode())
