"""Captions: `.txt` sidecars, HF-imagefolder `metadata.jsonl`, and the file-name fallback.

Precedence: a sidecar beats a metadata entry (it is the more specific of the two). Missing and empty captions
follow `dataset.empty_caption`. A caption that cannot be decoded rejects its image: training on mojibake is
worse than not training on the image, and the reason tells the user which file to re-save.
"""

from __future__ import annotations

import json
import posixpath
import re

from tuneline.schemas.scan import DatasetConfig, Rejected
from tuneline.stages.scan.listing import Listing

AUTO_FIELDS = ("text", "caption", "prompt")


class CaptionError(ValueError):
    """The image's caption is unusable; the message names the caption file and the fix."""


def normalize(text: str) -> str:
    return " ".join(text.split())


def filename_caption(rel: str) -> str:
    stem = posixpath.splitext(posixpath.basename(rel))[0]
    return normalize(re.sub(r"[_\-]+", " ", stem))


def _decode(raw: bytes, rel: str) -> str:
    try:
        return raw.decode("utf-8-sig")  # -sig: editors on Windows prepend a BOM
    except UnicodeDecodeError as err:
        raise CaptionError(
            f"caption file {rel} is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset "
            f"{err.start}): re-save it as UTF-8"
        ) from None


class Captions:
    def __init__(self, listing: Listing, cfg: DatasetConfig):
        self.listing = listing
        self.cfg = cfg
        self.problems: list[Rejected] = []
        self.metadata: dict[str, str] = {}
        self._answers: dict[str, tuple[str, str] | CaptionError] = {}
        for entry in sorted(listing.metadata, key=lambda e: e.rel):
            try:
                with open(entry.path, "rb") as f:
                    raw = f.read()
            except OSError as err:
                self._problem(entry.rel, f"cannot read it ({err.strerror}): check its permissions")
                continue
            self._load_metadata(entry.rel, raw)

    def _problem(self, rel: str, reason: str) -> None:
        self.problems.append(Rejected(path=rel, kind="metadata", reason=reason))

    def _load_metadata(self, rel: str, raw: bytes) -> None:
        try:
            text = _decode(raw, rel)
        except CaptionError as err:
            self._problem(rel, f"{err}; its captions were not used")
            return
        base = posixpath.dirname(rel)
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                self._metadata_line(rel, lineno, line, base)

    def _metadata_line(self, rel: str, lineno: int, line: str, base: str) -> None:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            self._problem(rel, f"line {lineno}: not valid JSON ({err.msg}): fix the line")
            return
        name = row.get("file_name") if isinstance(row, dict) else None
        fields = [self.cfg.metadata_caption_field] if self.cfg.metadata_caption_field else AUTO_FIELDS
        field = next((f for f in fields if isinstance(row, dict) and f in row), None)
        if not isinstance(name, str) or field is None or not isinstance(row[field], str):
            self._problem(
                rel,
                f"line {lineno}: needs a string `file_name` and a string caption field "
                f"({' or '.join(fields)}); set dataset.metadata_caption_field to yours",
            )
            return
        target = posixpath.normpath(posixpath.join(base, name))
        if target.startswith("../") or posixpath.isabs(name):
            self._problem(rel, f"line {lineno}: file_name {name!r} points outside the dataset: fix the line")
            return
        self.metadata[target] = row[field]

    def _sidecar(self, rel: str) -> str | None:
        stem = posixpath.splitext(rel)[0]
        bad = self.listing.bad_captions.get(stem)
        if bad is not None:
            raise CaptionError(f"caption file {stem}{self.cfg.caption_extension} cannot be used ({bad})")
        entry = self.listing.captions.get(stem)
        if entry is None:
            return None
        key = entry.rel
        try:
            with open(entry.path, "rb") as f:
                raw = f.read()
        except OSError as err:
            raise CaptionError(f"caption file {key} cannot be read ({err.strerror}): check its permissions") from None
        return _decode(raw, key)

    def caption_for(self, rel: str) -> tuple[str, str]:
        """(caption, source) for an image, or CaptionError naming what to fix.

        Remembered per image: with several buckets.resolutions every image is asked once per resolution, and
        its sidecar is read once.
        """
        got = self._answers.get(rel)
        if got is None:
            try:
                got = self._caption_for(rel)
            except CaptionError as err:
                got = err
            self._answers[rel] = got
        if isinstance(got, CaptionError):
            raise got
        return got

    def _caption_for(self, rel: str) -> tuple[str, str]:
        text, source = self._sidecar(rel), "sidecar"
        if text is None:
            text, source = self.metadata.get(rel), "metadata"
        text = normalize(text or "")
        if text:
            return text, source
        if self.cfg.empty_caption == "filename":
            return filename_caption(rel), "filename"
        if self.cfg.empty_caption == "reject":
            stem = posixpath.splitext(rel)[0]
            raise CaptionError(
                f"no caption: {stem}{self.cfg.caption_extension} and {self.cfg.metadata_file} give "
                f"none (or an empty one); add a caption, or set dataset.empty_caption to keep or "
                f"filename"
            )
        return "", "none"
