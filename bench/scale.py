"""Benchmark: the scan and `tuneline status` at 100k images kept as WebDataset shards.

Generates 100,000 small distinct PNGs with `.txt` captions as 100 shards of 1,000 (`000000.tar` ...), once,
kept in the temp folder for later runs (`--images N` for a quicker, smaller set). Then, each in its own process
so that its peak RSS is its own, importing from cached bytecode as an installed package does:
- the cold scan (`run_stage` of the scan on a fresh workdir: listing, one streaming pass per shard hashing every
  member and reading its header, captions, buckets, publishing) against reading the same bytes (`cat`-speed,
  the limit): their throughput ratio;
- peak RSS of the scan, and of `tuneline status --json` on the scanned workdir, with its median latency over three
  processes after a first one (goal <= 2.5 s);
  both divided by the image count as well, at a tenth of the shards and at all of them (flat beyond the
  per-image record: the per-image figure does not grow);
- RESULT: one shard added to the set, the incremental rescan's time against the cold scan's (goal <= 0.03), and
  how much of it a process spends starting Python and importing the scan before it reads anything.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tuneline.schemas.demo import DEMO_CONFIG  # noqa: E402

PER_SHARD = 1000
GENERATOR_VERSION = "1"
GOAL = 0.03
STATUS_GOAL_S = 2.5
SCAN = """
import sys, logging
logging.disable(logging.WARNING)
from tuneline.schemas.config import load_config
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.scan import STAGE
run_stage(StageContext(load_config(sys.argv[1])), STAGE, [STAGE])
"""
IMPORTS = SCAN.rsplit("run_stage(", 1)[0]  # a process that starts Python and imports the scan, nothing more


def png(rng: np.random.Generator) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def write_shard(path: Path, index: int) -> None:
    """One shard in the WebDataset layout: key.png + key.txt per sample, keys unique across shards."""
    rng = np.random.default_rng(index)
    tmp = path.with_suffix(".partial")
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tf:
        for k in range(PER_SHARD):
            key = f"{index:06d}{k:04d}"
            for ext, data in (("png", png(rng)), ("txt", f"a sample {key}".encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime = len(data), 0
                tf.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)


def dataset(images: int) -> Path:
    root = Path(tempfile.gettempdir()) / f"tuneline-bench-scale-v{GENERATOR_VERSION}-{images}"
    root.mkdir(exist_ok=True)
    for i in range(images // PER_SHARD):
        if not (root / f"{i:06d}.tar").exists():
            write_shard(root / f"{i:06d}.tar", i)
    return root


def config(workdir: Path, data: Path) -> Path:
    raw = json.loads(json.dumps(DEMO_CONFIG))
    raw["workdir"] = str(workdir)
    raw["dataset"] = {"path": str(data), "demo": False}
    path = workdir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(raw))
    return path


def bytecode_env() -> dict[str, str]:
    """The children's environment: they import from cached bytecode, as an installed package does (pip compiles
    it). Under PYTHONDONTWRITEBYTECODE every child would compile tuneline's sources again, a fifth of a one-shard
    rescan's CPU time; the cache lives beside the bench's shards, not in the source tree."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return env | {"PYTHONPYCACHEPREFIX": str(Path(tempfile.gettempdir()) / "tuneline-bench-scale-pycache")}


def child(args: list[str]) -> tuple[float, float, float]:
    """(seconds, peak RSS in MiB, CPU seconds) of a child process run to completion. The CPU seconds say what the
    wall time would be on an idle machine, where other work on shared cores inflates start-up most."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=bytecode_env())
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{' '.join(args[:3])} failed:\n{proc.stderr.read().decode()[-3000:]}")
    return seconds, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def cat(root: Path) -> float:
    start = time.perf_counter()
    for shard in sorted(root.glob("*.tar")):
        with open(shard, "rb", buffering=0) as f:
            while f.read(1 << 20):
                pass
    return time.perf_counter() - start


def scan(cfg: Path) -> tuple[float, float, float]:
    return child([sys.executable, "-c", SCAN, str(cfg)])


def status(cfg: Path) -> tuple[float, float]:
    """Median time and peak RSS of three `tuneline status` processes, after one that fills the workdir's caches
    (the model identity), as a user's second look does."""
    cmd = [sys.executable, "-m", "tuneline.flows.cli", "status", str(cfg), "--json"]
    child(cmd)
    runs = sorted(child(cmd) for _ in range(3))
    return runs[1][0], max(r[1] for r in runs)


def measure(data: Path, work: Path, images: int) -> dict:
    cfg = config(work / f"w{images}", data)
    cold, cold_rss, cold_cpu = scan(cfg)
    reference = cat(data)
    status_s, status_rss = status(cfg)
    return {
        "cfg": cfg,
        "cold": cold,
        "cold_cpu": cold_cpu,
        "cat": reference,
        "scan_rss": cold_rss,
        "status": status_s,
        "status_rss": status_rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=100_000, help="images in the set (a multiple of 1,000)")
    n = parser.parse_args().images
    full, small = dataset(n), dataset(max(PER_SHARD, n // 10))
    work = Path(tempfile.mkdtemp(prefix="tuneline-bench-scale-"))
    child([sys.executable, "-c", IMPORTS])  # fills the bytecode cache: no measured scan compiles sources
    try:
        few, all_ = measure(small, work, n // 10), measure(full, work, n)
        for label, m, count in (("tenth", few, max(PER_SHARD, n // 10)), ("all", all_, n)):
            print(
                f"{label}: {count} images: cold scan {m['cold']:.1f} s ({count / m['cold']:.0f} images/s), "
                f"peak RSS scan {m['scan_rss']:.0f} MiB ({m['scan_rss'] * 1024 / count:.1f} KiB/image), "
                f"status {m['status']:.2f} s, peak RSS status {m['status_rss']:.0f} MiB"
            )
        print(f"cold_scan_vs_cat {all_['cat'] / all_['cold']:.3f} (cat {all_['cat']:.2f} s for the same bytes)")
        print(
            f"status_seconds {all_['status']:.2f} goal <= {STATUS_GOAL_S} {'PASS' if all_['status'] <= STATUS_GOAL_S else 'FAIL'}"
        )
        added = full / f"{n // PER_SHARD:06d}.tar"
        write_shard(added, n // PER_SHARD)
        try:
            incremental, _, incremental_cpu = scan(all_["cfg"])
        finally:
            added.unlink()
        ratio = incremental / all_["cold"]
        # The floor under any scan measured this way.
        start, _, start_cpu = child([sys.executable, "-c", IMPORTS])
        print(
            f"incremental +1 shard {incremental:.2f} s vs full {all_['cold']:.2f} s ({start:.2f} s of it starting "
            f"Python and importing the scan); CPU {incremental_cpu:.2f} s vs {all_['cold_cpu']:.2f} s "
            f"({start_cpu:.2f} s starting), ratio {incremental_cpu / all_['cold_cpu']:.3f}"
        )
        print(f"RESULT incremental_shard_vs_full {ratio:.3f} goal <= {GOAL} {'PASS' if ratio <= GOAL else 'FAIL'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
