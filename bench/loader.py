"""Benchmark: what one training micro-step takes from the loader, against per-image latent files and against a
memory-mapped array, on the same latents in one run.

~4,000 latents of SD1.5-at-512px size (4 x 64 x 64 and three nearby aspect buckets, float16) are written our
way (Zarr, mean + std in block chunks, through tuneline.stages.latents.store), as one `torch.save`d `.pt` per image
(SimpleTuner's layout), one `.npz` per image (kohya's layout), and as one contiguous memory-mapped array per
bucket (the limit: no files to open, no chunks to decode). Each loader produces the same epoch of shuffled
bucket batches of 16 as the training step receives them: float32 (B, C, h, w) on the training device (the GPU
when there is one, else this CPU), and every loader runs the way the trainer runs its own: through the trainer's
feed (tuneline.stages.common.prefetch.ahead with `feed_workers` threads, two batches ahead), the CPU side of its work in the
feed and the device side in the consuming step. Ours is the trainer's path: `LatentReader.batch` + `gather` (pinned
for a GPU), and latent = mean + std * eps drawn from the micro-batch's generator on the training device where the
trainer draws it (`tuneline.stages.train.loop.samples_in_feed`: in the feed on a CPU, in the step on a GPU). The per-file
layouts load their stored latent (one fixed draw), stack and convert it; the limit gathers mean and std from the
memory-mapped arrays and draws the same eps. Rounds alternate between loaders; the best round of each counts
(shared, noisy machine).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.records import write_latents  # noqa: E402
from tuneline.stages.common.prefetch import ahead  # noqa: E402
from tuneline.stages.latents.reader import LatentReader, epoch_plan  # noqa: E402
from tuneline.stages.train.feed import feed_workers, sample_latents, samples_in_feed  # noqa: E402

BUCKETS = {"512x512": (4, 64, 64), "448x576": (4, 72, 56), "576x448": (4, 56, 72), "640x384": (4, 48, 80)}
PER_BUCKET = 1000
BATCH = 16
BLOCK_ROWS = 64
ROUNDS = 3
GOAL_PT, GOAL_NPZ, GOAL_MMAP = 3.0, 1.5, 0.5
FEED_DEPTH = 2  # Trainer.feed's: two steps of one micro-batch ahead


def write_ours(root: Path, data: dict[str, np.ndarray]) -> LatentReader:
    arrays = {key: {"mean": mean, "std": (np.abs(mean) * 0.01 + 1e-3).astype(np.float16)} for key, mean in data.items()}
    return LatentReader(root, write_latents(root, arrays, BLOCK_ROWS, family="sd15", scaling_factor=0.18215))


def write_files(root: Path, data: dict[str, np.ndarray]) -> None:
    for key, mean in data.items():
        (root / "pt" / key).mkdir(parents=True)
        (root / "npz" / key).mkdir(parents=True)
        for i, lat in enumerate(mean):
            torch.save(torch.from_numpy(lat.copy()), root / "pt" / key / f"{i}.pt")
            np.savez(
                root / "npz" / key / f"{i}.npz",
                latents=lat,
                original_size=np.array([512, 512]),
                crop_ltrb=np.array([0, 0, 0, 0]),
            )


def through_feed(plan, prepare: Callable, finish: Callable, workers: int) -> int:
    """One loader as the trainer runs it: `prepare` (the CPU side: reads, and on a CPU training device the eps
    draw too) in the feed's threads ahead of the consumer, `finish` (the device side) in the consuming step."""
    n = 0
    with closing(ahead(enumerate(plan), prepare, workers=workers, depth=FEED_DEPTH, name="bench-feed")) as feed:
        for item in feed:
            n += len(finish(item))
    return n


def synchronous(plan, prepare: Callable, finish: Callable) -> int:
    """The same loader with no threads: a reference's own best when its reads hold the GIL (torch.load does)."""
    return sum(len(finish(prepare(item))) for item in enumerate(plan))


def sampler(gather: Callable, device: torch.device) -> tuple[Callable, Callable]:
    """(prepare, finish) of a loader that stores mean + std and draws latent = mean + std * eps where the trainer
    draws it (tuneline.stages.train.loop.samples_in_feed), from the micro-batch's generator on the training device."""

    def prepare(item):
        i, (bucket, rows) = item
        mean, std = gather(bucket, rows)
        return sample_latents(mean, std, torch.Generator(device).manual_seed(i)) if in_feed else (i, mean, std)

    def finish(x):
        return x if in_feed else sample_latents(x[1], x[2], torch.Generator(device).manual_seed(x[0]))

    in_feed = samples_in_feed(device)
    return prepare, finish


def ours(reader: LatentReader, device: torch.device) -> tuple[Callable, Callable]:
    """The trainer's path (tuneline.stages.train.loop.Trainer.prepare / micro_step): block reads, pinned for a GPU."""
    return sampler(lambda bucket, rows: reader.gather(reader.batch(bucket, rows), pin=device.type == "cuda"), device)


def limit(arrays, device: torch.device) -> tuple[Callable, Callable]:
    """Rows gathered from contiguous memory-mapped arrays, sampled the same way."""

    def gather(bucket, rows):
        idx = np.sort(rows)
        return tuple(torch.from_numpy(np.ascontiguousarray(a[idx])) for a in arrays[bucket])

    return sampler(gather, device)


