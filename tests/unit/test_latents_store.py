"""The cache layout and the block writer, with a stand-in encoder: resume, rejects, reuse, checks."""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import zarr
from PIL import Image

from tests.records import image_record
from tuneline.stages.common.jsonl import write_jsonl
from tuneline.stages.latents import store
from tuneline.stages.latents.encode import LatentShapeError, check_latents
from tuneline.stages.latents.reuse import PreviousRows, row_identity, row_key
from tuneline.stages.latents.writer import NO_REUSE, BucketJob, BucketWriter, Settings, fill_blocks

SHAPE = (4, 2, 2)
IDENTITY = row_identity("vae", "float32", "float16", False)


def corrupt_png(size=(16, 16)) -> bytes:
    """A PNG whose header and end marker are fine but whose pixel stream is not (the scan accepts it)."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    at = data.find(b"IDAT") + 20
    data[at : at + 40] = bytes(b ^ 0x5A for b in data[at : at + 40])
    return bytes(data)


def make_job(root: Path, n: int, bad: tuple[int, ...] = ()) -> BucketJob:
    records = []
    for i in range(n):
        path = root / f"img{i:02d}.png"
        if i in bad:
            path.write_bytes(corrupt_png())
        else:
            Image.new("RGB", (16, 16), (i * 9 % 256, 40, 200)).save(path)
        records.append(image_record(path.name, (16, 16), path))
    return BucketJob(
        key="16x16", width=16, height=16, shape=SHAPE, records=records, row_keys=[row_key(r, IDENTITY) for r in records]
    )


class FakeEncoder:
    """Deterministic per image, counts the images it encodes; can fail after a number of batches."""

    def __init__(self, fail_after: int | None = None):
        self.calls, self.images, self.fail_after = 0, 0, fail_after

    def __call__(self, pixels, paths, expected):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("killed")
        self.calls += 1
        self.images += len(paths)
        mean = np.stack([np.full(expected, float(p.mean()), np.float16) for p in pixels])
        return {"mean": mean, "std": np.abs(mean) * np.float16(0.1) + np.float16(0.01)}

    def submit(self, pixels, paths, expected):
        out = self(pixels, paths, expected)
        return lambda: out


class Known(dict):
    """Rows known by key, none of them shareable as a block (the writer's Reuse protocol)."""

    def rows(self, key):
        return self[key]

    def link(self, keys, block_rows):
        return None


def run(tmp: Path, job: BucketJob, encoder, reuse=NO_REUSE, work: str = "work"):
    s = Settings(roots={None: tmp}, work=tmp / work, dtype="float16", block_rows=4, batch_size=3, names=store.DIST)
    writer = BucketWriter(s, job)
    start = writer.resume()
    with ThreadPoolExecutor(2) as pool:
        return start, fill_blocks(writer, start, encoder, reuse, pool, lambda n: None).finish()


def stored(tmp: Path, work: str = "work") -> np.ndarray:
    return zarr.open_group(str(tmp / work / store.STORE / "16x16"), mode="r")["mean"][:]


def published(tmp: Path, out, work: str = "work") -> PreviousRows:
    """A finished build as the next build sees the previous version."""
    write_jsonl(tmp / work / store.INDEX, out.index)
    return PreviousRows(tmp / work, SimpleNamespace(block_rows=4, fingerprint="previous"), store.DIST)


def chunk_inodes(tmp: Path, work: str) -> list[int]:
    folder = tmp / work / store.STORE / "16x16" / "mean" / "c"
    return [os.stat(folder / str(b) / "0" / "0" / "0").st_ino for b in range(len(os.listdir(folder)))]


def test_writes_blocks_in_path_order_and_rejects_undecodable_images(tmp_path):
    job = make_job(tmp_path, 10, bad=(3,))
    enc = FakeEncoder()
    _, out = run(tmp_path, job, enc)
    assert [r["path"] for r in out.index] == [f"img{i:02d}.png" for i in range(10) if i != 3]
    assert [r["row"] for r in out.index] == list(range(9)) and out.encoded == 9 == enc.images
    assert [(r.path, r.kind) for r in out.rejected] == [("img03.png", "decode")]
    assert "cannot decode at caching time" in out.rejected[0].reason
    assert stored(tmp_path).shape == (9, *SHAPE)  # trimmed: the rejected image leaves no hole
    assert [len(r["paths"]) for r in store.read_records(tmp_path / "work", "16x16")] == [4, 4, 1]


def test_resume_keeps_finished_blocks_and_matches_an_uninterrupted_build(tmp_path):
    job = make_job(tmp_path, 11, bad=(2,))
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, job, FakeEncoder(fail_after=4))  # 2 batches per block: dies in the third
    assert len(store.read_records(tmp_path / "work", "16x16")) == 2
    enc = FakeEncoder()
    start, out = run(tmp_path, job, enc)
    assert start == 9 and out.resumed == 8 and enc.images == 2  # 8 rows + 1 reject resumed, nothing else redone
    clean = tmp_path / "clean"
    clean.mkdir()
    _, ref = run(clean, make_job(clean, 11, bad=(2,)), FakeEncoder())
    np.testing.assert_array_equal(stored(tmp_path), stored(clean))
    assert [r["path"] for r in out.index] == [r["path"] for r in ref.index] and len(out.rejected) == 1


