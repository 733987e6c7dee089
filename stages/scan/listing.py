"""Walk a dataset folder without opening any file: what `inputs()` fingerprints and `build()` scans.

Hidden names (starting with '.') are skipped: tool state such as the demo marker or `.ipynb_checkpoints`.
Symlinks are followed only while they stay inside the dataset root, so a dataset cannot make the scan read
(and a later stage encode) files from elsewhere on the machine. Control folders (dataset.control) are walked the
same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from tuneline.schemas.scan import VIDEO_EXTENSIONS, DatasetConfig, Rejected
from tuneline.stages.common.hashing import digest


@dataclass(frozen=True)
class Entry:
    rel: str  # '/'-separated path relative to the dataset root
    path: str  # str, not Path: a listing builds one per file and pathlib is slow at that scale
    size: int
    mtime_ns: int


@dataclass
class Listing:
    root: Path
    images: list[Entry] = field(default_factory=list)
    captions: dict[str, Entry] = field(default_factory=dict)  # by path without extension: "a/b" for a/b.TXT
    metadata: list[Entry] = field(default_factory=list)
    problems: list[Rejected] = field(default_factory=list)
    # Caption files rejected while listing (a symlink out of the dataset, a loop): their images are rejected too,
    # as an undecodable caption's are, rather than trained with no caption. By path without extension.
    bad_captions: dict[str, str] = field(default_factory=dict)

    def fingerprint(self) -> dict:
        files = sorted([*self.images, *self.captions.values(), *self.metadata], key=lambda e: e.rel)
        rows = [(e.rel, e.size, e.mtime_ns) for e in files] + [(p.path, p.reason) for p in self.problems]
        return {"dataset": str(self.root), "files": len(files), "listing": digest(rows)}


def _valid_name(rel: str) -> bool:
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes arrive as surrogates and cannot be written to JSON
        return False
    return True


class _Walker:
    def __init__(self, root: Path, cfg: DatasetConfig, field: str):
        self.root = root
        self.field = field
        self.real_root = root.resolve()
        self.cfg = cfg
        # Video files are listed too: the scan trains them (a video family) or rejects them with the reason.
        self.image_exts = {e.lower() for e in cfg.extensions} | set(VIDEO_EXTENSIONS)
        self.listing = Listing(root)
        self.seen_dirs: set[Path] = set()

    def reject(self, rel: str, kind: str, reason: str) -> None:
        if not _valid_name(rel):
            rel = rel.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        self.listing.problems.append(Rejected(path=rel, kind=kind, reason=reason))
        stem, ext = os.path.splitext(rel)
        if ext.lower() == self.cfg.caption_extension.lower():
            self.listing.bad_captions[stem] = reason

    def walk(self, directory: Path, prefix: str) -> None:
        real = directory.resolve()
        if real in self.seen_dirs:  # a symlink loop, or a folder linked twice: scan it once
            return
        self.seen_dirs.add(real)
        try:
            with os.scandir(directory) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as err:  # one unreadable folder must not stop the scan of the rest
            self.reject(
                prefix.rstrip("/") or ".",
                "unreadable",
                f"cannot list the folder ({err.strerror}): check its permissions",
            )
            return
        for e in entries:
            if not e.name.startswith("."):
                self.visit(e, prefix + e.name)

    def visit(self, e: os.DirEntry, rel: str) -> None:
        if not _valid_name(rel):
            self.reject(rel, "name", "file name is not valid UTF-8: rename it")
            return
        if e.is_symlink():
            try:
                target = Path(e.path).resolve(strict=True)
            except FileNotFoundError:
                target = Path(e.path).resolve()  # a broken link: named below
            except (RuntimeError, OSError) as err:  # a loop (a -> b -> a): Python raises RuntimeError or ELOOP
                self.reject(
                    rel,
                    "symlink",
                    f"symlink loop ({getattr(err, 'strerror', None) or err}): the link "
                    f"never reaches a file; fix or remove it",
                )
                return
            if not target.is_relative_to(self.real_root):
                self.reject(
                    rel,
                    "symlink",
                    f"symlink to {target}, outside {self.field} {self.root}: refusing to "
                    f"read it; copy the file into the folder or remove the link",
                )
                return
            if not target.exists():
                self.reject(rel, "symlink", f"broken symlink (target {target} does not exist): fix or remove it")
                return
        if e.is_dir():
            if self.cfg.recursive:
                self.walk(Path(e.path), rel + "/")
            return
        if e.is_file():
            self.add_file(e, rel)
        else:  # opening a FIFO or device would hang or read forever
            self.reject(rel, "special", "not a regular file (a pipe, socket or device): remove it from the dataset")

    def add_file(self, e: os.DirEntry, rel: str) -> None:
        try:
            st = e.stat()
        except OSError as err:  # deleted or made unreadable while we walked
            self.reject(rel, "unreadable", f"cannot stat the file ({err.strerror}): check it still exists")
            return
        entry = Entry(rel, e.path, st.st_size, st.st_mtime_ns)
        ext = os.path.splitext(e.name)[1].lower()
        if ext in self.image_exts:
            self.listing.images.append(entry)
        elif ext == self.cfg.caption_extension.lower():
            self.listing.captions[os.path.splitext(rel)[0]] = entry
        elif e.name == self.cfg.metadata_file:
            self.listing.metadata.append(entry)
        else:
            self.reject(
                rel,
                "unsupported",
                f"not a supported image type ({ext or 'no extension'}); supported: "
                f"{', '.join(sorted(self.image_exts))}: convert it or move it out",
            )


def walk(root: Path, cfg: DatasetConfig, field: str = "dataset.path") -> Listing:
    """Every image, caption and metadata file under `root` (sizes and mtimes from stat only); `field` names the
    folder in rejections."""
    w = _Walker(Path(root), cfg, field)
    w.walk(w.root, "")
    return w.listing
