"""The data options (masks, held-out eval, multi-resolution) are refused at load naming their fields."""

from __future__ import annotations

from tests.unit.test_config_checks import refused
from tuneline.schemas.config import parse_config


def test_masked_loss_needs_masks():
    refused({"train": {"masked_loss": True}}, "train.masked_loss", "dataset.masks")


def test_eval_timesteps_must_be_in_range():
    refused({"train": {"eval": {"timesteps": [100, 1000]}}}, "train.eval.timesteps", "1000")


def test_eval_fraction_must_leave_images_to_train():
    refused({"train": {"eval": {"fraction": 1.0}}}, "train.eval.fraction")


def test_resolutions_must_be_distinct():
    refused({"buckets": {"resolution": 64, "resolutions": [64, 64]}}, "buckets.resolutions")


def test_an_empty_masks_setting_is_refused():
    refused({"dataset": {"masks": " "}}, "dataset.masks")


def test_sources_and_path_are_exclusive_and_named():
    refused({"dataset": {"sources": [{"path": "a"}]}}, "dataset.path", "dataset.sources", "exclusive")
    refused(
        {"dataset": {"path": None, "sources": [{"path": "a", "role": "regularization"}]}},
        "dataset.sources",
        "role train",
    )
    refused({"dataset": {"path": None}}, "dataset.path", "dataset.sources")
    cfg = parse_config(
        {
            "workdir": "/w",
            "dataset": {
                "path": None,
                "sources": [{"path": "a", "repeats": 3}, {"path": "b", "role": "regularization", "loss_weight": 0.5}],
            },
        }
    )
    assert [s.path for s in cfg.dataset.sources] == ["/w/a", "/w/b"]  # resolved against the workdir


def test_eval_fraction_and_path_are_exclusive():
    refused({"train": {"eval": {"fraction": 0.2, "path": "held"}}}, "train.eval.fraction", "train.eval.path")
    assert parse_config({"workdir": "/w", "train": {"eval": {"path": "held"}}}).train.eval.path == "/w/held"


def test_credentials_in_storage_options_are_refused_and_the_environment_named():
    """Configs are recorded in manifests: a secret there would be published with every version."""
    refused({"dataset": {"storage_options": {"secret": "s", "region": "x"}}}, "dataset.storage_options", "secret")
    refused(
        {"dataset": {"path": None, "sources": [{"path": "s3://b/p", "storage_options": {"aws_access_key_id": "k"}}]}},
        "dataset.sources",
        "TUNELINE_REMOTE_OPTIONS",
    )
    refused({"ops": {"remote_options": {"token": "t"}}}, "ops.remote_options", "AWS_")
    cfg = parse_config({"workdir": "/w", "dataset": {"storage_options": {"endpoint_url": "http://m", "region": "x"}}})
    assert cfg.dataset.storage_options == {"endpoint_url": "http://m", "region": "x"}


def test_a_video_family_with_the_caption_stage_is_refused_naming_both_fields():
    refused({"model": {"family": "wan"}, "caption": {"model": "tiny"}}, "caption.model", "'wan'", "clip.txt")
    assert parse_config({"workdir": "/w", "model": {"family": "wan"}}).caption.model is None