def test_a_finished_bucket_trimmed_by_its_rejects_is_resumed_whole(tmp_path):
    job = make_job(tmp_path, 7, bad=(1,))
    run(tmp_path, job, FakeEncoder())  # as if killed later, in another bucket, before publishing
    enc = FakeEncoder()
    start, out = run(tmp_path, job, enc)
    assert start == 7 and enc.images == 0 and out.resumed == 6 and stored(tmp_path).shape[0] == 6


def test_a_block_without_record_or_with_a_bad_digest_is_redone(tmp_path):
    job = make_job(tmp_path, 12)
    run(tmp_path, job, FakeEncoder())
    work = tmp_path / "work"
    (work / store.BLOCKS / "16x16" / "000002.json").unlink()  # killed between the chunk write and its record
    enc = FakeEncoder()
    assert run(tmp_path, job, enc)[0] == 8 and enc.images == 4
    arr = zarr.open_group(str(work / store.STORE / "16x16"), mode="a")["mean"]
    arr[5] = np.zeros(SHAPE, np.float16)  # block 1 edited: it and every later block are redone
    enc = FakeEncoder()
    start, out = run(tmp_path, job, enc)
    assert start == 4 and enc.images == 8 and out.resumed == 4


def test_rows_with_a_known_key_are_copied_not_encoded(tmp_path):
    job = make_job(tmp_path, 6)
    known = {
        job.row_keys[i]: {"mean": np.full(SHAPE, i, np.float16), "std": np.ones(SHAPE, np.float16)} for i in (0, 1, 4)
    }
    enc = FakeEncoder()
    _, out = run(tmp_path, job, enc, reuse=Known(known))
    assert out.reused == 3 and out.encoded == 3 == enc.images
    np.testing.assert_array_equal(stored(tmp_path)[4], np.full(SHAPE, 4, np.float16))


