"""The size Qwen-Image-Edit's pipelines scale an input image to, and a run's own.

The pipelines scale every input image to about 1024 x 1024 pixels at its aspect ratio, for the VAE and for the text
encoder, whatever the output size (their module's calculate_dimensions, given 1024 * 1024 or the Plus pipeline's
CONDITION_IMAGE_SIZE / VAE_IMAGE_SIZE), and size the input's token grid (img_shapes) the same way. A run may set
another area (resolve.input_area: the tiny flavor renders the demo's 64 x 64 pairs, beside which a 1 MP input
would be 4,096 of the 4,112 image tokens the transformer sees). The stock pipelines take no argument for it, so
for such a run the renderer calls them with their calculate_dimensions answering that area (with_input_area); a
run without one (every model folder) calls them untouched.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

PIPELINE_AREA = 1024 * 1024  # QwenImageEditPipeline's calculate_dimensions(1024 * 1024, ratio)


def scaled_size(area: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) of about `area` pixels at width / height, each a multiple of 32, as the pipelines size."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    w, h, _ = calculate_dimensions(area, width / height)
    return w, h


@contextlib.contextmanager
def scaled_inputs(pipe: Any, area: int) -> Iterator[None]:
    """While open, `pipe`'s module sizes every input image for `area` pixels (the function it calls for each,
    whatever area it asks, answers `area` at the same aspect ratio)."""
    module = sys.modules[type(pipe).__module__]
    own = module.calculate_dimensions
    module.calculate_dimensions = lambda _area, ratio: own(area, ratio)
    try:
        yield
    finally:
        module.calculate_dimensions = own


def with_input_area(pipe: Any, area: int | None) -> Callable[..., Any]:
    """`pipe`, or where `area` is set, a call of it with its input images scaled to `area` pixels."""
    if area is None:
        return pipe

    def call(**kwargs: Any) -> Any:
        with scaled_inputs(pipe, area):
            return pipe(**kwargs)

    return call
