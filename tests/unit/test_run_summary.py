"""The end-of-run summary reads the published manifests: built/reused and time, final loss, learning, paths."""

from __future__ import annotations

import json

from tuneline.flows.summary import summary_lines, timed_stage


def test_summary_names_built_reused_loss_learning_and_paths(tmp_path):
    train, validate = tmp_path / "train" / "t1", tmp_path / "validate" / "v1"
    validate.mkdir(parents=True)
    (validate / "manifest.json").write_text(
        json.dumps({"grid": "grid.png", "color_accuracy": 0.95, "class_separation_accuracy": 1.0})
    )

    def build_train():
        train.mkdir(parents=True)
        (train / "manifest.json").write_text(json.dumps({"losses": [0.9, 0.5, 0.25], "step": 1000}))
        return str(train)

    runs = {"train": timed_stage(build_train), "validate": timed_stage(lambda: str(validate))}
    assert runs["train"]["built"] and not runs["validate"]["built"]
    text = "\n".join(summary_lines(runs))
    assert "train     built" in text and "validate  reused" in text
    assert "final loss: 0.2500 (after 1000 steps)" in text  # the step count, not the averaged points
    assert "color_accuracy 0.95" in text and "class_separation_accuracy 1.0" in text
    assert f"grid: {validate / 'grid.png'}" in text and f"final weights: {train / 'final'}" in text


def test_summary_gives_the_rejected_count_and_where_the_list_is(tmp_path):
    scan = tmp_path / "scan" / "s1"
    scan.mkdir(parents=True)
    (scan / "manifest.json").write_text(json.dumps({"rejected": 3, "rejected_by_kind": {"corrupt": 2, "tiny": 1}}))
    text = "\n".join(summary_lines({"scan": {"path": str(scan), "seconds": 1.0, "built": True}}))
    assert f"rejected images (scan): 3 (corrupt 2, tiny 1), listed in {scan / 'rejected.jsonl'}" in text