def test_unchanged_blocks_share_the_previous_versions_chunk_files(tmp_path):
    job = make_job(tmp_path, 10)  # blocks of 4: rows 0-3, 4-7, 8-9
    _, first = run(tmp_path, job, FakeEncoder())
    previous = published(tmp_path, first)
    grown = make_job(tmp_path, 14)  # img10..13 sort last: blocks 0 and 1 are unchanged, block 2 gains rows
    enc = FakeEncoder()
    _, out = run(tmp_path, grown, enc, reuse=previous, work="next")
    assert enc.images == 4 and (out.encoded, out.reused) == (4, 10)
    assert chunk_inodes(tmp_path, "next")[:2] == chunk_inodes(tmp_path, "work")[:2]  # linked, not rewritten
    assert chunk_inodes(tmp_path, "next")[2] != chunk_inodes(tmp_path, "work")[2]
    clean = tmp_path / "clean"
    clean.mkdir()
    _, ref = run(clean, make_job(clean, 14), FakeEncoder())
    np.testing.assert_array_equal(stored(tmp_path, "next"), stored(clean))
    assert store.read_records(tmp_path / "next", "16x16") == store.read_records(clean / "work", "16x16")
    enc = FakeEncoder()  # the records of linked blocks verify: a rerun resumes every block
    start, again = run(tmp_path, grown, enc, reuse=previous, work="next")
    assert start == 14 and enc.images == 0 and again.resumed == 14
    before = stored(tmp_path).copy()  # a linked block written again (a redone block) leaves the old version alone
    arrays = store.create_arrays(tmp_path / "next", "16x16", SHAPE, 14, "float16", 4, store.DIST)
    store.write_block(arrays, 0, {name: np.full((4, *SHAPE), 7, np.float16) for name in store.DIST})
    np.testing.assert_array_equal(stored(tmp_path), before)
    assert (stored(tmp_path, "next")[:4] == 7).all()


def test_an_unchanged_bucket_links_every_block_the_short_last_one_too(tmp_path):
    job = make_job(tmp_path, 10)  # blocks of 4, 4 and 2 rows
    _, first = run(tmp_path, job, FakeEncoder())
    enc = FakeEncoder()
    _, out = run(tmp_path, make_job(tmp_path, 10), enc, reuse=published(tmp_path, first), work="next")
    assert enc.images == 0 and out.reused == 10
    assert chunk_inodes(tmp_path, "next") == chunk_inodes(tmp_path, "work")
    np.testing.assert_array_equal(stored(tmp_path, "next"), stored(tmp_path))


def test_a_shifted_or_partly_rejected_block_is_copied_row_by_row(tmp_path):
    job = make_job(tmp_path, 8)
    _, first = run(tmp_path, job, FakeEncoder())
    previous = published(tmp_path, first)
    (tmp_path / "img00.png").write_bytes(corrupt_png())  # now rejected: every later row moves up by one
    moved = make_job(tmp_path, 8, bad=(0,))
    moved.records[1:] = job.records[1:]
    moved.row_keys[1:] = job.row_keys[1:]
    enc = FakeEncoder()
    _, out = run(tmp_path, moved, enc, reuse=previous, work="next")
    assert enc.images == 0 and out.reused == 7 and [r.path for r in out.rejected] == ["img00.png"]
    assert not set(chunk_inodes(tmp_path, "next")) & set(chunk_inodes(tmp_path, "work"))
    np.testing.assert_array_equal(stored(tmp_path, "next"), stored(tmp_path)[1:])


def test_row_key_covers_content_bucket_crop_and_identity(tmp_path):
    rec = make_job(tmp_path, 1).records[0]
    base = row_key(rec, IDENTITY)
    assert base == row_key(rec.model_copy(update={"mtime_ns": 5, "caption": "x"}), IDENTITY)  # not content
    changes = [
        rec.model_copy(update={"sha256": "0" * 64}),
        rec.model_copy(update={"crop": (1, 0, 16, 16)}),
        rec.model_copy(update={"bucket_width": 24}),
        rec.model_copy(update={"background": (0, 0, 0)}),
    ]
    assert all(row_key(r, IDENTITY) != base for r in changes)
    others = [
        ("other", "float32", "float16", False),
        ("vae", "bfloat16", "float16", False),
        ("vae", "float32", "float32", False),
        ("vae", "float32", "float16", True),
    ]
    assert all(row_key(rec, row_identity(*o)) != base for o in others)


