"""Loss masks at the latent grid: the image's crop, area-averaged; alpha read with the image's orientation."""

from __future__ import annotations

import numpy as np
from PIL import Image

from tests.records import image_record
from tuneline.schemas.scan import ImageRecord
from tuneline.stages.latents.masks import _plane


def _record(path: str, **kw) -> ImageRecord:
    return image_record(path, (64, 32), **({"bucket_width": 32, "crop": (32, 0, 64, 32)} | kw))


def test_alpha_mask_keeps_the_crop_and_averages_to_the_latent_grid(tmp_path):
    alpha = np.zeros((32, 64), np.uint8)
    alpha[:, 48:] = 255  # the right half of the crop (x 32..64) is opaque
    rgba = np.dstack([np.zeros((32, 64, 3), np.uint8), alpha])
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    plane = _plane(_record("a.png", mask_kind="alpha", background=(255, 255, 255)), tmp_path, None, (4, 4))
    assert plane.tolist() == [[0, 0, 1, 1]] * 4


def test_a_folder_mask_with_partial_cover_gives_fractional_weights(tmp_path):
    mask = np.zeros((32, 64), np.uint8)
    mask[:, 32:36] = 255  # half of the first latent column (8 px wide) of the crop
    (tmp_path / "m").mkdir()
    Image.fromarray(mask, "L").save(tmp_path / "m" / "b.png")
    plane = _plane(_record("b.png", mask_kind="file", mask_path="b.png"), tmp_path, tmp_path / "m", (4, 4))
    assert plane.tolist() == [[0.5, 0, 0, 0]] * 4


def test_an_image_without_a_mask_weighs_fully(tmp_path):
    assert _plane(_record("c.png"), tmp_path, None, (2, 3)).tolist() == [[1, 1, 1]] * 2


def test_a_mask_member_changed_since_the_scan_is_refused_naming_the_rerun(tmp_path):
    import hashlib
    import io

    import pytest

    def png(value: int) -> bytes:
        out = io.BytesIO()
        Image.fromarray(np.full((32, 64), value, np.uint8), "L").save(out, "PNG")
        return out.getvalue()

    scanned = png(255)
    rec = _record("s.jpg", mask_kind="member", mask_path="s.mask.png", mask_sha256=hashlib.sha256(scanned).hexdigest())
    assert _plane(rec, tmp_path, None, (4, 4), data=scanned).tolist() == [[1] * 4] * 4
    with pytest.raises(ValueError, match=r"s\.mask\.png .*changed since the scan.*tuneline run --until latents"):
        _plane(rec, tmp_path, None, (4, 4), data=png(0))
