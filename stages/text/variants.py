"""Caption variants for tag shuffle / tag dropout: K deterministic strings per caption.

Augmentation is precomputed rather than drawn per step so the text cache can hold every string the trainer will
ever see; live encoding (cache off) draws from the same K variants, so switching the cache never changes training.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

SEPARATOR = ","


@dataclass(frozen=True)
class TagAugment:
    variants: int = 1
    shuffle_tags: bool = False
    tag_dropout: float = 0.0
    keep_tags: int = 0
    seed: int = 0

    @classmethod
    def from_config(cls, text_cfg) -> TagAugment:
        t = text_cfg
        return cls(t.caption_variants, t.shuffle_tags, t.tag_dropout, t.keep_tags, t.seed)

    @classmethod
    def from_manifest(cls, manifest) -> TagAugment:
        """What a text artifact recorded (its `variants` and `augment`)."""
        return cls(variants=manifest.variants, **manifest.augment)

    def as_dict(self) -> dict:
        """The settings that shape variants; empty with one variant, where none of them has an effect."""
        if self.variants == 1:
            return {}
        return {k: v for k, v in asdict(self).items() if k != "variants"}

    def variant(self, caption: str, k: int) -> str:
        """Variant `k` of `caption`: 0 is the caption as written; k >= 1 splits it into comma-separated tags,
        keeps the first `keep_tags` in place, drops each other tag with probability `tag_dropout` (never all
        of them: emptying a caption is caption dropout's job) and shuffles the rest."""
        if not 0 <= k < self.variants:
            raise IndexError(f"caption variant {k} out of range: text.caption_variants is {self.variants}")
        if k == 0:
            return caption
        tags = [t.strip() for t in caption.split(SEPARATOR) if t.strip()]
        fixed, rest = tags[: self.keep_tags], tags[self.keep_tags :]
        if not rest:
            return caption
        # A string seed is hashed with SHA-512 by `random`, so variants are the same in every process and run.
        rng = random.Random(f"{self.seed}\0{k}\0{caption}")
        kept = [t for t in rest if rng.random() >= self.tag_dropout]
        if not kept:
            kept = [rest[rng.randrange(len(rest))]]
        if self.shuffle_tags:
            rng.shuffle(kept)
        return f"{SEPARATOR} ".join(fixed + kept)

    def all(self, caption: str) -> list[str]:
        return [self.variant(caption, k) for k in range(self.variants)]


def index_strings(captions: list[str], augment: TagAugment) -> tuple[list[str], dict[str, list[int]]]:
    """(distinct strings to encode, caption -> row of each variant). Row 0 is the empty caption, so caption
    dropout finds it in every cache; identical strings (across captions or variants) share one row."""
    rows_of: dict[str, int] = {"": 0}
    index: dict[str, list[int]] = {}
    for caption in ["", *captions]:
        if caption in index:
            continue
        index[caption] = [rows_of.setdefault(s, len(rows_of)) for s in augment.all(caption)]
    return list(rows_of), index
