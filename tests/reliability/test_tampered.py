"""Tampered artifacts: `tuneline status` no longer calls them fresh. The cases are shared with
test_fix_commands.py, where the consuming stage refuses each, naming the artifact and a fix that works as printed.
Never a silent fallback to something else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.reliability import faultlib as fl

pytestmark = pytest.mark.timeout(2400)  # the session fixtures (kill walk, prepared workdir) run inside the first test


def _version(workdir: Path, stage: str) -> Path:
    found = sorted(fl.published(workdir, stage))
    assert len(found) == 1, f"{stage}: expected one published version, found {found}"
    return workdir / "artifacts" / stage / found[0]


def _edit_manifest(path: Path, edit) -> None:
    m = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m, indent=2), encoding="utf-8")


def _largest_chunk(latents: Path) -> Path:
    chunks = [p for p in (latents / "latents.zarr").rglob("*") if p.is_file() and "/c/" in p.as_posix()]
    assert chunks, f"no Zarr chunk files under {latents / 'latents.zarr'}"
    return max(chunks, key=lambda p: p.stat().st_size)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2
    data[i] = (data[i] + 1) % 256
    path.write_bytes(bytes(data))


def edited_fingerprint(w: Path) -> tuple[str, str]:
    _edit_manifest(_version(w, "text"), lambda m: m.update(fingerprint="0" * 16))
    return "text", "train"


def edited_fact(w: Path) -> tuple[str, str]:
    _edit_manifest(_version(w, "latents"), lambda m: m.update(latent_channels=m["latent_channels"] * 4))
    return "latents", "train"


def edited_count(w: Path) -> tuple[str, str]:
    def edit(m: dict) -> None:
        m["count"] += 5
        m["buckets"][0]["count"] += 5

    _edit_manifest(_version(w, "latents"), edit)
    return "latents", "train"


def truncated_chunk(w: Path) -> tuple[str, str]:
    chunk = _largest_chunk(_version(w, "latents"))
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    return "latents", "train"


def checksum_mismatch(w: Path) -> tuple[str, str]:
    _flip_a_byte(_version(w, "scan") / "images.jsonl")  # same size, different bytes
    return "scan", "latents"


def chunk_bit_flip(w: Path) -> tuple[str, str]:
    _flip_a_byte(_largest_chunk(_version(w, "latents")))
    return "latents", "train"


def future_schema(w: Path) -> tuple[str, str]:
    _edit_manifest(_version(w, "text"), lambda m: m.update(schema_version=m["schema_version"] + 98))
    return "text", "train"


def missing_upstream(w: Path) -> tuple[str, str]:
    shutil.rmtree(_version(w, "latents"))
    return "latents", "train"


CASES = [
    edited_fingerprint,
    edited_fact,
    edited_count,
    truncated_chunk,
    checksum_mismatch,
    future_schema,
    missing_upstream,
]


@pytest.mark.parametrize("tamper", CASES, ids=lambda c: c.__name__)
def test_status_no_longer_calls_a_tampered_artifact_fresh(workcopy, small_config, tamper):
    """What `tuneline status` computes, in-process (saves a CLI start per case)."""
    from tuneline.schemas.config import load_config
    from tuneline.stages.common.stage import StageContext, status
    from tuneline.stages.pipeline import PIPELINE

    victim, _ = tamper(workcopy)
    rows = {r.stage: r for r in status(StageContext(load_config(small_config, str(workcopy))), PIPELINE)}
    assert rows[victim].state != "fresh", f"status calls the tampered {victim} fresh: {rows[victim]}"
    assert rows[victim].reason, rows[victim]
