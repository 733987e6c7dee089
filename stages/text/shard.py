"""A sharded text build (text.shards > 1): the encoder batches split into N fixed parts, each encoded by its own
single process, then written into one text.zarr by the stage.

The strings, their row order and the windows (the batches written together, stages/text/core.windows) are a pure
function of the scan, the variant settings and the previous version, so every process computes them alike. Windows
with strings to encode are split into contiguous, equal parts. A shard encodes each of its windows' new strings as
one batch, exactly the batch a single process encodes, and stores the rows beside the work folder
(`<work>.shards/windows/`, never published), each window under a temporary name renamed into place: a killed
shard's finished windows are kept and its rerun skips them. The stage then writes the cache in row order from the
shards' windows and the previous version's rows, so it is byte for byte the 1-shard cache.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from tuneline.schemas.scan import ScanManifest
from tuneline.stages.common.shards import ShardJob, run_shards, shard_folder, split
from tuneline.stages.common.stage import key_parts
from tuneline.stages.text.reuse import PreviousStrings


def staging(work: Path) -> Path:
    return shard_folder(work) / "windows"


def to_encode(strings: list[str], previous: PreviousStrings | None, batch_size: int) -> list[tuple[int, list[str]]]:
    """(window number, its new strings) of every window with something to encode, in order."""
    from tuneline.stages.text.core import windows

    out = []
    for number, window in enumerate(windows(strings, previous, batch_size)):
        new = [s for s in window if previous is None or s not in previous]
        if new:
            out.append((number, new))
    return out


def load_window(work: Path, number: int, new: list[str]) -> dict[str, torch.Tensor] | None:
    """A window a shard finished, when it holds exactly these strings."""
    path = staging(work) / f"{number:08d}.pt"
    try:
        got = torch.load(path, weights_only=True)
    except (FileNotFoundError, RuntimeError, EOFError):
        return None
    return got["rows"] if got.get("strings") == new else None


def run_shard(ctx, job: ShardJob, index: int) -> dict:
    """A shard's body: encode its windows that are not staged yet."""
    from tuneline.stages.text import STAGE
    from tuneline.stages.text.controls import paired_captions
    from tuneline.stages.text.core import Encoders, wanted_strings

    work = Path(job.work)
    scan = ctx.store.read(ctx.store.version_dir("scan", job.upstream["scan"]), ScanManifest)
    previous = PreviousStrings.latest(ctx, key_parts(ctx, STAGE, {}))
    todo = to_encode(wanted_strings(ctx, scan), previous, ctx.cfg.text.batch_size)
    paired = paired_captions(ctx, scan, {})  # sha256 -> control file where rows are (instruction, control) pairs
    mine = [todo[k] for k in split(len(todo), job.count, index)]
    encode, encoded, resumed = Encoders(ctx, paired[1] if paired else None), 0, 0
    staging(work).mkdir(parents=True, exist_ok=True)
    for number, new in mine:
        if load_window(work, number, new) is not None:
            resumed += len(new)
            continue
        path = staging(work) / f"{number:08d}.pt"
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        torch.save({"strings": new, "rows": encode(new)}, tmp)
        os.replace(tmp, path)
        encoded += len(new)
    ctx.log.info("text shard %d: %d windows, %d strings encoded, %d resumed", index, len(mine), encoded, resumed)
    return {"blocks": len(mine), "encoded": encoded, "resumed": resumed}


def build_sharded(ctx, work: Path, upstream_versions: dict):
    """Run the shards; returns staged(window number, new strings) for write_cache, and the manifest's shard list."""
    if ctx.force:
        shutil.rmtree(staging(work), ignore_errors=True)
    job = ShardJob(
        stage="text",
        work=str(work.resolve()),
        count=ctx.cfg.text.shards,
        force=ctx.force,
        upstream=upstream_versions,
        config=ctx.cfg.dump(),
    )
    reports = run_shards(ctx, job)
    entries = [{k: r[k] for k in ("index", "blocks", "encoded", "seconds", "peak_rss")} for r in reports]
    return (lambda number, new: load_window(work, number, new)), entries
