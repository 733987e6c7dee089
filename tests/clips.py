"""Real tiny video files for tests, written with PyAV: frame i is a flat gray of level 6 * i (up to 42 frames), so a decoded frame
tells which source frame it was."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CODECS = {".mp4": "libx264", ".mov": "libx264", ".mkv": "libx264", ".webm": "libvpx-vp9"}


def write_clip(path: Path, frames: int, fps: int, size: tuple[int, int] = (32, 16), rotation: int = 0) -> Path:
    """A `frames`-frame clip of `size` (width, height) at `fps`, its display matrix rotated by `rotation` degrees
    counter-clockwise."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(CODECS[path.suffix], rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        if rotation:
            stream.set_display_rotation(rotation)
        for i in range(frames):
            pixels = np.full((size[1], size[0], 3), 6 * i, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_gif(path: Path, frames: int, ms: int, size: tuple[int, int] = (32, 16)) -> Path:
    """An animated GIF of `frames` frames shown `ms` milliseconds each."""
    from PIL import Image

    images = [Image.new("RGB", size, (6 * i,) * 3) for i in range(frames)]
    images[0].save(path, save_all=True, append_images=images[1:], duration=ms, loop=0)
    return path
