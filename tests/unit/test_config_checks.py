"""Every known config conflict is refused at load, naming each field involved; unknown keys name their path."""

from __future__ import annotations

import re

import pytest
import torch

from tuneline.schemas.config import ConfigError, demo_config, parse_config
from tuneline.schemas.demo import DEMO_CONFIG


def refused(data: dict, *fields: str) -> str:
    """The error for `data`; asserts it names every one of `fields`."""
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    msg = str(info.value)
    for f in fields:
        assert f in msg, f"{f!r} not named in:\n{msg}"
    return msg


# ---- section schemas -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "fp8"])
def test_fp8_weights_are_refused_with_the_reason(dtype):
    msg = refused({"model": {"dtype": dtype}}, "model.dtype", dtype)
    assert "not implemented for Float8" in msg and "bfloat16" in msg


def test_the_fp8_reason_still_holds_in_this_torch():
    """The refusal rests on these kernels missing; when torch grows them, revisit schemas/model.py."""
    x = torch.randn(1, 4, 8, 8).to(torch.float8_e4m3fn)
    w = torch.randn(4, 4, 3, 3).to(torch.float8_e4m3fn)
    for op in (
        lambda: torch.nn.functional.conv2d(x, w),
        lambda: torch.nn.functional.layer_norm(x, (8,)),
        lambda: torch.nn.functional.group_norm(x, 2),
        lambda: x.softmax(-1),
    ):
        with pytest.raises((NotImplementedError, RuntimeError), match="Float8"):
            op()


def test_float16_on_cpu_is_refused():
    refused({"model": {"dtype": "float16", "device": "cpu"}}, "model.dtype", "model.device")
    parse_config({"model": {"dtype": "bfloat16", "device": "cpu"}})


def test_bfloat16_text_storage_is_refused_with_the_reason():
    msg = refused({"text": {"dtype": "bfloat16"}}, "text.dtype")
    assert "Zarr has no bfloat16" in msg and "model.dtype" in msg


def test_multi_node_needs_a_rendezvous():
    refused({"train": {"nodes": 2}}, "train.nodes", "train.rdzv_endpoint")


