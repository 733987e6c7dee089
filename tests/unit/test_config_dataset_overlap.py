"""A dataset folder that is the workdir, contains it, or lies in its outputs is refused at load naming both
fields; nothing is written."""

from __future__ import annotations

import pytest

from tuneline.schemas.config import ConfigError, load_config


def _write(tmp_path, dataset: str, workdir: str):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"workdir: {workdir}\ndataset:\n  path: {dataset}\n  demo: false\nmodel:\n  family: tiny\n", encoding="utf-8"
    )
    return cfg


@pytest.mark.parametrize(
    "dataset,workdir", [("{t}/w", "{t}/w"), (".", "{t}/w"), ("{t}", "{t}/w"), ("{t}/w/artifacts/validate", "{t}/w")]
)
def test_dataset_and_workdir_overlap_is_refused(tmp_path, dataset, workdir):
    cfg = _write(tmp_path, dataset.format(t=tmp_path), workdir.format(t=tmp_path))
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert "dataset.path" in str(err.value) and "workdir" in str(err.value), str(err.value)
    assert not (tmp_path / "w").exists()


def test_a_dataset_folder_inside_the_workdir_is_fine(tmp_path):
    cfg = load_config(_write(tmp_path, "images", str(tmp_path / "w")))
    assert cfg.resolve(cfg.dataset.path) == tmp_path / "w" / "images"
    load_config(None, str(tmp_path / "demo"))  # the demo's demo-data folder
