"""Benchmark: the latents stage with `latents.shards: 2` against one process, on the same images.

Each side is its own Python process running the stage (`run_stage` on a fresh workdir whose scan is done
beforehand, untimed), every process with one decode worker (`latents.workers: 1`) and one torch thread
(OMP_NUM_THREADS=1), so two shards on the two cores here stand for two GPUs: the scaling a second device gives.
The model and images are bench/cache.py's (SD VAE architecture narrowed, photo-like JPEGs/PNGs at 1.5-3x their
128 px buckets). Printed per side: seconds, and peak host RAM per process (the shards' from the manifest, which
each shard measures itself). The two caches are checked byte for byte. The machine is shared: the load average
is printed before and after, and the figure is only meaningful when it is low.

    python bench/sharded_cache.py [--images N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GOAL = 1.7
MIN_SECONDS = 30.0
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def context(work: Path, data: Path, model: Path, shards: int):
    from cache import BATCH, RESOLUTION

    from tuneline.schemas.config import parse_config
    from tuneline.stages.common.stage import StageContext

    cfg = parse_config(
        {
            "dataset": {"path": str(data)},
            "model": {"family": "tiny", "path": str(model), "device": "cpu"},
            "buckets": {"resolution": RESOLUTION},
            "latents": {"batch_size": BATCH, "workers": 1, "shards": shards},
        },
        workdir=str(work),
    )
    return StageContext(cfg)


def side(work: Path, data: Path, model: Path, shards: int) -> None:
    """One side, in this process: scan (untimed), then the latents stage timed; prints a JSON line."""
    import torch

    from tuneline.schemas.latents import LatentsManifest
    from tuneline.stages.common.stage import run_stage
    from tuneline.stages.pipeline import PIPELINE, stage

    torch.set_num_threads(1)
    ctx = context(work, data, model, shards)
    run_stage(ctx, stage("scan"), PIPELINE)
    t = time.perf_counter()
    path, built = run_stage(ctx, stage("latents"), PIPELINE)
    seconds = time.perf_counter() - t
    assert built
    m = ctx.store.read(path, LatentsManifest)
    print(
        json.dumps(
            {
                "seconds": seconds,
                "path": str(path),
                "count": m.count,
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "shards": [s.model_dump() for s in m.shards or []],
            }
        )
    )


def run_side(root: Path, data: Path, model: Path, shards: int) -> dict:
    work = root / f"work-{shards}"
    cmd = [
        sys.executable,
        __file__,
        "--side",
        str(shards),
        "--work",
        str(work),
        "--data",
        str(data),
        "--model",
        str(model),
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **ENV), check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the side's process and its shards, all waited for
    if out.returncode != 0:
        raise SystemExit(f"side with {shards} shard(s) failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"cpu": cpu}


def files(path: Path) -> dict[str, bytes]:
    return {
        p.relative_to(path).as_posix(): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=600)
    p.add_argument("--side", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.side is not None:
        side(a.work, a.data, a.model, a.side)
        return
    from cache import make_images, make_model

    with tempfile.TemporaryDirectory(prefix="tuneline-bench-shards-") as tmp:
        root = Path(tmp)
        model = make_model(root)
        make_images(root / "data", range(a.images))
        load_before = os.getloadavg()
        single = run_side(root, root / "data", model, 1)
        sharded = run_side(root, root / "data", model, 2)
        load_after = os.getloadavg()
        same = files(Path(single["path"])) == files(Path(sharded["path"]))
        print(f"images {single['count']}, one decode worker and one torch thread per process")
        print(
            f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after {load_after[0]:.2f} "
            f"{load_after[1]:.2f} (1 and 5 min; 2 cores)"
        )
        print(
            f"CPU seconds of every process of a side (scan included): 1 process {single['cpu']:.0f}, "
            f"2 shards {sharded['cpu']:.0f}"
        )
        print(f"1 process: {single['seconds']:.1f} s, peak RSS {single['peak_rss'] / 2**20:.0f} MiB")
        print(f"2 shards: {sharded['seconds']:.1f} s (parent peak RSS {sharded['peak_rss'] / 2**20:.0f} MiB)")
        for s in sharded["shards"]:
            print(
                f"  shard {s['index']}: {s['blocks']} blocks, {s['encoded']} encoded, {s['seconds']:.1f} s, "
                f"peak RSS {s['peak_rss'] / 2**20:.0f} MiB"
            )
        print(f"caches byte-identical: {same}")
        if single["seconds"] < MIN_SECONDS:
            print(f"warning: the single process took under {MIN_SECONDS:.0f} s: raise --images")
        ratio = single["seconds"] / sharded["seconds"]
        ok = same and ratio >= GOAL and single["seconds"] >= MIN_SECONDS
        print(f"RESULT sharded_vs_single {ratio:.2f} goal >= {GOAL} {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
