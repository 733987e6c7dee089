"""Reading images: the scan's header probe and `load_rgb`, the one way later stages decode an image.

The probe reads a file's bytes once (for the content hash) and parses only the header: size, mode, EXIF
orientation. `load_rgb` decodes and applies exactly the orientation and mode conversion the scan recorded,
so the latents stage sees the image the scan measured.
"""
from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from schemas.scan import ImageRecord

ALLOWED_FORMATS = {"JPEG", "MPO", "PNG", "WEBP", "BMP", "DIB", "TIFF", "GIF"}
SIXTEEN_BIT_GRAY = {"I;16", "I;16B", "I;16L", "I;16N", "I"}
# EXIF orientation -> the transpose that shows the image upright (as ImageOps.exif_transpose does).
TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
             5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
             8: Image.Transpose.ROTATE_90}
# End markers whose absence means the file was cut short (an interrupted copy); searched near the end
# because some writers append padding or trailers after them.
END_MARKERS = {"JPEG": b"\xff\xd9", "MPO": b"\xff\xd9", "PNG": b"IEND"}
TAIL = 4096


class UnsupportedMode(ValueError):
    pass


@dataclass(frozen=True)
class Probe:
    """Header facts of one file. They depend on its bytes only, so a rescan reuses them while size+mtime match."""

    path: str
    size_bytes: int
    mtime_ns: int
    sha256: str = ""
    format: str = ""
    mode: str = ""
    width: int = 0  # after EXIF orientation
    height: int = 0
    orientation: int = 1
    conversion: str = ""
    transparent: bool = False
    error: str = ""  # rejection reason; empty when readable
    kind: str = ""

    def as_json(self) -> dict:
        return asdict(self)


def header_orientation(im: Image.Image) -> int:
    """EXIF orientation from what the header parse already read (never decodes pixels)."""
    if im.format == "PNG" and "exif" not in im.info:
        return 1  # PIL would decode the whole PNG looking for a late eXIf chunk
    value = im.getexif().get(0x0112, 1)
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _bit_depth16(im: Image.Image) -> bool:
    rawmode = im.tile[0].args if im.tile else None
    rawmode = rawmode[0] if isinstance(rawmode, tuple) else rawmode
    return isinstance(rawmode, str) and ";16" in rawmode


def conversion_of(im: Image.Image) -> tuple[str, bool]:
    """(how this mode becomes RGB, whether transparent pixels are composited). Raises UnsupportedMode."""
    mode = im.mode
    if mode == "F" or mode.startswith("I;32") or mode in ("I;16S", "I;16BS"):
        raise UnsupportedMode(f"pixel mode {mode} (float or signed samples) is not supported: convert the image "
                         f"to 8- or 16-bit RGB or grayscale")
    if im.has_transparency_data:
        return f"{mode}->RGB over background", True
    if mode in SIXTEEN_BIT_GRAY:
        return "16-bit gray->8-bit RGB (value/257)", False
    if mode == "RGB":
        return ("16-bit RGB->8-bit RGB" if _bit_depth16(im) else ""), False
    if mode == "CMYK":
        return "CMYK->RGB (no ICC profile)", False
    return f"{mode}->RGB", False


def to_rgb(im: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """The conversion `conversion_of` describes (this is where pixels are decoded)."""
    if im.mode in SIXTEEN_BIT_GRAY:
        # PIL's own I;16 -> L clips at 255 (almost everything turns white); scale the 16-bit range instead.
        arr = np.asarray(im, dtype=np.float64) / 257.0
        return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8)).convert("RGB")
    if im.has_transparency_data:
        rgba = im.convert("RGBA")
        base = Image.new("RGB", im.size, tuple(background))
        base.paste(rgba, mask=rgba.getchannel("A"))
        return base
    return im if im.mode == "RGB" else im.convert("RGB")


def _open(data: bytes) -> Image.Image:
    with warnings.catch_warnings():
        # Our own pixel limit (dataset.max_image_pixels) decides; PIL still raises beyond its hard limit.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return Image.open(io.BytesIO(data))


def _header(base: Probe, data: bytes) -> Probe:
    im = _open(data)
    if im.format not in ALLOWED_FORMATS:
        return _fail(base, "unsupported", f"{im.format} files are not supported: convert it to PNG or JPEG")
    marker = END_MARKERS.get(im.format)
    if marker and marker not in data[-TAIL:]:
        return _fail(base, "truncated", f"truncated {im.format} (its end marker is missing, e.g. an interrupted "
                                        f"copy): re-copy or re-export the file")
    orientation = header_orientation(im)
    w, h = im.size
    if orientation >= 5:  # 5-8 swap the axes
        w, h = h, w
    note, transparent = conversion_of(im)
    return Probe(**{**asdict(base), "format": im.format, "mode": im.mode, "width": w, "height": h,
                    "orientation": orientation, "conversion": note, "transparent": transparent})


def _fail(base: Probe, kind: str, reason: str) -> Probe:
    return Probe(**{**asdict(base), "error": reason, "kind": kind})


def probe_file(path: Path, rel: str, size_bytes: int, mtime_ns: int) -> Probe:
    """Read one file once: content hash + header facts, or the reason it cannot be used."""
    base = Probe(rel, size_bytes, mtime_ns)
    try:
        data = path.read_bytes()
    except OSError as err:
        return _fail(base, "unreadable", f"cannot read the file ({err.strerror or err}): check its permissions")
    if not data:
        return _fail(base, "empty-file", "zero-byte file (an interrupted copy?): re-copy or remove it")
    base = Probe(rel, len(data), mtime_ns, sha256=hashlib.sha256(data).hexdigest())
    try:
        return _header(base, data)
    except Image.DecompressionBombError as err:
        return _fail(base, "bomb", f"decompression-bomb guard: {err}")
    except UnidentifiedImageError:
        return _fail(base, "not-image", "not an image (content matches no supported format): remove or re-export it")
    except UnsupportedMode as err:
        return _fail(base, "mode", str(err))
    except (OSError, SyntaxError, EOFError, IndexError, KeyError, ValueError) as err:  # PIL's header parsers raise these
        return _fail(base, "unreadable", f"unreadable image header ({type(err).__name__}: {err}): re-export it")


def load_rgb(path: Path, record: ImageRecord | None = None, *,
             background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """Decode an image as RGB exactly as the scan measured it: EXIF orientation, mode conversion, first frame.

    With a record, its orientation and background are used and its size is checked, so a file replaced since
    the scan is an error naming it rather than a silently different crop.
    """
    with Image.open(path) as im:
        orientation = record.orientation if record else header_orientation(im)
        bg = record.background if record and record.background else background
        rgb = to_rgb(im, bg)
        if rgb is im:  # closing `im` would free the pixels we return
            rgb = im.copy()
    if orientation in TRANSPOSE:
        rgb = rgb.transpose(TRANSPOSE[orientation])
    if record and rgb.size != (record.width, record.height):
        raise ValueError(f"image {record.path} is {rgb.size[0]}x{rgb.size[1]} but the scan recorded "
                         f"{record.width}x{record.height}: the file changed since the scan; run `tuneline stage scan`")
    return rgb
