"""Benchmark: the latents stage after adding 1 % new images, against caching everything, as scheduled runs do it.

Model and images as in bench/cache.py (SD VAE block layout, photo-like files at 1.5-3x their 128 px buckets),
N_IMAGES of them. Every timed run is `tuneline stage latents`'s work in a fresh process (interpreter start,
imports, checks, VAE load and the process's exit included, ending as the tuneline command ends), as a scheduled
run pays it:
  full         the latents stage on N images (scan done beforehand, untimed);
  incremental  per round, 1 % new images are added and the scan reruns (untimed), then the latents stage: blocks
               the new images leave unchanged share the previous version's chunk files, the rest of the rows are
               copied, and only the new images are encoded;
  no-op        right after, the same stage again with nothing changed: the fixed per-process cost.
ROUNDS rounds; the medians count. incremental_vs_full = (incremental - no-op) / full: the work an added 1 % costs,
as a share of a full cache, net of the fixed cost of starting a process (printed).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cache import context, make_images, make_model  # noqa: E402

N_IMAGES = 2000
ROUNDS = 3
GOAL = 0.03

STAGE = """
import json, sys
from tuneline.schemas.config import parse_config
from tuneline.schemas.latents import LatentsManifest
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.pipeline import PIPELINE, stage
ctx = StageContext(parse_config(json.loads(open(sys.argv[1]).read())))
path, built = run_stage(ctx, stage(sys.argv[2]), PIPELINE)
m = ctx.store.read(path, LatentsManifest) if sys.argv[2] == "latents" else None
print(json.dumps({"built": built, "encoded": m.encoded if m else None, "reused": m.reused if m else None}))
import gc; gc.freeze()  # as the tuneline command ends (flows/cli.py main)
"""


def run(spec: Path, name: str) -> tuple[float, dict]:
    """One stage in a fresh process: (wall seconds, what it reports)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", STAGE, str(spec), name], cwd=ROOT, env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"stage {name} failed:\n{out.stderr[-3000:]}")
    return seconds, json.loads(out.stdout.strip().splitlines()[-1])


def import_seconds() -> float:
    """What a fresh process pays to import what an encoding latents run needs, measured inside it."""
    code = (
        "import time; t = time.perf_counter(); import torch, tuneline.stages.latents.core, tuneline.stages.families.vae_encoder; "
        "print(time.perf_counter() - t)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="tuneline-bench-incremental-"))
    try:
        model, data = make_model(tmp), tmp / "data"
        make_images(data, range(N_IMAGES))
        spec = tmp / "config.json"
        spec.write_text(json.dumps(context(tmp / "work", data, model).cfg.dump()))
        run(spec, "scan")
        t_full, full = run(spec, "latents")
        assert full["encoded"] == N_IMAGES, full
        new, total = N_IMAGES // 100, N_IMAGES
        incremental, noop = [], []
        for r in range(ROUNDS):
            make_images(data, range(total, total + new), seed=r + 1)
            total += new
            run(spec, "scan")
            t, got = run(spec, "latents")
            assert got["built"] and (got["encoded"], got["reused"]) == (new, total - new), got
            incremental.append(t)
            t, got = run(spec, "latents")
            assert not got["built"], got
            noop.append(t)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    t_incr, t_noop = statistics.median(incremental), statistics.median(noop)
    t_import = statistics.median(import_seconds() for _ in range(ROUNDS))
    print(f"full cache of {N_IMAGES} images: {t_full:.1f} s (fresh process)")
    print(
        f"+{new} new images (1 %), {ROUNDS} rounds: {', '.join(f'{t:.1f}' for t in incremental)} s; "
        f"median {t_incr:.1f} s"
    )
    print(f"no-op latents run (fixed per-process cost): {', '.join(f'{t:.1f}' for t in noop)} s; median {t_noop:.1f} s")
    print(
        f"of the incremental run, importing torch and the stage's encoding code (which a no-op run skips): "
        f"{t_import:.1f} s"
    )
    ratio = (t_incr - t_noop) / t_full
    print(f"RESULT incremental_vs_full {ratio:.3f} goal <= {GOAL} {'PASS' if ratio <= GOAL else 'FAIL'}")


if __name__ == "__main__":
    main()
