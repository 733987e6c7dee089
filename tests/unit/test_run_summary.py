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
        (train / "manifest.json").write_text(json.dumps({"losses": [0.9, 0.5, 0.3], "step": 1000}))
        losses = [1.0] * 990 + [0.2, 0.3] * 5  # the last 10 steps average 0.25
        (train / "losses.jsonl").write_text(
            "".join(json.dumps({"step": i + 1, "loss": v}) + "\n" for i, v in enumerate(losses))
        )
        return str(train)

    runs = {"train": timed_stage(build_train), "validate": timed_stage(lambda: str(validate))}
    assert runs["train"]["built"] and not runs["validate"]["built"]
    text = "\n".join(summary_lines(runs))
    assert "train     built" in text and "validate  reused" in text
    # the step lines' window over every step's loss, not the manifest's averaged points; the step count
    assert (
        "final loss: 0.2500 (training loss averaged over the last 10 steps, as the last step line; after 1000 steps)"
        in text
    )
    assert "color_accuracy 0.95" in text and "class_separation_accuracy 1.0" in text
    assert f"grid: {validate / 'grid.png'}" in text and f"final weights: {train / 'final'}" in text


def test_summary_gives_the_rejected_count_and_where_the_list_is(tmp_path):
    scan = tmp_path / "scan" / "s1"
    scan.mkdir(parents=True)
    (scan / "manifest.json").write_text(json.dumps({"rejected": 3, "rejected_by_kind": {"corrupt": 2, "tiny": 1}}))
    text = "\n".join(summary_lines({"scan": {"path": str(scan), "seconds": 1.0, "built": True}}))
    assert f"rejected images (scan): 3 (corrupt 2, tiny 1), listed in {scan / 'rejected.jsonl'}" in text


def test_final_loss_averages_the_window_of_the_step_lines():
    from tuneline.flows.summary import FINAL_WINDOW
    from tuneline.stages.train.hooks import LOG_EVERY

    assert FINAL_WINDOW == LOG_EVERY


def test_step_line_durations_read_as_people_read_them():
    from tuneline.stages.train.hooks import duration

    assert [duration(s) for s in (4.4, 185, 7620)] == ["4s", "3m05s", "2h07m"]
