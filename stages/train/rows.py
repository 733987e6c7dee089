"""Which cached rows train, how often, with what loss weight, and which are held out for eval loss.

Rows come from the latent cache's index, named by the scan record's `ref` ("<source>//<path>" when the dataset
has several folders). Per epoch every training row appears exactly `repeats` times (its source's), so the
share of each source is exact; held-out rows (train.eval.fraction, or the train.eval.path folder) never appear.
Everything is a pure function of the index and the config, so every rank computes it without talking.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np

from tuneline.schemas.sources import Source
from tuneline.stages.latents.reader import LatentReader, epoch_plan
from tuneline.stages.train.plan import EpochPlan, Position, micro_batches

Rows = dict[str, np.ndarray]  # bucket -> row ids


def source_of(ref: str) -> int | None:
    head, sep, _ = ref.partition("//")
    return int(head) if sep else None


def held_out(path: str, fraction: float) -> bool:
    """Stable per image: the first 8 bytes of sha256(path) as a number in [0, 1)."""
    h = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


class RowPlan:
    def __init__(self, reader: LatentReader, t, sources: list[Source]):
        self.reader, self.t = reader, t
        by_index = {s.index: s for s in sources}
        fraction = t.eval.fraction if t.eval is not None else None
        self.train: Rows = {}
        self.held: Rows = {}
        self.source: dict[str, np.ndarray] = {}  # bucket -> source index per row (-1: none)
        for bucket, refs in reader.paths.items():
            srcs = []
            for ref in refs:
                src = by_index.get(source_of(ref))
                if src is None:
                    raise ValueError(
                        f"latent cache row {ref} names a dataset source that the config does not "
                        f"have (dataset.sources has {len(sources)} entries); run `tuneline run` to "
                        f"rescan and recache"
                    )
                srcs.append(src)
            held = np.array(
                [
                    s.role == "eval" or (fraction is not None and s.role == "train" and held_out(ref, fraction))
                    for ref, s in zip(refs, srcs)
                ],
                bool,
            )
            repeats = np.array([s.repeats for s in srcs], np.int64)
            keep = np.flatnonzero(~held)
            self.train[bucket] = np.repeat(keep, repeats[keep])
            self.held[bucket] = np.flatnonzero(held)
            self.source[bucket] = np.array([-1 if s.index is None else s.index for s in srcs], np.int64)
        self.weights = {s.index: s.loss_weight for s in sources}
        n_eval, n_train = sum(map(len, self.held.values())), sum(map(len, self.train.values()))
        if t.eval is not None and (not n_eval or not n_train):
            what = f"train.eval.fraction {fraction}" if fraction is not None else "train.eval.path"
            raise ValueError(
                f"{what} holds out {n_eval} of {n_eval + n_train} cached images; it must leave images "
                f"on both sides (choose another fraction, or put images in the eval folder)"
            )

    def plan(self, epoch: int, world: int) -> list[tuple[str, np.ndarray]]:
        """The reader's epoch plan over the training rows (repeated), held-out rows excluded."""
        t = self.t
        plan = epoch_plan(
            {b: len(r) for b, r in self.train.items()},
            t.batch_size,
            world,
            t.seed,
            epoch,
            block_rows=self.reader.block_rows,
        )
        return [(b, self.train[b][idx]) for b, idx in plan]

    def epoch_plans(self, world: int) -> EpochPlan:
        return lambda epoch: self.plan(epoch, world)

    def trained_refs(self) -> set[str]:
        """The distinct images that train (with buckets.resolutions an image has a row per resolution)."""
        return {self.reader.paths[b][r] for b, rows in self.train.items() for r in rows}

    def held_rows(self) -> Rows | None:
        return self.held if self.t.eval is not None else None

    def loss_weights(self, bucket: str, rows) -> list[float] | None:
        """Per row the loss weight of its source, or None when every source weighs 1."""
        if all(w == 1.0 for w in self.weights.values()):
            return None
        return [self.weights[None if s < 0 else int(s)] for s in self.source[bucket][np.asarray(rows)]]

    def seen_per_source(self, micro_batches_done: int, world: int, sources: list[Source]) -> list[dict]:
        """Samples each source contributed over the first `micro_batches_done` global micro-batches."""
        counts: Counter = Counter()
        stream = micro_batches(self.epoch_plans(world), self.t.batch_size, 0, Position())
        for _ in range(micro_batches_done):
            mb = next(stream)
            counts.update(self.source[mb.bucket][mb.global_rows].tolist())
        return [
            {
                "source": s.index,
                "root": str(s.root),
                "role": s.role,
                "samples": counts[-1 if s.index is None else s.index],
            }
            for s in sources
            if s.role != "eval"
        ]
