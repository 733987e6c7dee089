"""Shard members read together (stages/scan/members.py): ranges merged into few sequential reads, each member's
bytes exactly its own."""

from __future__ import annotations

import tarfile

import webdataset as wds

from tuneline.stages.scan.members import GAP, coalesce, read_ranges


def test_ranges_close_together_are_one_read_and_far_ones_apart():
    assert coalesce([(10, 5), (0, 10), (16, 4)]) == [(0, 20)]  # sorted, small gaps bridged
    assert coalesce([(0, 10), (10 + GAP, 5)]) == [(0, 10), (10 + GAP, 15 + GAP)]
    assert coalesce([(0, 10), (10, 10)], most=15) == [(0, 10), (10, 20)]  # a read stays under `most` bytes


def test_members_read_together_are_each_their_own_bytes(tmp_path):
    samples = {f"k{i}": bytes([i]) * (100 + 37 * i) for i in range(5)}
    with wds.TarWriter(str(tmp_path / "000000.tar")) as sink:
        for key, data in samples.items():
            sink.write({"__key__": key, "bin": data})
    with tarfile.open(tmp_path / "000000.tar") as tf:
        spans = [("000000.tar", m.offset_data, m.size) for m in tf.getmembers()]
    got = read_ranges(tmp_path, spans[::2] + spans[1::2])
    assert [got["000000.tar", offset] for _, offset, _ in spans] == list(samples.values())
