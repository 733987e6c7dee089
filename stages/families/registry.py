"""name → Family adapter. The only place that maps a family name to code."""
from __future__ import annotations

from functools import cache
from importlib import import_module

from tuneline.schemas.families import FAMILY_FACTS
from tuneline.stages.families.base import Family

# Imported lazily: each adapter pulls in diffusers pipelines, which take seconds to import.
_ADAPTERS: dict[str, tuple[str, str]] = {
    "tiny": ("tuneline.stages.families.tiny", "TinyFamily"),
    "sd15": ("tuneline.stages.families.sd15", "SD15Family"),
    "sdxl": ("tuneline.stages.families.sdxl", "SDXLFamily"),
    "sd3": ("tuneline.stages.families.sd3", "SD3Family"),
    "flux": ("tuneline.stages.families.flux", "FluxFamily"),
    "z_image": ("tuneline.stages.families.z_image.adapter", "ZImageFamily"),
    "flux2": ("tuneline.stages.families.flux2.adapter", "Flux2DevFamily"),
    "flux2_klein": ("tuneline.stages.families.flux2_klein.adapter", "Flux2KleinFamily"),
}
assert set(_ADAPTERS) == set(FAMILY_FACTS), "every family with facts needs an adapter"


@cache
def get_family(name: str) -> Family:
    """The adapter for `name`; ValueError naming the known families otherwise."""
    if name not in _ADAPTERS:
        raise ValueError(f"model.family: unknown family {name!r}; known: {', '.join(_ADAPTERS)}")
    module, cls = _ADAPTERS[name]
    return getattr(import_module(module), cls)()


def family_names() -> tuple[str, ...]:
    return tuple(_ADAPTERS)
