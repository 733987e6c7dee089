"""In-training validation renders with the live denoiser, block swap included: the render equals one without swap,
and afterwards the swapped blocks are where swap keeps them (released placeholders on the training device, at
most R blocks resident; a full fine-tune's weights back on their CPU masters), not moved by the pipeline."""

from __future__ import annotations

import pytest
import torch

from tuneline.stages.families.registry import get_family
from tuneline.stages.render.renderer import Renderer, Sample
from tuneline.stages.train.swap import BlockSwapper

CPU = torch.device("cpu")
SAMPLES = [Sample("a red square", "", 3), Sample("a blue circle", "", 4)]


def _latents(r: Renderer) -> torch.Tensor:
    return torch.stack(r.render(SAMPLES, 64, 64, 2, 4.0, output_type="latent"))


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_a_render_keeps_the_swapped_blocks_where_swap_keeps_them(tmp_path, full):
    fam = get_family("tiny")
    model_dir = fam.ensure_model(None, tmp_path)
    plain = _latents(Renderer.load(fam, model_dir, CPU, torch.float32))
    live = fam.load_denoiser(model_dir, torch.float32, CPU).requires_grad_(full)
    swapper = BlockSwapper(live, fam.block_stacks(live), 2, CPU, full)
    live.eval()
    with torch.no_grad():
        swapped = _latents(Renderer.load(fam, model_dir, CPU, torch.float32, denoiser=live))
    torch.testing.assert_close(swapped, plain)
    assert len(swapper.loaded) <= swapper.resident_limit
    for i, entries in enumerate(swapper.weights):
        for p, slot, _, masters, _ in entries:
            if full:
                assert swapper.at_home and p.data.data_ptr() == masters[0].data_ptr(), f"block {i} left its master"
            elif i in swapper.loaded:
                assert p.data.data_ptr() == slot.data_ptr() and p.device == CPU
            else:
                assert p.numel() == 0 and p.device == CPU, f"block {i}: a released weight was refilled or moved"
