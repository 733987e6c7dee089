"""In-training validation deals its prompts so that every rank makes the same renderer calls (FSDP's forwards wait
for every rank) and the grid keeps the prompts' order."""

from __future__ import annotations

import pytest

from tuneline.stages.render.renderer import Sample
from tuneline.stages.train.hooks import deal


def _kinds(samples, share):
    return [bool(samples[i].negative_prompt) for i, _ in share]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("negatives", ["", "n", "mixed"])
def test_every_rank_renders_the_same_kinds_and_every_prompt_once(world, negatives):
    neg = {"": lambda i: "", "n": lambda i: "blurry", "mixed": lambda i: "blurry" if i % 3 == 1 else ""}[negatives]
    samples = [Sample(f"p{i}", neg(i), i) for i in range(5)]
    shares = deal(samples, world)
    assert len(shares) == world
    # the same sequence of kinds on every rank: the same renderer calls, so the same denoiser forwards
    assert len({tuple(_kinds(samples, s)) for s in shares}) == 1
    kept = sorted(i for s in shares for i, keep in s if keep)
    assert kept == list(range(5))  # each prompt rendered and kept exactly once
    padding = [(i, keep) for s in shares for i, keep in s if not keep]
    assert all(0 <= i < 5 for i, _ in padding)


def test_no_prompts_deal_nothing():
    assert deal([], 2) == [[], []]
