"""train.compile: the tiny Flux transformer (double- and single-stream blocks) trained with its blocks compiled
matches the eager run within float32 reordering, keeps the eager parameter names, and resumes exactly; every other
family's denoiser (a UNet's transformer and resnet blocks, each transformer's block stacks) compiles in place.

The Flux blocks compile with inductor, the product's backend (C++ kernels on the CPU). A UNet's 9 block shapes
take inductor ~210 CPU-s of C++ compiles here against Flux's ~85, for the same claim about compiled training; what
is each family's own (which blocks compile, under which names, whole) is checked with a backend that runs the
captured graphs as they are."""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import closing

import pytest
import torch

from tests.integration.test_train_support import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from gpu_setup import Bench, caches  # noqa: E402

from tests.trainer import trainer_for  # noqa: E402
from tuneline.stages.train import checkpoint as ckpt  # noqa: E402
from tuneline.stages.train.plan import micro_batches  # noqa: E402

STEPS = 3
# Inductor fuses and reorders float32 arithmetic, so the compiled steps differ from the eager ones in the last bits;
# after 3 AdamW steps at lr 1e-4 the LoRA weights agree to far below one step's update (lr = 1e-4).
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    b = Bench(True, tmp_path_factory.mktemp("compile"), None)
    cfg = b.config("compile", "flux", {"steps": 10, "learning_rate": 1e-4})
    return b, cfg, caches(cfg)


def trained(bench, compile_: bool, steps: int, resume=None):
    b, cfg, ctx = bench
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": compile_})})
    trainer = trainer_for(cfg, ctx)
    if resume is not None:
        trainer.restore(resume)
    return run(trainer, steps)


def run(trainer, steps: int):
    stream = micro_batches(trainer.data.rows.epoch_plans(1), trainer.cfg.train.batch_size, 0, trainer.position)
    with closing(trainer.feed(stream)) as feed:
        for _ in range(steps):
            trainer.train_step([next(feed)])
    return trainer


def test_compiled_training_equals_eager_and_resumes_exactly(bench, tmp_path):
    eager = trained(bench, False, STEPS)
    compiled = trained(bench, True, STEPS)
    assert any(hasattr(m, "_compiled_call_impl") and m._compiled_call_impl for m in compiled.denoiser.modules())
    # Compiled in place: the parameter and state_dict names a checkpoint and the export read are the eager ones.
    assert list(compiled.denoiser.state_dict()) == list(eager.denoiser.state_dict())
    eager_tensors, compiled_tensors = eager.checkpoint()[0], compiled.checkpoint()[0]
    assert {k: list(v) for k, v in compiled_tensors.items()} == {k: list(v) for k, v in eager_tensors.items()}
    assert not any("_orig_mod" in n for n in compiled_tensors["trainable"])
    diff = max(float((compiled.params[n] - p).abs().max()) for n, p in eager.params.items())
    moved = max(float((eager.params[n] - v).abs().max()) for n, v in trained(bench, False, 0).params.items())
    assert 0 <= diff <= TOLERANCE < moved, (diff, moved)
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)
    # Resume: 2 compiled steps, a checkpoint, a fresh compiled trainer for the third equals 3 uninterrupted.
    first = trained(bench, True, STEPS - 1)
    saved = ckpt.save(tmp_path / "checkpoints", first.step, *first.checkpoint())
    resumed = trained(bench, True, 1, resume=saved)
    assert resumed.step == STEPS and resumed.losses == compiled.losses
    for n, p in compiled.params.items():
        assert torch.equal(resumed.params[n], p), n


# One flavor per block code, with the classes whose every instance compiles: SD1.5 is SDXL's UNet, Kontext FLUX.1's
# transformer (test above), the Qwen-Image edit models Qwen-Image's, FLUX.2 FLUX.2 [klein]'s, Wan 2.2 Wan's.
BLOCKS = {
    "sdxl": {"BasicTransformerBlock", "ResnetBlock2D"},
    "sd3": {"JointTransformerBlock"},
    "z_image": {"ZImageTransformerBlock"},  # the refiners' and the main stack's
    "qwen_image": {"QwenImageTransformerBlock"},
    "flux2_klein": {"Flux2TransformerBlock", "Flux2SingleTransformerBlock"},
    "wan": {"WanTransformerBlock"},
}


@pytest.mark.parametrize("family", list(BLOCKS))
def test_every_familys_blocks_compile_in_place_and_each_runs_its_graph(family, tmp_path_factory):
    """Each family's tiny denoiser: the blocks compiled (a UNet's transformer and resnet blocks, a transformer's
    block stacks) compile in place, so the state_dict a checkpoint and the export read keeps the eager names; each
    is captured whole (no graph break) and runs a graph that takes its parameters, and a step through the captured
    graphs computes the eager step (the graphs run as captured: no C++ compile)."""
    from torch._dynamo.utils import counters

    from tuneline.stages.train.compile import compile_blocks

    b = Bench(True, tmp_path_factory.mktemp(family), None)
    cfg = b.config(family, family, {"steps": 10, "learning_rate": 1e-4})
    ctx = caches(cfg)
    eager, compiled = trainer_for(cfg, ctx), trainer_for(cfg, ctx)
    names = list(compiled.denoiser.state_dict())
    stacks = compiled.fam.block_stacks(compiled.denoiser)
    graphs = []  # each captured graph's tensor inputs (the block's parameters among them), then run as captured

    def record(gm, example_inputs):
        graphs.append(Counter(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)))
        return gm.forward

    counters.clear()
    count = compile_blocks(compiled.denoiser, stacks, backend=record)
    blocks = [m for m in compiled.denoiser.modules() if type(m).__name__ in BLOCKS[family]]
    assert {type(m).__name__ for m in blocks} == BLOCKS[family] and count == len(blocks)
    assert all(m._compiled_call_impl is not None for m in blocks)
    assert list(compiled.denoiser.state_dict()) == names
    assert run(compiled, 1).losses == pytest.approx(run(eager, 1).losses, rel=1e-6)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for m in blocks:  # every block ran a graph that takes its parameters: none fell back to eager
        own = Counter(tuple(p.shape) for p in m.parameters())
        assert any(not own - g for g in graphs), f"{type(m).__name__} ran eager"


def test_compile_with_block_swap_is_refused_naming_both_keys(bench):
    _, cfg, _ = bench
    with pytest.raises(ValueError, match=r"train\.compile with train\.blocks_to_swap 2.*train\.blocks_to_swap: 0"):
        cfg.train.model_validate({**cfg.train.model_dump(), "compile": True, "blocks_to_swap": 2})


class _Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.nn.functional.gelu(self.proj(x)) + x


def test_each_block_shape_gets_its_graph_past_dynamos_default_limit():
    """Blocks of one class share one forward's code, and dynamo's default keeps 8 graphs per code: SDXL's 12 resnet
    shapes would leave 4 eager. 10 blocks of 10 widths each run their own compiled graph."""
    from torch._dynamo.utils import counters

    from tuneline.stages.train.compile import compile_blocks

    widths = range(4, 14)
    den = torch.nn.Module()
    den.blocks = torch.nn.ModuleList(_Block(w) for w in widths)
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):  # the defaults
        before = counters["stats"]["unique_graphs"]
        assert compile_blocks(den, ("blocks",), backend="eager") == len(widths)
        for block, w in zip(den.blocks, widths):
            block(torch.randn(2, w))
        assert counters["stats"]["unique_graphs"] - before == len(widths)
