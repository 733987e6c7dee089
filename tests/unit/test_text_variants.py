"""Caption variants (tag shuffle / tag dropout) and what the text stage's version depends on. No weights."""

from __future__ import annotations

import pytest

from tuneline.schemas.config import parse_config
from tuneline.stages.pipeline import stage
from tuneline.stages.text import effective_max_length
from tuneline.stages.text.variants import TagAugment, index_strings

CAPTION = "sks person, red hat, smiling, outdoors, photo"


def test_variant_zero_is_the_caption_as_written():
    aug = TagAugment(variants=4, shuffle_tags=True, tag_dropout=0.5)
    assert aug.variant(CAPTION, 0) == CAPTION
    assert aug.variant("a,b ,, c", 0) == "a,b ,, c"
    assert TagAugment().all(CAPTION) == [CAPTION]


def test_shuffle_is_a_permutation_and_deterministic():
    aug = TagAugment(variants=6, shuffle_tags=True, seed=3)
    tags = sorted(t.strip() for t in CAPTION.split(","))
    variants = aug.all(CAPTION)
    assert variants == TagAugment(variants=6, shuffle_tags=True, seed=3).all(CAPTION)
    for v in variants[1:]:
        assert sorted(v.split(", ")) == tags
    assert len(set(variants)) > 2, "six shuffles of five tags should not all coincide"
    assert aug.all(CAPTION) != TagAugment(variants=6, shuffle_tags=True, seed=4).all(CAPTION)


def test_variants_are_pinned():
    """Variants must not depend on PYTHONHASHSEED or the process: the trainer's ranks and later runs must see the
    cache's strings. `random` hashes a string seed with SHA-512, so these exact strings hold everywhere."""
    assert TagAugment(variants=4, shuffle_tags=True, tag_dropout=0.3, seed=1).all(CAPTION) == [
        CAPTION,
        "smiling, sks person, red hat, photo",
        "smiling, photo, outdoors",
        "sks person, red hat, smiling",
    ]


def test_keep_tags_stay_first_and_are_never_dropped():
    aug = TagAugment(variants=20, shuffle_tags=True, tag_dropout=0.6, keep_tags=1)
    for v in aug.all(CAPTION)[1:]:
        assert v.split(", ")[0] == "sks person" and len(v.split(", ")) >= 2


def test_tag_dropout_drops_but_never_empties():
    aug = TagAugment(variants=30, tag_dropout=0.99)
    variants = aug.all(CAPTION)[1:]
    assert all(len(v.split(", ")) == 1 for v in variants), "at 0.99 nearly every tag goes, one always stays"
    assert all(v for v in variants)
    order = [t.strip() for t in CAPTION.split(",")]
    kept = TagAugment(variants=10, tag_dropout=0.4).all(CAPTION)[1:]
    for v in kept:  # without shuffle the remaining tags keep their order
        idx = [order.index(t) for t in v.split(", ")]
        assert idx == sorted(idx)
    assert any(len(v.split(", ")) < len(order) for v in kept)


def test_variant_out_of_range_is_refused():
    with pytest.raises(IndexError, match="caption variant 2 out of range.*caption_variants is 2"):
        TagAugment(variants=2, shuffle_tags=True).variant(CAPTION, 2)


def test_index_strings_shares_rows_and_keeps_the_empty_caption_at_row_zero():
    aug = TagAugment(variants=3, shuffle_tags=True)
    captions = ["b, a", "plain caption", "b, a", "a, b"]
    strings, index = index_strings(captions, aug)
    assert strings[0] == "" and index[""] == [0, 0, 0]
    assert len(strings) == len(set(strings)), "each distinct string is encoded once"
    assert list(index) == ["", "b, a", "plain caption", "a, b"]
    for caption, rows in index.items():
        assert [strings[r] for r in rows] == aug.all(caption)
    assert len(set(index["plain caption"])) == 1, "a caption without tags has one distinct variant"
    # "b, a" shuffled is "a, b", which is also a caption: one row serves both
    assert set(index["b, a"]) <= {index["b, a"][0], index["a, b"][0]}
    assert index_strings(["", "x"], TagAugment())[0] == ["", "x"]


def test_as_dict_is_empty_for_one_variant():
    assert TagAugment().as_dict() == {}
    assert TagAugment(3, True, 0.1, 1, 7).as_dict() == {
        "shuffle_tags": True,
        "tag_dropout": 0.1,
        "keep_tags": 1,
        "seed": 7,
    }


def _text_key(**text) -> dict:
    return stage("text").config(parse_config({"text": text}))


def test_text_version_depends_on_what_changes_the_embeddings():
    base = _text_key()
    assert base["text"] == {
        "enabled": True,
        "max_length": 16,
        "padding": "max_length",
        "caption_variants": 1,
        "augment": {},
        "dtype": "float32",
    }
    assert _text_key(max_length=16) == base, "spelling out the default is no change"
    assert _text_key(batch_size=3) == base
    assert _text_key(seed=5, keep_tags=0) == base, "variant settings do nothing with one variant"
    assert _text_key(max_length=12) != base
    assert _text_key(dtype="float16") != base
    assert _text_key(caption_variants=2, shuffle_tags=True) != _text_key(caption_variants=2, shuffle_tags=True, seed=1)
    off = _text_key(enabled=False)
    assert "dtype" not in off["text"] and off != base
    assert _text_key(enabled=False, dtype="float16") == off, "storage dtype means nothing without a cache"


def test_effective_max_length_follows_the_family():
    assert effective_max_length(parse_config({"model": {"family": "flux"}})) == 512
    assert effective_max_length(parse_config({"model": {"family": "sd3"}, "text": {"max_length": 128}})) == 128
    # the flux_kontext tiny flavor's short captions (model.path null), a real model's 512
    assert effective_max_length(parse_config({"model": {"family": "flux_kontext"}})) == 16
    assert effective_max_length(parse_config({"model": {"family": "flux_kontext", "path": "/m"}})) == 512
