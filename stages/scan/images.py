"""Reading images: the scan's header probe and `load_rgb`, the one way later stages decode an image.

The probe reads a file's bytes once, hashes them and parses only the header from the same bytes: size, mode,
EXIF orientation. `load_rgb` decodes and applies exactly the orientation and mode conversion the scan recorded,
so the latents stage sees the image the scan measured.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, replace
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from tuneline.schemas.scan import ImageRecord

# Only these parsers ever see a dataset's bytes: fewer exotic decoders exposed to arbitrary files.
FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "TIFF", "GIF")  # JPEG also opens MPO (camera JPEGs)
SIXTEEN_BIT_GRAY = {"I;16", "I;16B", "I;16L", "I;16N", "I"}
# EXIF orientation -> the transpose that shows the image upright (as ImageOps.exif_transpose does).
TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# End markers whose absence means the file was cut short (an interrupted copy); looked for near the end first.
# Some files carry data after them (a phone's Motion Photo appends an MP4 to its JPEG, editors append blocks after
# a PNG's IEND): when the tail lacks the marker, it is looked for where the format puts it and the image is
# decoded; accepted with its trailer when both succeed.
END_MARKERS = {"JPEG": b"\xff\xd9", "MPO": b"\xff\xd9", "PNG": b"IEND"}
TAIL = 4096
# Files up to this size are read whole and hashed and parsed from memory (a few threads hold one each);
# larger ones stream through STREAM_BUFFER.
WHOLE = 64 << 20
STREAM_BUFFER = 1 << 20
# File signatures, to tell a corrupt image (PIL says only "cannot identify") from a file that is no image.
MAGIC = (
    (b"\x89PNG", "PNG"),
    (b"\xff\xd8", "JPEG"),
    (b"GIF8", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"RIFF", "WebP"),
)


class UnsupportedMode(ValueError):
    """A pixel layout with no faithful RGB conversion (float, signed or 32-bit samples)."""


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
    trailer: int = 0  # bytes after the end marker
    error: str = ""  # rejection reason; empty when readable
    kind: str = ""
    frames: int = 1  # a video's or an animated GIF/WebP's frame count (stages/scan/video.py)
    fps: float = 0.0  # their frame rate; 0 for a still image

    def as_json(self) -> dict:
        return dict(self.__dict__)  # dataclasses.asdict deep-copies: a tenth of a cold scan's time

    def record_facts(self, background: tuple[int, int, int]) -> dict:
        """The file's facts as its training record carries them (schemas/scan.py ImageRecord); `background`:
        dataset.background, which a transparent image is flattened over."""
        return {
            "path": self.path,
            "width": self.width,
            "height": self.height,
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "mtime_ns": self.mtime_ns,
            "format": self.format,
            "mode": self.mode,
            "orientation": self.orientation,
            "conversion": self.conversion,
            "trailer": self.trailer,
            "background": background if self.transparent else None,
        }


def header_orientation(im: Image.Image) -> int:
    """EXIF orientation from what the header parse already read (never decodes pixels)."""
    if im.format == "PNG" and "exif" not in im.info:
        return 1  # PIL would decode the whole PNG looking for a late eXIf chunk
    try:
        value = im.getexif().get(0x0112, 1)
    except (OSError, SyntaxError, ValueError, KeyError, IndexError, TypeError):
        return 1  # a mangled EXIF block (common from phone editors) must not cost a good image
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _bit_depth16(im: Image.Image) -> bool:
    rawmode = im.tile[0].args if im.tile else None
    rawmode = rawmode[0] if isinstance(rawmode, tuple) else rawmode
    return isinstance(rawmode, str) and ";16" in rawmode


def conversion_of(im: Image.Image) -> tuple[str, bool]:
    """(how this mode becomes RGB, whether transparent pixels are composited). Raises UnsupportedMode."""
    mode = im.mode
    if mode == "F" or mode.startswith("I;32") or mode in ("I;16S", "I;16BS"):
        raise UnsupportedMode(
            f"pixel mode {mode} (float or signed samples) is not supported: convert the "
            f"image to 8- or 16-bit RGB or grayscale"
        )
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
        import numpy as np  # here, not at the top: a scan process never converts pixels and saves numpy's import

        # PIL's own I;16 -> L clips at 255 (almost everything turns white); scale the 16-bit range instead.
        arr = np.asarray(im, dtype=np.float64) / 257.0
        return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8)).convert("RGB")
    if im.has_transparency_data:
        rgba = im.convert("RGBA")
        base = Image.new("RGB", im.size, tuple(background))
        base.paste(rgba, mask=rgba.getchannel("A"))
        return base
    return im if im.mode == "RGB" else im.convert("RGB")


def _header(base: Probe, f, tail: bytes) -> Probe:
    """Header facts from a file object at offset 0; `tail` is the file's last TAIL bytes."""
    im = Image.open(f, formats=FORMATS)  # PIL refuses bombs beyond twice its limit; our limit is applied later
    marker = END_MARKERS.get(im.format)
    trailer = 0
    if marker and marker not in tail:
        trailer = _trailer(im, f, base.size_bytes)
        if trailer < 0:
            return _fail(
                base,
                "truncated",
                f"truncated {im.format} (its end marker is missing or its pixel data "
                f"does not decode, e.g. an interrupted copy): re-copy or re-export it",
            )
    orientation = header_orientation(im)
    w, h = im.size
    if orientation >= 5:  # 5-8 swap the axes
        w, h = h, w
    note, transparent = conversion_of(im)
    return replace(
        base,
        format=im.format,
        mode=im.mode,
        width=w,
        height=h,
        orientation=orientation,
        conversion=note,
        transparent=transparent,
        trailer=trailer,
    )