def files(load: Callable, root: Path, device: torch.device) -> tuple[Callable, Callable]:
    """A per-image layout: its stored latent (one fixed draw) per file, stacked, in float32 on the device."""

    def prepare(item):
        _, (bucket, rows) = item
        batch = load(root, bucket, rows)
        return batch.float() if device.type == "cpu" else batch  # the CPU side of the conversion, as ours

    return prepare, lambda batch: batch.to(device, non_blocking=True).float()


def write_mmap(root: Path, data: dict[str, np.ndarray]) -> dict[str, tuple[np.memmap, np.memmap]]:
    out = {}
    for key, mean in data.items():
        std = (np.abs(mean) * 0.01 + 1e-3).astype(np.float16)
        arrays = []
        for name, values in (("mean", mean), ("std", std)):
            m = np.lib.format.open_memmap(root / f"{key}-{name}.npy", mode="w+", dtype=values.dtype, shape=values.shape)
            m[:] = values
            m.flush()
            arrays.append(np.load(root / f"{key}-{name}.npy", mmap_mode="r"))
        out[key] = (arrays[0], arrays[1])
    return out


def load_pt(root: Path, bucket: str, rows) -> torch.Tensor:
    return torch.stack([torch.load(root / "pt" / bucket / f"{r}.pt", weights_only=True) for r in rows])


def load_npz(root: Path, bucket: str, rows) -> torch.Tensor:
    arrays = []
    for r in rows:
        with np.load(root / "npz" / bucket / f"{r}.npz") as z:
            arrays.append(z["latents"])
    return torch.from_numpy(np.stack(arrays))


def main() -> None:
    torch.set_num_threads(1)  # every loader runs in the trainer's process; keep BLAS threads out of the race
    tmp = Path(tempfile.mkdtemp(prefix="tuneline-bench-loader-"))
    try:
        rng = np.random.default_rng(0)
        data = {
            k: rng.standard_normal((PER_BUCKET, *s), dtype=np.float32).astype(np.float16) for k, s in BUCKETS.items()
        }
        reader = write_ours(tmp / "ours", data)
        write_files(tmp, data)
        mapped = write_mmap(tmp, data)
        plan = epoch_plan(reader.counts(), BATCH, 1, seed=0, epoch=0, block_rows=BLOCK_ROWS)
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        workers = feed_workers(reader, dev)
        loaders = {
            "ours": ours(reader, dev),
            "mmap": limit(mapped, dev),
            "pt": files(load_pt, tmp, dev),
            "npz": files(load_npz, tmp, dev),
        }
        # Ours runs as training runs it; each reference runs both through the same feed and synchronously, and its
        # better way counts (the GIL makes a thread pool slower for loaders whose reads are Python work).
        runs = [("ours", "feed")] + [(name, way) for name in ("mmap", "pt", "npz") for way in ("feed", "sync")]
        rate = dict.fromkeys(runs, 0.0)
        for _ in range(ROUNDS):
            for name, way in runs:
                prepare, finish = loaders[name]
                t = time.perf_counter()
                n = (
                    through_feed(plan, prepare, finish, workers)
                    if way == "feed"
                    else synchronous(plan, prepare, finish)
                )
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)  # the copies and draws queued on the GPU are part of the work
                rate[name, way] = max(rate[name, way], n / (time.perf_counter() - t))
        report(rate, dev, workers)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(rate: dict[tuple[str, str], float], device: torch.device, workers: int) -> None:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"{PER_BUCKET * len(BUCKETS)} latents in {len(BUCKETS)} buckets (4x64x64 class, float16), batch {BATCH}, "
        f"best of {ROUNDS} rounds; samples/s of float32 batches on the training device ({where}); the trainer's "
        f"feed: {workers} thread(s), {FEED_DEPTH} batches ahead"
    )
    drawn = "in the feed" if samples_in_feed(device) else "by the step, on the device"
    print(f"ours (the trainer's feed: block reads, eps drawn {drawn}): {rate['ours', 'feed']:.0f}")
    best = {"ours": rate["ours", "feed"]}
    for name, what in (
        ("mmap", "limit, memory-mapped contiguous mean + std, same eps draw"),
        ("pt", ".pt per image (SimpleTuner)"),
        ("npz", ".npz per image (kohya)"),
    ):
        feed, sync = rate[name, "feed"], rate[name, "sync"]
        best[name] = max(feed, sync)
        print(f"{what}: {feed:.0f} through the feed, {sync:.0f} synchronous; the better counts")
    r_pt, r_npz, r_mmap = (best["ours"] / best[k] for k in ("pt", "npz", "mmap"))
    print(f"loader_vs_npz {r_npz:.2f} goal >= {GOAL_NPZ} {'PASS' if r_npz >= GOAL_NPZ else 'FAIL'}")
    print(f"loader_vs_mmap_limit {r_mmap:.2f} goal >= {GOAL_MMAP} {'PASS' if r_mmap >= GOAL_MMAP else 'FAIL'}")
    print(f"RESULT loader_speedup_vs_pt {r_pt:.2f} goal >= {GOAL_PT} {'PASS' if r_pt >= GOAL_PT else 'FAIL'}")


if __name__ == "__main__":
    main()
