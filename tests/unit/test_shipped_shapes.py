"""Each family's shipped.json and shipped_<size>.json (the released models' tensor shapes, data beside its
adapter) against the shipped configs they describe: one file per shipped config, no file without one, shapes a
checkpoint can have."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuneline.schemas.model import SHIPPED_CONFIGS
from tuneline.stages.families import shipped

FAMILIES = Path(shipped.__file__).resolve().parent


def test_a_shapes_file_for_each_shipped_config_and_no_other():
    assert set(FAMILIES.glob("*/shipped*.json")) == {shipped.shapes_file(n) for n in SHIPPED_CONFIGS}


@pytest.mark.parametrize("name", sorted(SHIPPED_CONFIGS))
def test_shapes_file_names_its_config_and_holds_whole_shapes(name):
    data = json.loads(shipped.shapes_file(name).read_text(encoding="utf-8"))
    assert set(data) == {"about", "shapes"}
    assert f"stages/families/configs/{name}/" in data["about"]
    assert data["shapes"] and all(isinstance(k, str) and k.endswith(("weight", "pos_embed")) for k in data["shapes"])
    assert all(v and all(isinstance(d, int) and d > 0 for d in v) for v in data["shapes"].values())
    assert shipped.SIGNATURES[name] == {k: tuple(v) for k, v in data["shapes"].items()}