def _trailer(im: Image.Image, f, size: int) -> int:
    """Bytes after the image's end when its end marker is not in the tail, or -1 for a truncated file: the
    marker must be where the format's structure puts it and the pixels must decode (a decoder alone forgives a
    cut checksum or a missing end marker)."""
    f.seek(0)
    data = f.read()
    f.seek(0)
    end = image_end(data, im.format)
    if not end:
        return -1
    try:
        im.load()  # the one full decode a scan does, and only for files like these
    except (OSError, SyntaxError, EOFError, ValueError, IndexError):
        return -1
    return size - end


def image_end(data: bytes, fmt: str) -> int:
    """Offset just past the image's own data: PNG's IEND chunk (walking the chunks), or the JPEG EOI marker that
    ends its entropy-coded data (markers walked by their lengths, so an embedded EXIF thumbnail's EOI is skipped;
    inside scan data 0xFF is always followed by 0x00 or a restart marker). 0 when not found."""
    if fmt == "PNG":
        pos = 8
        while pos + 8 <= len(data):
            length = int.from_bytes(data[pos : pos + 4], "big")
            kind, pos = data[pos + 4 : pos + 8], pos + 12 + length
            if kind == b"IEND":
                return pos if pos <= len(data) else 0
        return 0
    if fmt not in ("JPEG", "MPO"):
        return 0
    pos = 2
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xDA:  # start of scan: the EOI is the first FFD9 after it
            eoi = data.find(b"\xff\xd9", pos)
            return eoi + 2 if eoi >= 0 else 0
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return 0


def _fail(base: Probe, kind: str, reason: str) -> Probe:
    return replace(base, error=reason, kind=kind)


def _unidentified(base: Probe, head: bytes) -> Probe:
    fmt = next((name for magic, name in MAGIC if head.startswith(magic)), None)
    if fmt:
        return _fail(
            base,
            "unreadable",
            f"corrupt {fmt} header (the file starts like a {fmt} but cannot be parsed): re-export or remove it",
        )
    return _fail(
        base,
        "not-image",
        "not an image: its content matches none of JPEG, PNG, WebP, BMP, TIFF, GIF; "
        "remove it or re-export it in one of them",
    )