def test_check_latents_names_the_image():
    good = {"mean": np.zeros((2, *SHAPE), np.float16), "std": np.ones((2, *SHAPE), np.float16)}
    check_latents(good, SHAPE, ["a.png", "b.png"])
    with pytest.raises(LatentShapeError, match=r"image b.png: expected \(4, 2, 2\), got \(4, 2, 3\)"):
        check_latents({"mean": np.zeros((2, 4, 2, 3), np.float16)}, SHAPE, ["b.png", "b.png"])
    bad = dict(good, std=good["std"].copy())
    bad["std"][1, 0, 0, 0] = np.float16(np.inf)  # e.g. a float32 value beyond float16's range
    with pytest.raises(LatentShapeError, match=r"NaN/Inf latent std for image b.png \(stored as float16\)"):
        check_latents(bad, SHAPE, ["a.png", "b.png"])
    flipped = {"flip_mean": np.full((1, *SHAPE), np.nan, np.float32)}
    with pytest.raises(LatentShapeError, match=r"image a.png \(flipped\)"):
        check_latents(flipped, SHAPE, ["a.png"])


def test_chunks_are_whole_blocks_and_read_back_directly(tmp_path):
    arrays = store.create_arrays(tmp_path, "8x8", (1, 1, 1), 6, "float16", 4, store.DIST)
    data = np.arange(6, dtype=np.float16).reshape(6, 1, 1, 1)
    store.write_block(arrays, 0, {"mean": data[:4], "std": data[:4]})
    store.write_block(arrays, 1, {"mean": data[4:], "std": data[4:]})
    assert store.raw_layout_problem(arrays["mean"]) is None
    np.testing.assert_array_equal(store.read_chunk(arrays["mean"], 1), data[4:])
    again = store.create_arrays(tmp_path, "8x8", (1, 1, 1), 6, "float16", 4, store.DIST)  # same layout: kept
    np.testing.assert_array_equal(store.read_arrays(again, 0, 6)["mean"], data)
    store.trim(again, 5)
    assert store.read_chunk(again["mean"], 1).shape == (1, 1, 1, 1)
    fresh = store.create_arrays(tmp_path, "8x8", (1, 1, 1), 6, "float32", 4, store.DIST)  # other layout: new
    assert fresh["mean"].dtype == np.float32
    assert not zarr.open_group(str(tmp_path / store.STORE / "8x8"), mode="r")["mean"][:].any()


def test_chunk_files_are_the_ones_zarr_writes_and_zarr_reads_them(tmp_path):
    """write_block follows the Zarr v3 specification byte for byte: the files equal zarr's own for the same data
    (a short last block padded with the fill value), and zarr's public API reads the store back."""
    data = np.random.default_rng(0).standard_normal((7, 2, 3, 3)).astype(np.float16)
    ours = store.create_arrays(tmp_path / "ours", "24x24", (2, 3, 3), 7, "float16", 4, ("mean",))
    store.write_block(ours, 0, {"mean": data[:4]})
    store.write_block(ours, 1, {"mean": data[4:]})
    theirs = (
        zarr.open_group(str(tmp_path / "zarr" / store.STORE), mode="a")
        .require_group("24x24")
        .create_array(
            "mean",
            shape=data.shape,
            chunks=(4, 2, 3, 3),
            dtype="float16",
            compressors=None,
            fill_value=0,
            config={"write_empty_chunks": True},
        )
    )
    theirs[:] = data
    for block in (0, 1):
        key = ours["mean"].chunk_key(block)
        assert key == f"c/{block}/0/0/0"
        mine = (tmp_path / "ours" / store.STORE / "24x24" / "mean" / key).read_bytes()
        assert mine == (tmp_path / "zarr" / store.STORE / "24x24" / "mean" / key).read_bytes()
    np.testing.assert_array_equal(zarr.open_group(str(tmp_path / "ours" / store.STORE / "24x24"))["mean"][:], data)
    assert not list((tmp_path / "ours").rglob("*" + store.PARTIAL))


