"""Which code and libraries a stage's output depends on, so a version changes when they do.

Each stage's version string lives in stages/code_versions.json beside a hash of the source files that decide its
output. tests/unit/test_code_versions.py fails when those files change and the recorded hash does not: then either
the output changes (bump the version: `python -m tuneline.stages.common.codeident --bump STAGE`, every published version of
that stage becomes stale) or it does not (`python -m tuneline.stages.common.codeident --record STAGE`, a refactor or a
comment). The libraries that compute a stage's output are part of its key by major.minor, so an upgrade that can
change numbers makes caches stale, while a patch release does not.
"""
from __future__ import annotations

import hashlib
import json
import sys
from functools import cache
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "stages" / "code_versions.json"
FAMILIES = ("stages/families/*.py", "schemas/families.py")
SOURCES: dict[str, tuple[str, ...]] = {
    "scan": ("stages/scan/*.py", "stages/common/sizing.py", "schemas/scan.py"),
    "latents": ("stages/latents/*.py", "stages/common/sizing.py", *FAMILIES),
    "caption": ("stages/caption/*.py", "schemas/caption.py"),
    "text": ("stages/text/*.py", *FAMILIES),
    "train": ("stages/train/*.py", "stages/latents/reader.py", "stages/text/live.py", "stages/text/store.py",
              "stages/render/*.py", *FAMILIES),
    "validate": ("stages/validate/*.py", "stages/render/*.py", *FAMILIES),
}
LIBRARIES: dict[str, tuple[str, ...]] = {
    "scan": ("pillow",),
    "latents": ("torch", "diffusers", "pillow"),
    "caption": ("torch", "transformers", "tokenizers", "pillow"),
    "text": ("torch", "transformers", "tokenizers"),
    "train": ("torch", "diffusers", "peft"),
    "validate": ("torch", "diffusers", "transformers", "pillow"),
}


def _files(stage: str) -> list[Path]:
    return sorted({p for pattern in SOURCES[stage] for p in ROOT.glob(pattern) if p.name != "demo.py"})


def source_hash(stage: str) -> str:
    h = hashlib.sha256()
    for f in _files(stage):
        h.update(f"{f.relative_to(ROOT).as_posix()}\0".encode() + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@cache
def recorded() -> dict[str, dict[str, str]]:
    return json.loads(RECORD.read_text(encoding="utf-8"))


def code_version(stage: str) -> str:
    return recorded()[stage]["version"]


def library_versions(stage: str) -> dict[str, str]:
    """major.minor of each library that computes this stage's output (read from package metadata: no import)."""
    out = {}
    for name in LIBRARIES.get(stage, ()):  # a stage defined outside the pipeline (tests) has none
        try:
            out[name] = ".".join(metadata.version(name).split(".")[:2])
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def _write(stage: str, bump: bool) -> None:
    data = json.loads(RECORD.read_text(encoding="utf-8"))
    entry = data[stage]
    if bump:
        name, _, n = entry["version"].rpartition("-")
        entry["version"] = f"{name}-{int(n) + 1}"
    entry["source"] = source_hash(stage)
    RECORD.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(f"{stage}: version {entry['version']}, source {entry['source']}")


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in ("--record", "--bump") or argv[1] not in SOURCES:
        sys.exit(f"usage: python -m tuneline.stages.common.codeident --record|--bump {'|'.join(SOURCES)}")
    _write(argv[1], bump=argv[0] == "--bump")


if __name__ == "__main__":
    main(sys.argv[1:])
