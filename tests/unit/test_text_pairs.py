"""Text rows per (instruction, control image): the keys and rows the text stage builds for a family whose text
encoder sees the control image (stages/text/controls.py)."""

from __future__ import annotations

from tuneline.stages.text.controls import index_pairs, split_key
from tuneline.stages.text.store import pair_key
from tuneline.stages.text.variants import TagAugment

A, B = "a" * 64, "b" * 64


def test_rows_per_pair_with_each_controls_empty_instruction():
    pairs = [("make it red", A), ("make it red", B), ("make it blue", A), ("a cat", None)]
    strings, index = index_pairs(pairs, TagAugment())
    assert strings == [
        "",
        pair_key("", A),
        pair_key("", B),
        pair_key("make it red", A),
        pair_key("make it red", B),
        pair_key("make it blue", A),
        "a cat",
    ]
    assert index[""] == [0] and index[pair_key("", B)] == [2]
    assert index[pair_key("make it red", B)] == [4] and index["a cat"] == [6]
    assert split_key(strings[3]) == (A, "make it red") and split_key("a cat") == (None, "a cat")


def test_variants_share_rows_within_a_control_only():
    aug = TagAugment(variants=2, shuffle_tags=True, seed=1)
    strings, index = index_pairs([("red, square, big", A), ("red, square, big", B)], aug)
    assert len(index[pair_key("", A)]) == 2 and len(set(index[pair_key("", A)])) == 1
    rows_a, rows_b = index[pair_key("red, square, big", A)], index[pair_key("red, square, big", B)]
    assert not set(rows_a) & set(rows_b)
    assert [split_key(strings[r])[1] for r in rows_a] == [split_key(strings[r])[1] for r in rows_b]
