"""The renderer: batched calls equal one call per sample, order and negative prompts kept, a live denoiser swapped
in, latents decoded as the pipeline does; the learning check's nearest-mean rule; the loss-curve PNG; render
sizes in pixel and area units; the loss curve drawn once per change."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tuneline.schemas.config import parse_config
from tuneline.stages.families.registry import get_family
from tuneline.stages.render.plots import loss_curve, smooth
from tuneline.stages.render.renderer import Renderer, Sample, grid, render_size_for
from tuneline.stages.validate import learning

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def renderer(tmp_path_factory):
    fam = get_family("tiny")
    model_dir = fam.ensure_model(None, tmp_path_factory.mktemp("models"))
    return Renderer.load(fam, model_dir, CPU, torch.float32), model_dir


def _latents(r: Renderer, samples: list[Sample]) -> torch.Tensor:
    return torch.stack(r.render(samples, 64, 64, 2, 4.0, output_type="latent"))


def test_batched_render_equals_one_call_per_sample(renderer):
    r, _ = renderer
    samples = [
        Sample("a red square", "", 3),
        Sample("a blue circle", "a green square", 5),
        Sample("a blue circle", "", 5),
    ]
    together = _latents(r, samples)
    alone = torch.cat([_latents(r, [s]) for s in samples])
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(together[1], together[2])  # the negative prompt took effect


def test_live_denoiser_swap_renders_like_the_folder(renderer):
    r, model_dir = renderer
    fam = get_family("tiny")
    live = fam.load_denoiser(model_dir, torch.float32, CPU)
    swapped = Renderer.load(fam, model_dir, CPU, torch.float32, denoiser=live)
    samples = [Sample("a yellow circle", "", 1)]
    torch.testing.assert_close(_latents(swapped, samples), _latents(r, samples))
    with torch.no_grad():
        next(live.parameters()).add_(1.0)
    assert not torch.allclose(_latents(swapped, samples), _latents(r, samples))


def test_decode_of_rendered_latents_equals_the_pipelines_images(renderer):
    r, _ = renderer
    samples = [Sample("a red square", "", 3), Sample("a blue circle", "", 4)]
    pil = r.render(samples, 64, 64, 2, 4.0)
    decoded = r.decode(_latents(r, samples))
    for a, b in zip(pil, decoded):
        assert a.size == b.size == (64, 64)
        assert np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).max() <= 1


def test_learning_check_counts_nearest_class_means(renderer, monkeypatch):
    r, _ = renderer
    cfg = parse_config({"validate": {"check_seeds": 2, "check_steps": 1}})
    means = {"blue": np.zeros((4, 8, 8), np.float32), "red": np.ones((4, 8, 8), np.float32)}

    def fake_render(samples, *args, **kwargs):  # red prompts land on the red mean, blue ones near blue
        return [torch.full((4, 8, 8), 0.9 if " red " in f" {s.prompt} " else 0.2) for s in samples]

    def accuracy() -> float | None:  # what the validate stage computes: classes without a mean left out
        return learning.separation(*reversed(learning.render_check(r, cfg, (64, 64))), means)

    monkeypatch.setattr(r, "render", fake_render)
    assert accuracy() == 1.0
    monkeypatch.setattr(r, "render", lambda samples, *a, **k: [torch.full((4, 8, 8), 0.9) for _ in samples])
    assert accuracy() == 0.5
    monkeypatch.setattr(r, "render", lambda samples, *a, **k: [torch.zeros(1, 16, 16) for _ in samples])
    assert accuracy() is None  # packed latents: not comparable


def test_render_size_in_pixel_and_area_units():
    assert render_size_for(parse_config({"buckets": {"resolution": 64}})) == (64, 64)
    area = parse_config({"model": {"family": "sdxl"}, "buckets": {"resolution": 1.0, "resolution_type": "area"}})
    assert render_size_for(area) == (1024, 1024)
    wide = parse_config({"buckets": {"resolution": 64}, "validate": {"aspect": 1.5}})
    assert render_size_for(wide) == (96, 64)


def test_loss_curve_png_and_grid():
    img = loss_curve([1.0, 0.5, float("nan"), 0.25] * 10)
    assert img.size == (640, 360) and img.getextrema() != ((255, 255), (255, 255), (255, 255))
    assert loss_curve([]).size == (640, 360)
    assert smooth([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
    tiles = [Image.new("RGB", (8, 8), c) for c in ("red", "blue", "green")]
    assert grid(tiles, cols=2).size == (16, 16)


def test_the_launcher_draws_rank_0s_losses_and_eval_losses_once_the_workers_are_done(tmp_path):
    """loss.png comes from the losses.jsonl rank 0 leaves (a NaN step included) and the result's eval losses, under
    the name the result gives: no training process draws it."""
    from tuneline.stages.common.jsonl import write_jsonl
    from tuneline.stages.train.failcause import LOSS_PNG, LOSSES
    from tuneline.stages.train.launch import draw_loss_curve

    write_jsonl(tmp_path / LOSSES, ({"step": i + 1, "loss": v} for i, v in enumerate([1.0, float("nan"), 0.5, 0.3])))
    result = {"loss_curve": LOSS_PNG, "eval_losses": []}
    draw_loss_curve(tmp_path, result)
    plain = Image.open(tmp_path / LOSS_PNG)
    assert plain.size == (640, 360) and plain.getextrema() != ((255, 255), (255, 255), (255, 255))
    draw_loss_curve(tmp_path, result | {"eval_losses": [{"step": 2, "loss": 0.4}]})
    with_eval = Image.open(tmp_path / LOSS_PNG)
    assert with_eval.tobytes() != plain.tobytes()  # the eval point is drawn
    orange = (255, 127, 14)  # matplotlib's tab:orange, the eval points' color
    assert orange in {c for _, c in with_eval.getcolors(1 << 20)} - {c for _, c in plain.getcolors(1 << 20)}


def test_prompts_encoded_at_training_length_and_cached(renderer, tmp_path):
    """Validation conditions like training (text.max_length) and keeps encodings under their key."""
    _, model_dir = renderer
    fam = get_family("tiny")
    cache = tmp_path / "prompts.safetensors"
    short = Renderer.load(fam, model_dir, CPU, torch.float32, max_length=8, prompt_cache=(cache, "k8"))
    assert short.enc.max_length == 8
    samples = [Sample("a red square", "a blue circle", 2)]
    first = _latents(short, samples)
    from tuneline.stages.render.prompts import load_prompts

    stored = load_prompts(cache, "k8")
    assert set(stored) == {"a red square", "a blue circle"}
    assert stored["a red square"]["prompt_embeds"].shape[1] == 8
    assert load_prompts(cache, "other-key") == {}
    again = Renderer.load(fam, model_dir, CPU, torch.float32, max_length=8, prompt_cache=(cache, "k8"))
    torch.testing.assert_close(_latents(again, samples), first)


def test_inline_png_is_a_capped_data_uri(tmp_path):
    import base64
    import io
    import random

    from tuneline.flows.results import inline_png

    noisy = Image.frombytes("RGB", (1024, 1024), random.Random(0).randbytes(1024 * 1024 * 3))  # incompressible
    noisy.save(tmp_path / "big.png")
    uri = inline_png(tmp_path / "big.png", max_bytes=50_000)
    raw = base64.b64decode(uri.removeprefix("data:image/png;base64,"))
    thumb = Image.open(io.BytesIO(raw))
    assert thumb.format == "PNG" and len(raw) <= 50_000 and max(thumb.size) <= 768
    assert inline_png(tmp_path / "missing.png") is None
