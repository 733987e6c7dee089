"""The memory plan's terms around the step and its override: the validation render's models (VAE decoder, text
encoders) counted from the weights' headers as the renderer loads them, DDP's buckets as views into the gradients,
and train.memory_check refuse | warn | off."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.integration.test_train_support import small_config
from tuneline.stages.common.stage import StageContext
from tuneline.stages.families.registry import get_family
from tuneline.stages.train import collectives
from tuneline.stages.train.memcheck import (
    DECODER_ONLY,
    check_before_training,
    enforce,
    meta_params,
    render_models_bytes,
)
from tuneline.stages.train.memplan import plan

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    fam = get_family("tiny")
    return fam, fam.ensure_model(None, tmp_path_factory.mktemp("models"))


def test_the_validation_render_term_is_what_the_renderer_loads(tiny):
    fam, model_dir = tiny
    pipe = fam.load_pipeline(model_dir, torch.float32, CPU)
    loaded = sum(p.numel() for n, p in pipe.vae.named_parameters() if not n.startswith(DECODER_ONLY))
    loaded += sum(p.numel() for c in fam.text_components for p in getattr(pipe, c).parameters())
    assert render_models_bytes(fam, model_dir, torch.float32) == 4 * loaded
    assert render_models_bytes(fam, model_dir, torch.bfloat16) == 2 * loaded
    # A shipped weightless config: the same count from the configs on the meta device.
    assert meta_params(fam, model_dir, "vae", DECODER_ONLY) == sum(
        p.numel() for n, p in pipe.vae.named_parameters() if not n.startswith(DECODER_ONLY)
    )


def test_the_plan_counts_the_render_only_when_validation_runs_in_training(tiny, tmp_path):
    fam, model_dir = tiny
    few = {"batch_size": 1, "gradient_checkpointing": "offload"}  # activations smaller than the render's models
    on = plan(small_config(tmp_path, {"validate_every": 5, **few}), model_dir, CPU, gpu_memory_gib=80)
    off = plan(small_config(tmp_path, {"validate_every": 0, **few}), model_dir, CPU, gpu_memory_gib=80)
    term = "validation render models beyond the freed activations"
    freed = sum(b for n, b in on.terms if n.startswith(("activations", "backward working")))
    # model.dtype float32 under autocast: the render computes in float32 (hooks.Hooks.render)
    assert dict(on.terms)[term] == render_models_bytes(fam, model_dir, torch.float32) - freed > 0
    assert dict(off.terms)[term] == 0
    assert on.grace >= 120 and on.as_json()["grace"] == on.grace


def test_ddp_gradients_are_views_into_its_buckets(tmp_path):
    """collectives.wrap's DDP: each gradient is a view into its bucket, so the buckets cost nothing beyond the
    planned gradients."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        ddp = collectives.wrap(model, dict(model.named_parameters()), CPU)
        ddp(torch.ones(2, 4)).sum().backward()
        assert ddp.gradient_as_bucket_view
        grads = [p.grad for p in model.parameters()]
        assert len({g.untyped_storage().data_ptr() for g in grads}) == 1, "the gradients do not share a bucket"
    finally:
        dist.destroy_process_group()


def test_memory_check_refuse_warn_off(tiny, tmp_path, caplog):
    fam, model_dir = tiny
    small = plan(small_config(tmp_path, {}), model_dir, CPU, gpu_memory_gib=0.001)  # a card it cannot fit
    assert not small.fits
    with pytest.raises(ValueError, match="train.memory_check: warn trains anyway"):
        enforce(small, "refuse", logging.getLogger("t"))
    with caplog.at_level(logging.WARNING):
        assert enforce(small, "warn", logging.getLogger("t"))["fits"] is False
    assert "training anyway: train.memory_check is warn" in caplog.text
    cfg = small_config(tmp_path, {"memory_check": "off"})
    assert check_before_training(StageContext(cfg), model_dir, CPU) is None
