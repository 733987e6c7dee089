"""The user's path for every registered family: `tuneline config example` with model.family, train.mode lora,
train.steps 2 and train.processes 1 changed and dataset.path the session's demo folder (the same demo dataset), run
with `tuneline run --until train` through the real CLI against the worker's Prefect server (prefect_server). Each
run must publish a train artifact with its exports. One process: what this column proves is the CLI's path for
each family; each family's training on the example's 2 DDP processes is the training matrix's base cell
(tests/integration/test_training_matrix.py), through the train stage's worker functions under torchrun.

The scan, latents and text caches come from the session's upstream store (tests/upstream_store.py), keyed by
the config exactly as the CLI loads it, so the CLI finds them fresh and runs the train stage's flow only. On the
session's demo folder, they are the caches other tests built for the family (tests/integration/
test_train_families.py and others), not a build per family for this column.
"""

from __future__ import annotations

import pytest
import yaml

from tests.helpers import tuneline
from tuneline.schemas.config import load_config
from tuneline.schemas.train_manifest import TrainManifest
from tuneline.stages.common.artifacts import ArtifactStore
from tuneline.stages.families.registry import family_names, get_family


@pytest.fixture(scope="module")
def example() -> dict:
    out = tuneline("config", "example")
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


# Two groups of families (tests/workers.py), so that the column runs on two xdist workers at once. Another layout of a
# family (FamilyFacts.variant_of: Wan 2.2's TI2V 5B) runs its family's CLI path: its scan -> validate run is
# tests/integration/test_wan22_ti2v.py, its 2-process training the matrix's cell.
COLUMN = [f for f in family_names() if not get_family(f).facts.variant_of]


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.group(f"run-column-{i % 2}")) for i, f in enumerate(COLUMN)]
)
def test_run_until_train(family, example, prefect_server, upstream_store, demo_data, tmp_path):
    data = example | {"workdir": str(tmp_path / "work")}
    data["model"] = data["model"] | {"family": family}
    data["train"] = data["train"] | {"mode": "lora", "steps": 2, "processes": 1}
    data["dataset"] = data["dataset"] | {"path": str(demo_data)}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    cfg = load_config(path)
    upstream_store.upstream(cfg)
    out = tuneline("run", str(path), "--until", "train", env=prefect_server, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    store = ArtifactStore(cfg.workdir_path())
    manifest = store.read(store.latest("train"), TrainManifest)
    assert (manifest.family, manifest.step, manifest.world_size) == (family, 2, 1)
    assert manifest.exports, "the train artifact lists no exports"
    rebuilt = [s for s in ("scan", "latents", "text") if len(store.versions(s)) != 1]
    assert not rebuilt, f"the run rebuilt the store's fresh caches: {rebuilt}"
