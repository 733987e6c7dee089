"""train.compile: torch.compile of the denoiser block by block, as torchtitan does.

Each transformer block (and a UNet's resnet blocks) is compiled on its own rather than the whole denoiser: blocks of
one class share one compiled graph, the code between them (embeddings, a UNet's skips, peft's wrappers) stays eager,
and gradient checkpointing and FSDP keep working per block. With FSDP, `compile_block` runs on each block before
that block is sharded. Blocks compile in place (`Module.compile`), so parameter names, and with them checkpoints
and the exported LoRA, are the eager model's: no `_orig_mod.` prefix, and a run resumes exactly either way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from tuneline.stages.families.common import unwrap
from tuneline.stages.train.swap import transformer_blocks


def compile_block(block: torch.nn.Module, backend: str | Callable = "inductor") -> None:
    """Compile one block in place: its forward runs the compiled graph, its names and state_dict are unchanged."""
    block.compile(backend=backend)


def compiled_blocks(denoiser: torch.nn.Module, stacks: tuple[str, ...]) -> list[torch.nn.Module]:
    """The blocks train.compile compiles: the transformer blocks in `stacks` (Family.block_stacks), and a UNet's
    resnet blocks (most of its work)."""
    from diffusers.models.resnet import ResnetBlock2D

    resnets = [m for m in unwrap(denoiser).modules() if isinstance(m, ResnetBlock2D)]
    return transformer_blocks(denoiser, stacks) + resnets


def compile_blocks(denoiser: torch.nn.Module, stacks: tuple[str, ...], backend: str | Callable = "inductor") -> int:
    """Compile every block of `denoiser` in place; returns how many."""
    blocks = compiled_blocks(denoiser, stacks)
    if not blocks:
        raise ValueError(f"train.compile: {type(unwrap(denoiser)).__name__} has no blocks to compile; set it false")
    _allow_a_graph_per_block(blocks)
    for block in blocks:
        compile_block(block, backend)
    return len(blocks)


def _allow_a_graph_per_block(blocks: list[torch.nn.Module]) -> None:
    """Blocks of one class share their forward's code, and dynamo keeps at most `recompile_limit` graphs (8) per
    code: each block's weights fix its shapes, so every channel width and size is a graph of its own, and again
    where an input needs no gradient or under no_grad (validation). SDXL's UNet has 12 resnet shapes: past the
    limit dynamo would run the rest eager, with a warning in the log only. Allow each block of the most common
    class its three graphs."""
    need = 3 * max(Counter(type(b) for b in blocks).values())
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, need)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, need * len({type(b) for b in blocks}))
