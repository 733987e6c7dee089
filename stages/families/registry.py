"""name → Family adapter. The only place that maps a family name to code.

Each family is one folder, stages/families/<name>/ (stages/families/README.md): adapter.py holds its adapter
class (named here), and optional parts the generic code looks up by name through family_part (lora.py: its kohya
LoRA layout). Its shipped.json (the released model's shapes its shipped config describes) is data, read by
shipped.py.
"""

from __future__ import annotations

from functools import cache
from importlib import import_module
from types import ModuleType

from tuneline.schemas.families import FAMILY_FACTS
from tuneline.stages.families.base import Family

PACKAGE = "tuneline.stages.families"
# Imported lazily: each adapter pulls in diffusers pipelines, which take seconds to import.
_ADAPTERS: dict[str, str] = {
    "tiny": "TinyFamily",
    "sd15": "SD15Family",
    "sdxl": "SDXLFamily",
    "sd3": "SD3Family",
    "flux": "FluxFamily",
    "flux_kontext": "FluxKontextFamily",
    "qwen_image": "QwenImageFamily",
    "qwen_image_edit": "QwenImageEditFamily",
    "qwen_image_edit_plus": "QwenImageEditPlusFamily",
    "z_image": "ZImageFamily",
    "flux2": "Flux2DevFamily",
    "flux2_klein": "Flux2KleinFamily",
    "wan": "WanFamily",
    "wan22": "Wan22Family",
    "wan22_ti2v": "Wan22TI2VFamily",
}
assert set(_ADAPTERS) == set(FAMILY_FACTS), "every family with facts needs an adapter"


@cache
def get_family(name: str) -> Family:
    """The adapter for `name`; ValueError naming the known families otherwise."""
    if name not in _ADAPTERS:
        raise ValueError(f"model.family: unknown family {name!r}; known: {', '.join(_ADAPTERS)}")
    return getattr(import_module(f"{PACKAGE}.{name}.adapter"), _ADAPTERS[name])()


@cache
def family_part(name: str, part: str) -> ModuleType | None:
    """The module stages/families/<name>/<part>.py, or None when the family has no such part (or is unknown)."""
    if name not in _ADAPTERS:
        return None
    try:
        return import_module(f"{PACKAGE}.{name}.{part}")
    except ModuleNotFoundError as err:
        if err.name != f"{PACKAGE}.{name}.{part}":
            raise
        return None


def family_names() -> tuple[str, ...]:
    return tuple(_ADAPTERS)
