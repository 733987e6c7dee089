"""Benchmark: the training reader against per-image latent files, on the same latents in one run.

~4,000 latents of SD1.5-at-512px size (4 x 64 x 64 and three nearby aspect buckets, float16) are written
three ways: our Zarr cache (mean + std in block chunks, through stages.latents.store), one `torch.save`d `.pt`
per image (SimpleTuner's layout) and one `.npz` per image (kohya's layout). Each loader produces the same
epoch of bucketed batches of 16 as float32 (B, C, h, w) tensors, with the same pipelining: WORKERS threads,
DEPTH batches ahead (ours through `LatentReader.prefetch`, the others through a thread pool).

What is compared is what each layout delivers to the training step: the per-file layouts a fixed latent,
ours the distribution (mean and std, twice the bytes). The trainer draws latent = mean + std * eps on its
own device next to the diffusion noise of the same size (a generator on the GPU there), so the RESULT line
is our read path. A second line shows ours with eps drawn on this CPU inside the loader, for reference.
Rounds alternate between loaders; the best round of each counts (shared, noisy machine).
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.latents import LatentBucket, LatentsManifest  # noqa: E402
from stages.common.jsonl import write_jsonl  # noqa: E402
from stages.latents import store  # noqa: E402
from stages.latents.reader import LatentReader, epoch_plan  # noqa: E402

BUCKETS = {"512x512": (4, 64, 64), "448x576": (4, 72, 56), "576x448": (4, 56, 72), "640x384": (4, 48, 80)}
PER_BUCKET = 1000
BATCH = 16
BLOCK_ROWS = 64
ROUNDS = 3
WORKERS, DEPTH = 2, 4  # the same for every loader
GOAL_PT, GOAL_NPZ = 3.0, 1.5


def write_ours(root: Path, data: dict[str, np.ndarray]) -> LatentReader:
    index, buckets = [], []
    for key, mean in data.items():
        n, shape = len(mean), mean.shape[1:]
        std = (np.abs(mean) * 0.01 + 1e-3).astype(np.float16)
        arrays = store.create_arrays(root, key, shape, n, "float16", BLOCK_ROWS, store.DIST)
        for b in range(0, n, BLOCK_ROWS):
            store.write_block(arrays, b // BLOCK_ROWS, {"mean": mean[b:b + BLOCK_ROWS], "std": std[b:b + BLOCK_ROWS]})
        index += [{"path": f"{key}/{i}.png", "bucket": key, "row": i, "key": f"{key}-{i}"} for i in range(n)]
        w, h = (int(x) for x in key.split("x"))
        buckets.append(LatentBucket(width=w, height=h, shape=shape, count=n, array=key))
    write_jsonl(root / store.INDEX, index)
    manifest = LatentsManifest(fingerprint="bench", tool_version="bench", code_version="bench", family="sd15",
                               vae_identity="bench", vae_dtype="float32", vae_factor=8, latent_channels=4,
                               scaling_factor=0.18215, shift_factor=0.0, dtype="float16", flip=False,
                               block_rows=BLOCK_ROWS, size_policy={}, buckets=buckets,
                               count=len(index))
    return LatentReader(root, manifest)


def write_files(root: Path, data: dict[str, np.ndarray]) -> None:
    for key, mean in data.items():
        (root / "pt" / key).mkdir(parents=True)
        (root / "npz" / key).mkdir(parents=True)
        for i, lat in enumerate(mean):
            torch.save(torch.from_numpy(lat.copy()), root / "pt" / key / f"{i}.pt")
            np.savez(root / "npz" / key / f"{i}.npz", latents=lat, original_size=np.array([512, 512]),
                     crop_ltrb=np.array([0, 0, 0, 0]))


def run_ours(reader: LatentReader, plan) -> int:
    batches = (reader.batch(bucket, rows) for bucket, rows in plan)
    return sum(len(x) for _, x in reader.prefetch(batches, seed=0, workers=WORKERS, depth=DEPTH))


def load_pt(root: Path, bucket: str, rows) -> torch.Tensor:
    return torch.stack([torch.load(root / "pt" / bucket / f"{r}.pt", weights_only=True) for r in rows]).float()


def load_npz(root: Path, bucket: str, rows) -> torch.Tensor:
    arrays = []
    for r in rows:
        with np.load(root / "npz" / bucket / f"{r}.npz") as z:
            arrays.append(z["latents"])
    return torch.from_numpy(np.stack(arrays)).float()


def run_files(load, root: Path, plan) -> int:
    """The per-file layouts get the same pipelining as ours: WORKERS threads, DEPTH batches ahead."""
    n = 0
    with ThreadPoolExecutor(WORKERS) as pool:
        pending: deque = deque()
        for bucket, rows in plan:
            pending.append(pool.submit(load, root, bucket, rows))
            if len(pending) >= DEPTH:
                n += len(pending.popleft().result())
        n += sum(len(f.result()) for f in pending)
    return n


def main() -> None:
    torch.set_num_threads(1)  # every loader runs in the trainer's process; keep BLAS threads out of the race
    tmp = Path(tempfile.mkdtemp(prefix="tuneline-bench-loader-"))
    try:
        rng = np.random.default_rng(0)
        data = {k: rng.standard_normal((PER_BUCKET, *s), dtype=np.float32).astype(np.float16)
                for k, s in BUCKETS.items()}
        reader = write_ours(tmp / "ours", data)
        write_files(tmp, data)
        plan = epoch_plan(reader.counts(), BATCH, 1, seed=0, epoch=0, block_rows=BLOCK_ROWS)
        runs = {"ours": lambda: run_ours(reader, plan),
                "reads": lambda: run_files(lambda _, b, rows: reader.gather(reader.batch(b, rows))[0], tmp, plan),
                "pt": lambda: run_files(load_pt, tmp, plan), "npz": lambda: run_files(load_npz, tmp, plan)}
        best = dict.fromkeys(runs, 0.0)
        for _ in range(ROUNDS):
            for name, fn in runs.items():
                t = time.perf_counter()
                n = fn()
                best[name] = max(best[name], n / (time.perf_counter() - t))
        report(best)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(best: dict[str, float]) -> None:
    print(f"{PER_BUCKET * len(BUCKETS)} latents in {len(BUCKETS)} buckets (4x64x64 class, float16), batch {BATCH}, "
          f"{WORKERS} threads and {DEPTH} batches ahead for every loader, best of {ROUNDS} rounds")
    print(f"ours, mean + std delivered (eps drawn on the training device): {best['reads']:.0f} samples/s")
    print(f"ours, eps also drawn on this CPU in the loader: {best['ours']:.0f} samples/s "
          f"({best['ours'] / best['pt']:.2f}x .pt)")
    print(f".pt per image (SimpleTuner): {best['pt']:.0f} samples/s")
    print(f".npz per image (kohya):      {best['npz']:.0f} samples/s")
    r_pt, r_npz = best["reads"] / best["pt"], best["reads"] / best["npz"]
    print(f"loader_speedup_vs_npz {r_npz:.2f} goal >= {GOAL_NPZ} {'PASS' if r_npz >= GOAL_NPZ else 'FAIL'}")
    print(f"RESULT loader_speedup_vs_pt {r_pt:.2f} goal >= {GOAL_PT} {'PASS' if r_pt >= GOAL_PT else 'FAIL'}")


if __name__ == "__main__":
    main()