def test_node_rank_must_be_below_nodes():
    refused({"train": {"nodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}}, "train.node_rank", "train.nodes")


@pytest.mark.parametrize("endpoint", ["node0", "node0:", "node0:99999", "http://node0:29500", "a b:1"])
def test_rendezvous_endpoint_must_be_host_port(endpoint):
    refused({"train": {"nodes": 2, "rdzv_endpoint": endpoint}}, "train.rdzv_endpoint", "train.nodes", "host:port")


def test_valid_rendezvous_endpoints_and_single_node_pass():
    for endpoint in ("node0.cluster:29500", "10.0.0.1:1", "[fe80::1]:29500"):
        parse_config({"train": {"nodes": 2, "rdzv_endpoint": endpoint}})
    parse_config({"train": {"nodes": 1, "rdzv_endpoint": "anything"}})  # standalone: not used


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_cpu_is_refused_at_load(precision):
    refused(
        {"model": {"device": "cpu"}, "train": {"mixed_precision": precision}}, "train.mixed_precision", "model.device"
    )
    parse_config({"model": {"device": "auto"}, "train": {"mixed_precision": precision}})
    parse_config({"model": {"device": "cpu"}, "train": {"mixed_precision": "auto"}})


def test_lora_alpha_needs_lora():
    refused({"train": {"lora_alpha": 16}}, "train.lora_alpha", "train.mode full")
    parse_config({"train": {"mode": "lora", "lora_alpha": 16}})


def test_lora_rank_must_be_positive():
    refused({"train": {"mode": "lora", "lora_rank": 0}}, "train.lora_rank")


def test_aspect_bounds_must_be_ordered():
    refused({"buckets": {"min_aspect": 2.0, "max_aspect": 1.0}}, "buckets.min_aspect", "buckets.max_aspect")


# ---- family-aware cross-checks (schemas/checks.py) --------------------------------------------


def test_alignment_must_be_a_multiple_of_the_family():
    refused({"model": {"family": "sd3"}, "buckets": {"alignment": 8}}, "buckets.alignment", "model.family sd3", "16")
    parse_config({"model": {"family": "sd3"}, "buckets": {"alignment": 32}})
    parse_config({"model": {"family": "sd15"}, "buckets": {"alignment": 8}})


def test_pixel_resolution_below_one_alignment_unit_suggests_area():
    """The field report: resolution 1.0 meant as megapixels, read as pixels (rounded up to one 8-px unit)."""
    msg = refused({"buckets": {"resolution": 1.0}}, "buckets.resolution", "buckets.resolution_type", "8 px")
    assert "Did you mean buckets.resolution_type area" in msg
    parse_config({"buckets": {"resolution": 1.0, "resolution_type": "area"}})


def test_area_resolution_in_pixels_is_refused():
    msg = refused(
        {"buckets": {"resolution": 1024, "resolution_type": "area"}}, "buckets.resolution", "buckets.resolution_type"
    )
    assert "megapixels" in msg and "did you mean buckets.resolution_type pixel" in msg


def test_resolution_below_the_configured_alignment():
    refused({"buckets": {"resolution": 48, "alignment": 64}}, "buckets.resolution", "buckets.alignment 64")


def test_validate_resolution_below_alignment():
    msg = refused(
        {"model": {"family": "flux"}, "validate": {"resolution": 12}},
        "validate.resolution",
        "model.family flux",
        "16 px",
    )
    # The unit to change is validation's own: switching the buckets' unit would change the training data too.
    assert "Did you mean validate.resolution_type area" in msg
    refused(
        {"validate": {"resolution": 0.00001, "resolution_type": "area"}},
        "validate.resolution",
        "validate.resolution_type",
    )


def test_validate_unit_without_validate_resolution_is_refused():
    refused(
        {"validate": {"resolution_type": "area"}},
        "validate.resolution_type",
        "validate.resolution",
        "buckets.resolution",
        "buckets.resolution_type",
    )
    parse_config({"validate": {"resolution_type": "pixel"}})  # same unit as buckets: fine
    parse_config({"validate": {"resolution": 0.25, "resolution_type": "area"}})


@pytest.mark.parametrize("field,value", [("shuffle_tags", True), ("tag_dropout", 0.2)])
@pytest.mark.parametrize("enabled", [True, False])
def test_tag_augmentation_needs_variants(field, value, enabled):
    msg = refused({"text": {field: value, "enabled": enabled}}, f"text.{field}", "text.caption_variants")
    assert f"text.enabled {str(enabled).lower()}" in msg
    parse_config({"text": {field: value, "caption_variants": 4, "enabled": enabled}})


def test_both_augmentations_are_named_together():
    refused({"text": {"shuffle_tags": True, "tag_dropout": 0.1}}, "text.shuffle_tags and text.tag_dropout")


def test_variants_without_augmentation_are_refused():
    refused({"text": {"caption_variants": 3}}, "text.caption_variants", "text.shuffle_tags", "text.tag_dropout")


def test_keep_tags_without_augmentation_is_refused():
    refused({"text": {"keep_tags": 1}}, "text.keep_tags", "text.shuffle_tags", "text.tag_dropout")
    parse_config({"text": {"keep_tags": 1, "caption_variants": 2, "shuffle_tags": True}})


@pytest.mark.parametrize("family,limit", [("tiny", 16), ("sd15", 77), ("sdxl", 77), ("sd3", 512), ("flux", 512)])
def test_max_length_above_the_encoder_limit(family, limit):
    parse_config({"model": {"family": family}, "text": {"max_length": limit}})
    refused(
        {"model": {"family": family}, "text": {"max_length": limit + 1}},
        "text.max_length",
        f"model.family {family}",
        str(limit),
    )


def test_caption_dropout_with_the_cache_off_is_fine():
    cfg = parse_config({"text": {"enabled": False}, "train": {"caption_dropout": 0.3}})
    assert cfg.train.caption_dropout == 0.3


def test_validation_needs_a_prompt():
    refused({"validate": {"prompts": []}}, "validate.prompts")


def test_negative_prompt_without_guidance_is_refused_where_cfg_applies_it():
    data = {"validate": {"guidance_scale": 1.0, "prompts": [{"prompt": "a"}, {"prompt": "b", "negative_prompt": "c"}]}}
    refused(data, "validate.prompts.1.negative_prompt", "validate.guidance_scale", "model.family tiny")
    parse_config(data | {"model": {"family": "flux"}})  # Flux applies a negative with true CFG
    parse_config({"validate": {"guidance_scale": 1.0, "prompts": [{"prompt": "a"}]}})


def test_every_problem_is_reported_at_once():
    msg = refused(
        {"model": {"family": "sd3"}, "buckets": {"alignment": 8}, "text": {"shuffle_tags": True, "max_length": 600}},
        "buckets.alignment",
        "text.shuffle_tags",
        "text.max_length",
    )
    assert msg.count("\n  - ") == 3


@pytest.mark.parametrize("family", ["tiny", "sd15", "sdxl", "sd3", "flux"])
@pytest.mark.parametrize(
    "buckets",
    [
        {"resolution": 64},
        {"resolution": 1.0, "resolution_type": "area"},
        {"resolution": 512, "resolution_type": "pixel_area"},
    ],
)
def test_the_example_stays_valid_under_the_contract_edits(family, buckets):
    data = {
        **DEMO_CONFIG,
        "model": {"family": family, "path": None},
        "buckets": buckets,
        "dataset": {"path": "/data", "demo": False},
        "train": {**DEMO_CONFIG["train"], "steps": 3},
    }
    parse_config(data)
    parse_config(demo_config().dump() | {"model": {"family": family, "path": None}})


# ---- unknown keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data,path",
    [
        ({"bogus": 1}, "bogus"),
        ({"dataset": {"bogus": 1}}, "dataset.bogus"),
        ({"model": {"bogus": 1}}, "model.bogus"),
        ({"buckets": {"bogus": 1}}, "buckets.bogus"),
        ({"latents": {"bogus": 1}}, "latents.bogus"),
        ({"text": {"bogus": 1}}, "text.bogus"),
        ({"train": {"bogus": 1}}, "train.bogus"),
        ({"validate": {"bogus": 1}}, "validate.bogus"),
        ({"validate": {"prompts": [{"prompt": "a"}, {"prompt": "b", "bogus": 1}]}}, "validate.prompts.1.bogus"),
    ],
)
def test_unknown_keys_name_their_dotted_path(data, path):
    msg = refused(data)
    assert re.search(rf"^  - {re.escape(path)}: unknown key", msg, re.M), msg
