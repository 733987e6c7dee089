"""Property tests of THE size function (stages/common/sizing.py) over random sizes and settings."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from tuneline.schemas.families import FAMILY_FACTS
from tuneline.stages.common.sizing import (
    SizePolicy,
    bucket_size,
    clamp_aspect,
    crop_box,
    latent_shape,
    render_size,
    size_problem,
    usable_region,
)

sizes = st.integers(16, 8000)
aspects = st.tuples(st.floats(0.1, 1.0), st.floats(1.0, 10.0))


@st.composite
def policies(draw, upscale=None):
    rtype = draw(st.sampled_from(["pixel", "area", "pixel_area"]))
    alignment = draw(st.sampled_from([8, 16, 32, 64]))
    # Keep every ideal edge well above one alignment unit, where rounding bounds are meaningful.
    if rtype == "area":
        resolution = draw(st.floats(0.1, 4.0))
    else:
        resolution = draw(st.floats(alignment * 8, 2048))
    lo, hi = draw(aspects)
    return SizePolicy(
        resolution,
        rtype,
        alignment,
        min_aspect=max(lo, 0.25),
        max_aspect=min(hi, 4.0),
        upscale=draw(st.booleans()) if upscale is None else upscale,
    )


def ideal(width: int, height: int, p: SizePolicy) -> tuple[float, float]:
    a = clamp_aspect(width, height, p)
    if p.resolution_type == "pixel":
        return (p.resolution * a, p.resolution) if a >= 1 else (p.resolution, p.resolution / a)
    area = p.resolution * (1024 * 1024 if p.resolution_type == "area" else p.resolution)
    h = math.sqrt(area / a)
    return h * a, h


@settings(max_examples=300, deadline=None)
@given(sizes, sizes, policies())
def test_aligned_and_deterministic(w, h, p):
    if size_problem(w, h, p):
        return  # covered by test_no_upscale_never_exceeds_the_source
    bw, bh = bucket_size(w, h, p)
    assert bw % p.alignment == 0 and bh % p.alignment == 0
    assert bw >= p.alignment and bh >= p.alignment
    assert bucket_size(w, h, p) == (bw, bh)


@settings(max_examples=300, deadline=None)
@given(sizes, sizes, policies(upscale=True))
def test_area_and_aspect_within_rounding(w, h, p):
    """Each edge is within half an alignment unit of the ideal, so area and aspect errors are bounded by it."""
    bw, bh = bucket_size(w, h, p)
    iw, ih = ideal(w, h, p)
    half = p.alignment / 2 + 1e-6
    assert abs(bw - iw) <= half and abs(bh - ih) <= half
    area_tol = (1 + half / iw) * (1 + half / ih) - 1
    assert abs(bw * bh - iw * ih) <= area_tol * iw * ih + 1e-6
    # The aspect error is largest with one edge rounded up and the other down, by half a unit each: either way round
    wide, tall = math.log((iw + half) / (ih - half) * ih / iw), math.log(iw / (iw - half) * (ih + half) / ih)
    aspect_tol = max(wide, tall)
    assert abs(math.log(bw / bh) - math.log(clamp_aspect(w, h, p))) <= aspect_tol + 1e-9
    if p.resolution_type == "pixel":
        assert abs(min(bw, bh) - p.resolution) <= half or min(iw, ih) != p.resolution


@settings(max_examples=300, deadline=None)
@given(sizes, sizes, policies(upscale=False))
def test_no_upscale_never_exceeds_the_source(w, h, p):
    if size_problem(w, h, p):
        with pytest.raises(ValueError):
            bucket_size(w, h, p)
        return
    bw, bh = bucket_size(w, h, p)
    cw, ch = usable_region(w, h, clamp_aspect(w, h, p))
    assert bw <= cw + 1e-6 and bh <= ch + 1e-6
    left, top, right, bottom = crop_box(w, h, bw, bh)
    assert right - left >= bw and bottom - top >= bh  # the crop is only ever shrunk to the bucket


@settings(max_examples=200, deadline=None)
@given(st.integers(16, 3000), st.integers(16, 3000), st.integers(2, 5), policies(upscale=True))
def test_bucket_depends_only_on_aspect_when_upscaling(w, h, k, p):
    assert bucket_size(w, h, p) == bucket_size(w * k, h * k, p)


@settings(max_examples=200, deadline=None)
@given(sizes, sizes, st.sampled_from(sorted(FAMILY_FACTS)), st.integers(1, 4), st.floats(0.1, 2.0))
def test_latent_shape_is_bucket_over_vae_factor(w, h, family, multiple, megapixels):
    fam = FAMILY_FACTS[family]
    p = SizePolicy(megapixels, "area", fam.alignment * multiple)
    bw, bh = bucket_size(w, h, p)
    c, lh, lw = latent_shape(bw, bh, fam.latent_channels, fam.vae_factor)
    assert (c, lh * fam.vae_factor, lw * fam.vae_factor) == (fam.latent_channels, bh, bw)
    assert lh % fam.patch_size == 0 and lw % fam.patch_size == 0  # the transformer patchifies without padding


@settings(max_examples=200, deadline=None)
@given(
    sizes,
    sizes,
    st.sampled_from([(8, 8), (64, 96), (96, 64), (1024, 512)]),
    st.sampled_from(["center", "random", "corner"]),
    st.integers(0, 5),
    st.text(max_size=8),
)
def test_crop_box_inside_image_with_bucket_aspect(w, h, bucket, mode, seed, key):
    bw, bh = bucket
    box = crop_box(w, h, bw, bh, mode, seed, key)
    left, top, right, bottom = box
    assert 0 <= left < right <= w and 0 <= top < bottom <= h
    cw, ch = right - left, bottom - top
    assert cw == w or ch == h  # the largest region of that aspect
    assert abs(cw / ch - bw / bh) <= max(1 / ch, bw / bh / cw) * 1.01
    assert crop_box(w, h, bw, bh, mode, seed, key) == box


def test_crop_modes_place_the_box():
    assert crop_box(200, 100, 64, 64, "center") == (50, 0, 150, 100)
    assert crop_box(200, 100, 64, 64, "corner") == (0, 0, 100, 100)
    boxes = {crop_box(200, 100, 64, 64, "random", seed, "a.png") for seed in range(20)}
    assert len(boxes) > 5  # random really varies with the seed ...
    assert crop_box(200, 100, 64, 64, "random", 3, "a.png") == crop_box(200, 100, 64, 64, "random", 3, "a.png")
    with pytest.raises(ValueError, match="buckets.crop"):
        crop_box(200, 100, 64, 64, "middle")


def test_units_agree_on_a_square():
    one_mp = [SizePolicy(1.0, "area", 16), SizePolicy(1024, "pixel_area", 16), SizePolicy(1024, "pixel", 16)]
    assert {bucket_size(3000, 3000, p) for p in one_mp} == {(1024, 1024)}
    assert render_size(1.0, "area", 16) == (1024, 1024)
    assert render_size(64, "pixel", 8, aspect=1.5) == (96, 64)
    w, h = render_size(0.5, "area", 64, aspect=16 / 9)
    assert abs(w * h - 0.5 * 1024 * 1024) / (0.5 * 1024 * 1024) < 0.1 and w > h


def test_size_problems_name_the_setting():
    assert "buckets.min_edge" in size_problem(100, 50, SizePolicy(64, "pixel", 8, min_edge=64))
    assert size_problem(100, 64, SizePolicy(64, "pixel", 8, min_edge=64)) is None
    assert "buckets.upscale" in size_problem(6, 6, SizePolicy(64, "pixel", 8, upscale=False))
    assert bucket_size(6, 6, SizePolicy(64, "pixel", 8)) == (64, 64)  # upscaling allowed: fine
    with pytest.raises(ValueError, match="not positive"):
        bucket_size(0, 5, SizePolicy(64, "pixel", 8))
    with pytest.raises(ValueError, match="VAE factor"):
        latent_shape(60, 64, 4, 8)