def _read(f, size_hint: int) -> tuple[str, int, io.BytesIO | None, bytes]:
    """(SHA-256, size, the bytes as a file object or None, the last TAIL bytes) of an open file.

    A file up to WHOLE bytes is read in one call and both hashed and parsed from memory: one pass over the
    bytes, no second read for the header or the tail. A larger one streams through a buffer (a 500 MB TIFF
    costs no 500 MB of memory) and the header is read from the file again.
    """
    if size_hint <= WHOLE:  # the listing's size; a file grown since is still read whole, up to its end
        data = f.read()  # readall: loops until end of file, so a short read (network filesystems) loses nothing
        return hashlib.sha256(data).hexdigest(), len(data), io.BytesIO(data), data[-TAIL:]
    sha = hashlib.sha256()
    buf = bytearray(STREAM_BUFFER)
    view = memoryview(buf)
    size = 0
    while n := f.readinto(buf):
        sha.update(view[:n])  # releases the GIL: other threads parse headers meanwhile
        size += n
    f.seek(max(0, size - TAIL))
    tail = f.read()
    f.seek(0)
    return sha.hexdigest(), size, None, tail


def probe_file(path: str | Path, rel: str, size_bytes: int, mtime_ns: int) -> Probe:
    """Read one file once: content hash + header facts, or the reason it cannot be used."""
    try:
        f = open(path, "rb", buffering=0)  # unbuffered: a whole-file read goes straight into its bytes object
    except OSError as err:
        return _fail(
            Probe(rel, size_bytes, mtime_ns),
            "unreadable",
            f"cannot read the file ({err.strerror or err}): check its permissions",
        )
    with f:
        try:
            sha, size, memory, tail = _read(f, size_bytes)
        except OSError as err:
            return _fail(
                Probe(rel, size_bytes, mtime_ns),
                "unreadable",
                f"cannot read the file ({err.strerror or err}): a disk or network error",
            )
        # The streamed case parses through a buffered reader: PIL reads headers in many small pieces.
        return _parse(
            Probe(rel, size, mtime_ns, sha256=sha), memory if memory is not None else io.BufferedReader(f), tail
        )


def probe_bytes(data: bytes, rel: str) -> Probe:
    """`probe_file` for an image held in memory (a member of a webdataset shard, a parquet cell)."""
    return _parse(Probe(rel, len(data), 0, sha256=hashlib.sha256(data).hexdigest()), io.BytesIO(data), data[-TAIL:])


def _parse(base: Probe, source, tail: bytes) -> Probe:
    """Header facts of hashed bytes, or the reason they are no usable image."""
    if base.size_bytes == 0:
        return _fail(base, "empty-file", "zero-byte file (an interrupted copy?): re-copy or remove it")
    try:
        return _header(base, source, tail)
    except Image.DecompressionBombError as err:
        return _fail(base, "bomb", f"decompression-bomb guard: {err}")
    except UnidentifiedImageError:
        source.seek(0)
        return _unidentified(base, source.read(12))
    except UnsupportedMode as err:
        return _fail(base, "mode", str(err))
    except (OSError, SyntaxError, EOFError, IndexError, KeyError, ValueError) as err:  # PIL's parsers raise these
        return _fail(base, "unreadable", f"unreadable image header ({type(err).__name__}: {err}): re-export it")


def load_rgb(
    path: Path | io.BytesIO, record: ImageRecord | None = None, *, background: tuple[int, int, int] = (255, 255, 255)
) -> Image.Image:
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
        raise ValueError(
            f"image {record.path} is {rgb.size[0]}x{rgb.size[1]} but the scan recorded "
            f"{record.width}x{record.height}: the file changed since the scan; run `tuneline stage scan`"
        )
    return rgb
