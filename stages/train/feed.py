"""The training feed's placement: how many threads read ahead, and where each micro-batch's latents are drawn."""

from __future__ import annotations

import torch

from tuneline.stages.latents import store
from tuneline.stages.latents.reader import LatentReader, draw


def feed_workers(reader: LatentReader, device: torch.device) -> int:
    """Threads preparing micro-batches ahead. For a GPU one keeps up with an H100 step on a local cache
    (bench/loader.py measured one thread ahead of two: the reads are short and the GIL is shared). For a CPU
    training device the feed also draws eps (GIL-free, longer than the reads), and two threads draw two
    micro-batches at once. A remote cache pays one round trip per array and block: four reads in flight hide it."""
    if store.is_url(reader.dir):
        return 4
    return 2 if samples_in_feed(device) else 1


def samples_in_feed(device: torch.device) -> bool:
    """Where latent = mean + std * eps is drawn. On a CPU training device the draw is CPU work like the reads, so
    the feed's threads do it ahead of the step; on a GPU it is a kernel the step queues on its own stream, with
    the micro-batch's rows copied from page-locked memory."""
    return device.type == "cpu"


def sample_latents(mean: torch.Tensor, std: torch.Tensor | None, dev: torch.Generator) -> torch.Tensor:
    """The batch's latents in float32 on `dev`'s device (the training device): the mean, or a draw
    mean + std * eps with eps from `dev`."""
    if std is None:
        return mean.to(dev.device, non_blocking=True).float()
    return draw(mean, std, dev)
