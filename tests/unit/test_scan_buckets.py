"""Small-bucket policy, duplicates and the bucket table (pure functions)."""

from __future__ import annotations

import pytest

from tuneline.schemas.config import PipelineConfig
from tuneline.schemas.scan import ImageRecord
from tuneline.stages.scan.buckets import (
    NoBatchError,
    apply_plan,
    bucket_plan,
    duplicate_groups,
    reject_duplicates,
    table,
)


def rec(path: str, bucket=(64, 64), sha="x") -> ImageRecord:
    return ImageRecord(
        path=path,
        width=100,
        height=100,
        bucket_width=bucket[0],
        bucket_height=bucket[1],
        crop=(0, 0, 100, 100),
        caption="",
        sha256=sha,
        size_bytes=1,
        mtime_ns=0,
    )


def test_global_batch_is_batch_times_processes():
    cfg = PipelineConfig.model_validate({"train": {"batch_size": 3, "processes": 2}})
    assert cfg.train.global_batch() == 6


def test_two_nodes_double_the_global_batch_and_the_bucket_plan_sees_it():
    """The scan plans buckets with every node's ranks: a bucket that forms a batch on one node of 2 processes x
    batch 2 (4) cannot on two such nodes (8), and is dropped (or repeated to 8) there."""
    from tuneline.stages.scan.core import stage_config

    one = PipelineConfig.model_validate(
        {"train": {"batch_size": 2, "processes": 2, "grad_accumulation": 3}, "buckets": {"small_bucket": "drop"}}
    )
    two = PipelineConfig.model_validate(
        {
            "train": {
                "batch_size": 2,
                "processes": 2,
                "grad_accumulation": 3,
                "nodes": 2,
                "rdzv_endpoint": "node0:29500",
            },
            "buckets": {"small_bucket": "drop"},
        }
    )
    assert (one.train.global_batch(), two.train.global_batch()) == (4, 8)
    assert two.train.global_batch(per_step=True) == 24 and two.train.global_batch(world=2, per_step=True) == 12
    counts = {(64, 64): 10, (96, 64): 6}
    assert bucket_plan(counts, one.train.global_batch(), "drop") == {(64, 64): 1, (96, 64): 1}
    assert bucket_plan(counts, two.train.global_batch(), "drop") == {(64, 64): 1, (96, 64): 0}
    assert bucket_plan(counts, two.train.global_batch(), "repeat") == {(64, 64): 1, (96, 64): 2}
    assert stage_config(two)["global_batch"] == 8


def test_repeat_fills_a_batch():
    assert bucket_plan({(64, 64): 20, (96, 64): 5, (64, 96): 1}, 16, "repeat") == {
        (64, 64): 1,
        (96, 64): 4,
        (64, 96): 16,
    }


def test_drop_reports_dropped_images_and_keeps_the_rest():
    records = [rec(f"big{i}.png") for i in range(4)] + [rec("small.png", (96, 64))]
    plan = bucket_plan({(64, 64): 4, (96, 64): 1}, 4, "drop")
    kept, dropped, rows = apply_plan(records, plan, 4)
    assert [r.path for r in kept] == [f"big{i}.png" for i in range(4)]
    assert [(d.path, d.kind) for d in dropped] == [("small.png", "small-bucket")]
    assert "bucket 96x64 has 1 images" in dropped[0].reason and "small_bucket" in dropped[0].reason
    assert [(r.width, r.height, r.count, r.dropped) for r in rows] == [(64, 64, 4, False), (96, 64, 1, True)]
    assert table(rows, plan)[1] == {
        "bucket": "96x64",
        "count": 1,
        "repeats": 0,
        "status": "dropped",
        "samples": "small.png",
    }


def test_no_batch_error_names_the_bucket_and_the_settings():
    with pytest.raises(NoBatchError, match=r"batch of 16.*largest, 96x64, has 7 images.*small_bucket: repeat"):
        bucket_plan({(64, 64): 3, (96, 64): 7}, 16, "drop")
    with pytest.raises(NoBatchError, match="no image was accepted"):
        bucket_plan({}, 16, "repeat")


def test_duplicates_grouped_and_optionally_rejected():
    records = [rec("a.png", sha="1"), rec("b.png", sha="2"), rec("c.png", sha="1"), rec("d/a.png", sha="1")]
    groups = duplicate_groups(records)
    assert groups == [["a.png", "c.png", "d/a.png"]]
    kept, rejected = reject_duplicates(records, groups)
    assert [r.path for r in kept] == ["a.png", "b.png"]
    assert [(r.path, r.kind) for r in rejected] == [("c.png", "duplicate"), ("d/a.png", "duplicate")]
    assert "same content as a.png" in rejected[0].reason


def test_duplicates_across_folders_name_the_folder_and_keep_the_other_folders_same_name():
    """dataset.sources: folder 1's copy of folder 0's b.png is the duplicate; folder 1's own a.png is not touched
    although folder 0 has a different a.png."""
    records = [
        rec("a.png", sha="1").model_copy(update={"source": 0}),
        rec("b.png", sha="2").model_copy(update={"source": 0}),
        rec("a.png", sha="3").model_copy(update={"source": 1}),
        rec("c.png", sha="2").model_copy(update={"source": 1}),
    ]
    groups = duplicate_groups(records)
    assert groups == [["0//b.png", "1//c.png"]]
    kept, rejected = reject_duplicates(records, groups)
    assert [r.ref for r in kept] == ["0//a.png", "0//b.png", "1//a.png"]
    assert [r.path for r in rejected] == ["1//c.png"]
