"""Benchmark: what one training micro-step takes from the loader, against per-image latent files and against a
memory-mapped array, on the same latents in one run.

~4,000 latents of SD1.5-at-512px size (4 x 64 x 64 and three nearby aspect buckets, float16) are written our
way (Zarr, mean + std in block chunks, through stages.latents.store), as one `torch.save`d `.pt` per image
(SimpleTuner's layout), one `.npz` per image (kohya's layout), and as one contiguous memory-mapped array per
bucket (the limit: no files to open, no chunks to decode). Each loader produces the same epoch of shuffled
bucket batches of 16 as the training step receives them: float32 (B, C, h, w) on the training device (the GPU
when there is one, else this CPU). Ours is the trainer's own path: its feed (stages.common.prefetch.ahead, one
thread, two batches ahead) reads each batch's mean and std (`LatentReader.batch` + `gather`, pinned for a
GPU), and the step draws latent = mean + std * eps on the training device from the micro-batch's device
generator (`stages.latents.reader.draw`). The others run synchronously: the per-file layouts load their stored latent (one
fixed draw) and copy it to the device; the limit gathers mean and std from the memory-mapped arrays and draws the
same eps on the device. Rounds alternate between loaders; the best round of each counts (shared, noisy machine).
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.latents import LatentBucket, LatentsManifest  # noqa: E402
from stages.common.jsonl import write_jsonl  # noqa: E402
from stages.latents import store  # noqa: E402
from stages.common.prefetch import ahead  # noqa: E402
from stages.latents.reader import LatentReader, draw, epoch_plan  # noqa: E402
from stages.train.loop import feed_workers  # noqa: E402

BUCKETS = {"512x512": (4, 64, 64), "448x576": (4, 72, 56), "576x448": (4, 56, 72), "640x384": (4, 48, 80)}
PER_BUCKET = 1000
BATCH = 16
BLOCK_ROWS = 64
ROUNDS = 3
GOAL_PT, GOAL_NPZ, GOAL_MMAP = 3.0, 1.5, 0.5
FEED_DEPTH = 2  # Trainer.feed's: two steps of one micro-batch ahead


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


def run_ours(reader: LatentReader, plan, device: torch.device) -> int:
    """The trainer's path (stages.train.loop.Trainer.feed, prepare, latents): the feed thread reads, the step
    draws."""
    pin = device.type == "cuda"

    def read(bucket_rows):
        return reader.gather(reader.batch(*bucket_rows), pin=pin)

    n = 0
    with closing(ahead(plan, read, workers=feed_workers(reader), depth=FEED_DEPTH, name="bench-feed")) as feed:
        for i, (mean, std) in enumerate(feed):
            n += len(draw(mean, std, torch.Generator(device).manual_seed(i)))
    return finish(n, device)


def finish(n: int, device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the copies and draws queued on the GPU are part of the work
    return n


def write_mmap(root: Path, data: dict[str, np.ndarray]) -> dict[str, tuple[np.memmap, np.memmap]]:
    out = {}
    for key, mean in data.items():
        std = (np.abs(mean) * 0.01 + 1e-3).astype(np.float16)
        arrays = []
        for name, values in (("mean", mean), ("std", std)):
            m = np.lib.format.open_memmap(root / f"{key}-{name}.npy", mode="w+", dtype=values.dtype,
                                          shape=values.shape)
            m[:] = values
            m.flush()
            arrays.append(np.load(root / f"{key}-{name}.npy", mmap_mode="r"))
        out[key] = (arrays[0], arrays[1])
    return out


def run_mmap(arrays, plan, device: torch.device) -> int:
    """The limit: rows gathered from contiguous memory-mapped arrays, sampled the same way on the device."""
    n = 0
    for i, (bucket, rows) in enumerate(plan):
        idx = np.sort(rows)
        mean, std = (torch.from_numpy(np.ascontiguousarray(a[idx])) for a in arrays[bucket])
        n += len(draw(mean, std, torch.Generator(device).manual_seed(i)))
    return finish(n, device)


def load_pt(root: Path, bucket: str, rows, device: torch.device) -> torch.Tensor:
    batch = torch.stack([torch.load(root / "pt" / bucket / f"{r}.pt", weights_only=True) for r in rows])
    return batch.to(device).float()


def load_npz(root: Path, bucket: str, rows, device: torch.device) -> torch.Tensor:
    arrays = []
    for r in rows:
        with np.load(root / "npz" / bucket / f"{r}.npz") as z:
            arrays.append(z["latents"])
    return torch.from_numpy(np.stack(arrays)).to(device).float()


def run_files(load, root: Path, plan, device: torch.device) -> int:
    return finish(sum(len(load(root, bucket, rows, device)) for bucket, rows in plan), device)


def main() -> None:
    torch.set_num_threads(1)  # every loader runs in the trainer's process; keep BLAS threads out of the race
    tmp = Path(tempfile.mkdtemp(prefix="tuneline-bench-loader-"))
    try:
        rng = np.random.default_rng(0)
        data = {k: rng.standard_normal((PER_BUCKET, *s), dtype=np.float32).astype(np.float16)
                for k, s in BUCKETS.items()}
        reader = write_ours(tmp / "ours", data)
        write_files(tmp, data)
        mapped = write_mmap(tmp, data)
        plan = epoch_plan(reader.counts(), BATCH, 1, seed=0, epoch=0, block_rows=BLOCK_ROWS)
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        runs = {"ours": lambda: run_ours(reader, plan, dev), "mmap": lambda: run_mmap(mapped, plan, dev),
                "pt": lambda: run_files(load_pt, tmp, plan, dev), "npz": lambda: run_files(load_npz, tmp, plan, dev)}
        best = dict.fromkeys(runs, 0.0)
        for _ in range(ROUNDS):
            for name, fn in runs.items():
                t = time.perf_counter()
                n = fn()
                best[name] = max(best[name], n / (time.perf_counter() - t))
        report(best, dev)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(best: dict[str, float], device: torch.device) -> None:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{PER_BUCKET * len(BUCKETS)} latents in {len(BUCKETS)} buckets (4x64x64 class, float16), batch {BATCH}, "
          f"best of {ROUNDS} rounds; samples/s of float32 batches on the training device ({where})")
    print(f"ours (the trainer's feed thread reading, eps drawn on the device): {best['ours']:.0f}")
    print(f"limit, memory-mapped contiguous mean + std, same eps draw: {best['mmap']:.0f}")
    print(f".pt per image (SimpleTuner): {best['pt']:.0f}")
    print(f".npz per image (kohya):      {best['npz']:.0f}")
    r_pt, r_npz, r_mmap = (best["ours"] / best[k] for k in ("pt", "npz", "mmap"))
    print(f"loader_vs_npz {r_npz:.2f} goal >= {GOAL_NPZ} {'PASS' if r_npz >= GOAL_NPZ else 'FAIL'}")
    print(f"loader_vs_mmap_limit {r_mmap:.2f} goal >= {GOAL_MMAP} {'PASS' if r_mmap >= GOAL_MMAP else 'FAIL'}")
    print(f"RESULT loader_speedup_vs_pt {r_pt:.2f} goal >= {GOAL_PT} {'PASS' if r_pt >= GOAL_PT else 'FAIL'}")


if __name__ == "__main__":
    main()
