"""The training reader over a hand-built cache: epoch plans, block reads, checks, sampling, prefetch."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.records import write_latents
from tuneline.schemas.latents import LatentsManifest
from tuneline.stages.latents import store
from tuneline.stages.latents.reader import WINDOW_BLOCKS, Batch, LatentReader, ReaderError, block_shuffle, epoch_plan

SHAPES = {"64x64": (4, 8, 8), "96x64": (4, 8, 12)}
COUNTS = {"64x64": 21, "96x64": 9}
BLOCK = 4


def make_cache(root: Path, flip: bool = False, counts: dict | None = None) -> tuple[LatentsManifest, dict]:
    """A cache laid out exactly as the stage writes it, with known values per row."""
    counts = counts or COUNTS
    rng = np.random.default_rng(0)
    values = {}
    for key, n in counts.items():
        data = {name: rng.standard_normal((n, *SHAPES[key])).astype(np.float16) for name in store.array_names(flip)}
        data["std"] = np.abs(data["std"])
        values[key] = data
    return write_latents(root, values, BLOCK, flip=flip), values


# Plans -----------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), block=st.integers(1, 40), window=st.integers(1, 6), seed=st.integers(0, 10))
def test_block_shuffle_is_a_permutation_local_to_windows(n, block, window, seed):
    perm = block_shuffle(n, block, window, np.random.default_rng(seed))
    assert sorted(perm.tolist()) == list(range(n))
    blocks = (perm // block).tolist()
    first = {b: blocks.index(b) for b in set(blocks)}
    last = {b: len(blocks) - 1 - blocks[::-1].index(b) for b in set(blocks)}
    for pos in range(n):  # a reader holding `window` blocks sees every block's rows while it holds it
        assert sum(first[b] <= pos <= last[b] for b in first) <= window


@settings(max_examples=60, deadline=None)
@given(
    counts=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 120), min_size=1),
    bs=st.integers(1, 6),
    world=st.integers(1, 3),
    seed=st.integers(0, 5),
    epoch=st.integers(0, 3),
)
def test_epoch_plan_shards_ranks_disjointly_and_covers_buckets(counts, bs, world, seed, epoch):
    plan = epoch_plan(counts, bs, world, seed, epoch, block_rows=8)
    again = epoch_plan(counts, bs, world, seed, epoch, block_rows=8)
    assert [(b, r.tolist()) for b, r in plan] == [(b, r.tolist()) for b, r in again]  # every rank agrees
    gb = bs * world
    seen: dict[str, list[int]] = {b: [] for b in counts}
    for bucket, rows in plan:
        assert len(rows) == gb and rows.max() < counts[bucket]
        seen[bucket] += rows.tolist()
    for bucket, n in counts.items():
        if n >= gb:  # no row twice in an epoch, so ranks never share one; at most a remainder sits out
            assert len(seen[bucket]) == len(set(seen[bucket])) and n - len(seen[bucket]) < gb
        elif n:  # too small: repeated to fill exactly one global batch
            assert len(seen[bucket]) == gb and set(seen[bucket]) == set(range(n))


def test_epoch_plan_differs_by_epoch_and_seed():
    counts = {"a": 200, "b": 130}
    base = epoch_plan(counts, 4, 2, 0, 0)
    for other in (epoch_plan(counts, 4, 2, 0, 1), epoch_plan(counts, 4, 2, 1, 0)):
        assert [(b, r.tolist()) for b, r in base] != [(b, r.tolist()) for b, r in other]


def test_each_block_is_read_once_per_epoch_with_the_readers_cache():
    counts = {"a": 1000, "b": 700, "c": 64}
    block = 16
    reads = 0
    caches: dict[str, OrderedDict] = {b: OrderedDict() for b in counts}
    for bucket, rows in epoch_plan(counts, 8, 2, seed=3, epoch=0, block_rows=block):
        cache = caches[bucket]
        for b in np.unique(rows // block):
            if b not in cache:
                reads += 1
                cache[b] = True
                while len(cache) > 2 * WINDOW_BLOCKS:
                    cache.popitem(last=False)
            cache.move_to_end(b)
    assert reads == sum(-(-n // block) for n in counts.values())


# Reading ---------------------------------------------------------------------------------------------
def test_reader_returns_rows_and_samples_mean_plus_std_eps(tmp_path):
    manifest, values = make_cache(tmp_path)
    reader = LatentReader(tmp_path, manifest)
    assert reader.counts() == COUNTS
    batch = reader.batch("64x64", np.array([20, 0, 5, 13]))
    assert batch.paths == ("64x64/020.png", "64x64/000.png", "64x64/005.png", "64x64/013.png")
    mean, std = reader.gather(batch)
    np.testing.assert_array_equal(mean.numpy(), values["64x64"]["mean"][[20, 0, 5, 13]])
    np.testing.assert_array_equal(std.numpy(), values["64x64"]["std"][[20, 0, 5, 13]])
    x = reader.sample(batch, torch.Generator().manual_seed(7))
    eps = torch.randn(mean.shape, generator=torch.Generator().manual_seed(7))
    assert x.dtype == torch.float32 and x.shape == (4, 4, 8, 8)
    torch.testing.assert_close(x, mean.float() + std.float() * eps)


def test_flipped_rows_come_from_the_flip_arrays(tmp_path):
    manifest, values = make_cache(tmp_path, flip=True)
    reader = LatentReader(tmp_path, manifest)
    mean, _ = reader.gather(reader.batch("96x64", np.array([1, 2, 8]), flip=[True, False, True]))
    v = values["96x64"]
    np.testing.assert_array_equal(mean.numpy(), np.stack([v["flip_mean"][1], v["mean"][2], v["flip_mean"][8]]))
    plain, _ = make_cache(tmp_path / "plain")
    with pytest.raises(ReaderError, match="no flipped variant"):
        LatentReader(tmp_path / "plain", plain).batch("64x64", np.array([0]), flip=[True])


def test_open_refuses_a_cache_that_disagrees_with_its_manifest(tmp_path):
    manifest, _ = make_cache(tmp_path)
    wrong = manifest.model_copy(deep=True)
    wrong.buckets[0].shape = (4, 8, 16)
    with pytest.raises(ReaderError, match=r"bucket 64x64 array mean is \(21, 4, 8, 8\).*manifest says"):
        LatentReader(tmp_path, wrong)
    lines = (tmp_path / store.INDEX).read_text().splitlines()
    (tmp_path / store.INDEX).write_text("\n".join(lines[1:]) + "\n")
    with pytest.raises(ReaderError, match="index lacks 64x64 row 0"):
        LatentReader(tmp_path, manifest)


def test_open_refuses_compressed_arrays(tmp_path):
    manifest, _ = make_cache(tmp_path, counts={"64x64": 3})
    import zarr

    group = zarr.open_group(str(tmp_path / store.STORE / "64x64"), mode="a")
    group.create_array("std", shape=(3, 4, 8, 8), chunks=(BLOCK, 4, 8, 8), dtype="float16", overwrite=True)
    with pytest.raises(ReaderError, match="cannot be read block-wise: its codecs"):
        LatentReader(tmp_path, manifest)


def test_a_later_epoch_reads_no_block_again_and_maps_hold_no_descriptors(tmp_path, monkeypatch):
    manifest, values = make_cache(tmp_path, counts={"64x64": 200})  # 50 blocks of 4 rows
    reader = LatentReader(tmp_path, manifest)
    reads = []
    real = store.read_chunk
    monkeypatch.setattr(store, "read_chunk", lambda arr, block: reads.append(block) or real(arr, block))
    descriptors = len(os.listdir("/proc/self/fd"))
    for epoch in range(2):
        for bucket, rows in reader.plan(8, 1, seed=0, epoch=epoch):
            mean, std = reader.gather(reader.batch(bucket, rows))
            np.testing.assert_array_equal(mean.numpy(), values[bucket]["mean"][rows])
            np.testing.assert_array_equal(std.numpy(), values[bucket]["std"][rows])
    assert sorted(reads) == sorted(list(range(50)) * 2)  # each block once per array (mean, std), in epoch 0 only
    assert len(os.listdir("/proc/self/fd")) <= descriptors + 2  # 100 maps kept, no file left open for them


def test_per_batch_checks_name_the_problem(tmp_path):
    manifest, _ = make_cache(tmp_path)
    reader = LatentReader(tmp_path, manifest)
    with pytest.raises(ReaderError, match="rows 0..8"):
        reader.gather(Batch("96x64", (9,), ("x",)))
    chunk = tmp_path / store.STORE / "64x64" / "mean" / "c" / "1" / "0" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-2])  # truncated after the manifest was written
    with pytest.raises(ReaderError, match=r"bucket 64x64 block 1: chunk file .* \(truncated"):
        reader.gather(reader.batch("64x64", np.array([5])))