def test_write_block_replaces_a_chunk_file_and_never_writes_into_it(tmp_path):
    """A chunk file another version shares by a hard link keeps its bytes when this version rewrites the block."""
    arrays = store.create_arrays(tmp_path, "8x8", (1, 1, 1), 4, "float16", 4, ("mean",))
    store.write_block(arrays, 0, {"mean": np.ones((4, 1, 1, 1), np.float16)})
    chunk = tmp_path / store.STORE / "8x8" / "mean" / "c" / "0" / "0" / "0" / "0"
    shared = tmp_path / "shared"
    os.link(chunk, shared)
    store.write_block(arrays, 0, {"mean": np.full((4, 1, 1, 1), 2, np.float16)})
    assert np.frombuffer(shared.read_bytes(), np.float16).tolist() == [1, 1, 1, 1]
    assert store.read_chunk(arrays["mean"], 0).ravel().tolist() == [2, 2, 2, 2]


def test_block_records_stop_at_the_first_gap(tmp_path):
    for i in (0, 1, 3):
        store.write_record(tmp_path, "b", i, {"i": i})
    assert [r["i"] for r in store.read_records(tmp_path, "b")] == [0, 1]
    (tmp_path / store.BLOCKS / "b" / "000001.json").write_text("{torn")
    assert [r["i"] for r in store.read_records(tmp_path, "b")] == [0]
    store.drop_records(tmp_path, "b", 1)
    assert sorted(p.name for p in (tmp_path / store.BLOCKS / "b").iterdir()) == ["000000.json"]


class LoggedEncoder(FakeEncoder):
    """Logs when each batch starts and when its arrays are taken."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def submit(self, pixels, paths, expected):
        n = self.calls
        self.log.append(("start", n))
        out = self(pixels, paths, expected)
        return lambda: self.log.append(("take", n)) or out


def test_the_next_batch_starts_before_the_last_ones_arrays_are_taken(tmp_path):
    log = []
    _, out = run(tmp_path, make_job(tmp_path, 8), LoggedEncoder(log))
    # blocks of 4 rows in batches of 3: each block's first batch is in flight while the host takes nothing
    assert log == [("start", 0), ("start", 1), ("take", 0), ("take", 1)] + [
        ("start", 2), ("start", 3), ("take", 2), ("take", 3)
    ]  # fmt: skip
    assert out.encoded == 8


def test_a_block_is_written_while_the_next_block_encodes(tmp_path, monkeypatch):
    """The first block's write waits until the encoder starts a batch of the second block: written in line, it
    would wait alone for its minute and the check fail."""
    log, encoding_on = [], threading.Event()
    write_block = store.write_block

    def slow_write(arrays, block, data):
        if block == 0:
            log.append(("next block started while writing", encoding_on.wait(timeout=60)))
        write_block(arrays, block, data)

    class Signals(LoggedEncoder):
        def submit(self, pixels, paths, expected):
            if self.calls == 2:  # the second block's first batch
                encoding_on.set()
            return super().submit(pixels, paths, expected)

    monkeypatch.setattr(store, "write_block", slow_write)
    _, out = run(tmp_path, make_job(tmp_path, 10), Signals(log))
    assert ("next block started while writing", True) in log
    clean = tmp_path / "clean"
    clean.mkdir()
    run(clean, make_job(clean, 10), FakeEncoder())
    np.testing.assert_array_equal(stored(tmp_path), stored(clean))  # the same bytes as written in turn
    assert store.read_records(tmp_path / "work", "16x16") == store.read_records(clean / "work", "16x16")


def test_a_failed_block_write_fails_the_build_and_keeps_the_blocks_before_it(tmp_path, monkeypatch):
    write_block = store.write_block

    def disk_full(arrays, block, data):
        if block == 1:
            raise OSError(28, "No space left on device")
        write_block(arrays, block, data)

    monkeypatch.setattr(store, "write_block", disk_full)
    with pytest.raises(OSError, match="No space left"):
        run(tmp_path, make_job(tmp_path, 10), FakeEncoder())
    assert [r["start"] for r in store.read_records(tmp_path / "work", "16x16")] == [0]  # block 1 never counted
    monkeypatch.setattr(store, "write_block", write_block)
    enc = FakeEncoder()
    start, out = run(tmp_path, make_job(tmp_path, 10), enc)
    assert start == 4 and enc.images == 6 and len(out.index) == 10
