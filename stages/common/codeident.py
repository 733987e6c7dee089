"""Which code and libraries a stage's output depends on, so a version changes when they do.

Each stage's version string lives in stages/code_versions.json beside a hash of the source files that decide its
output. tests/unit/test_code_versions.py fails when those files change and the recorded hash does not: then either
the output changes (bump the version: `python -m tuneline.stages.common.codeident --bump STAGE`, every published version of
that stage becomes stale) or it does not (`python -m tuneline.stages.common.codeident --record STAGE`, a refactor or a
comment). A family's own folder (stages/families/<name>/, its shipped config and its schemas/families.py row) is
versioned apart, in stages/family_versions.json (`--record NAME` / `--bump NAME` with a family name): a bump there
makes only that family's latents/text/train/validate versions stale (their code version gains "+<name>-<n>"; at
revision 0 it is the stage's own, so a family never bumped keeps the keys it had). The libraries that compute a stage's output are part of its key by major.minor, so an upgrade that can
change numbers makes caches stale, while a patch release does not.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from functools import cache
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "stages" / "code_versions.json"
FAMILY_RECORD = ROOT / "stages" / "family_versions.json"
# The generic family code (top-level files only: each family's folder is hashed for that family alone).
FAMILIES = ("stages/families/*.py", "schemas/famil*.py")
SOURCES: dict[str, tuple[str, ...]] = {
    "scan": ("stages/scan/*.py", "stages/common/sizing.py", "schemas/scan.py"),
    "latents": ("stages/latents/*.py", "stages/common/sizing.py", *FAMILIES),
    "caption": ("stages/caption/*.py", "schemas/caption.py"),
    "text": ("stages/text/*.py", *FAMILIES),
    "train": (
        "stages/train/*.py",
        "stages/latents/reader.py",
        "stages/text/live.py",
        "stages/text/store.py",
        "stages/render/*.py",
        *FAMILIES,
    ),
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


FAMILY_DIR = ROOT / "stages" / "families"
_IMPORT = re.compile(r"tuneline\.stages\.families\.(\w+)")


def _folder_files(name: str) -> set[Path]:
    return {
        p
        for d in (FAMILY_DIR / name, FAMILY_DIR / "configs" / name)
        if d.is_dir()
        for p in d.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def family_files(name: str) -> list[Path]:
    """The family's folder and shipped config, and those of the families its code imports (tiny builds on SD1.5's
    adapter: an SD1.5 change is a tiny change too)."""
    seen, todo, files = set(), [name], set()
    while todo:
        n = todo.pop()
        if n in seen or not (FAMILY_DIR / n).is_dir():
            continue
        seen.add(n)
        mine = _folder_files(n)
        files |= mine
        todo += [m for f in mine if f.suffix == ".py" for m in _IMPORT.findall(f.read_text(encoding="utf-8"))]
    return sorted(files)


def family_hash(name: str) -> str:
    from tuneline.schemas.families import FAMILY_FACTS

    h = hashlib.sha256(repr(FAMILY_FACTS[name]).encode() + b"\0")
    for f in family_files(name):
        h.update(f"{f.relative_to(ROOT).as_posix()}\0".encode() + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@cache
def family_recorded() -> dict[str, dict]:
    try:
        return json.loads(FAMILY_RECORD.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def stage_code_version(stage: str, version: str, family: str) -> str:
    """The code version of `stage` (recorded as `version`) for model.family `family`: the family's revision is
    appended once it has been bumped, for the stages that run family code."""
    if stage not in SOURCES or not set(FAMILIES) <= set(SOURCES[stage]):
        return version
    revision = family_recorded().get(family, {}).get("revision", 0)
    return version if revision == 0 else f"{version}+{family}-{revision}"


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


def _write_family(name: str, bump: bool) -> None:
    data = dict(family_recorded()) if FAMILY_RECORD.is_file() else {}
    entry = data.setdefault(name, {"revision": 0})
    if bump:
        entry["revision"] += 1
    entry["source"] = family_hash(name)
    FAMILY_RECORD.write_text(json.dumps(dict(sorted(data.items())), indent=2) + "\n", encoding="utf-8")
    print(f"family {name}: revision {entry['revision']}, source {entry['source']}")


def main(argv: list[str]) -> None:
    from tuneline.schemas.families import FAMILY_FACTS

    if len(argv) != 2 or argv[0] not in ("--record", "--bump") or argv[1] not in (*SOURCES, *FAMILY_FACTS):
        sys.exit(
            f"usage: python -m tuneline.stages.common.codeident --record|--bump "
            f"{'|'.join(SOURCES)}|<family: {'|'.join(FAMILY_FACTS)}>"
        )
    if argv[1] in SOURCES:
        _write(argv[1], bump=argv[0] == "--bump")
    else:
        _write_family(argv[1], bump=argv[0] == "--bump")


if __name__ == "__main__":
    main(sys.argv[1:])
