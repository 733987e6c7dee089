"""Helpers shared by the train/validate integration tests (this module holds no tests): small demo-based configs,
the upstream caches, one stage at a time through the real stage runner."""

from __future__ import annotations

import copy
from pathlib import Path

from tuneline.schemas.config import PipelineConfig, parse_config
from tuneline.schemas.demo import DEMO_CONFIG
from tuneline.stages.common.report import Reporter
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.pipeline import PIPELINE, stage
from tuneline.stages.scan.demo import write_demo_dataset

ROOT = Path(__file__).resolve().parents[2]


class RecordingReporter(Reporter):
    """Keeps what a stage reported, as the Prefect reporter would publish it."""

    def __init__(self) -> None:
        self.progress_calls: list[tuple[str, float]] = []
        self.markdowns: dict[str, str] = {}

    def progress(self, key: str, fraction: float, description: str = "") -> None:
        self.progress_calls.append((key, fraction))

    def markdown(self, key: str, text: str, description: str = "") -> None:
        self.markdowns[key] = text


def small_config(workdir: Path, train: dict, **sections: dict) -> PipelineConfig:
    """The demo config in `workdir` with `train` keys overridden and the learning check off (unless asked).
    One training process unless `train` asks for more: the demo's two gloo processes are for tests about
    distribution, which say so with the `ddp` marker (tests/README.md)."""
    data = copy.deepcopy(DEMO_CONFIG)
    data["workdir"] = str(workdir)
    data["train"] = {**data["train"], "processes": 1, **train}
    data["validate"] = {**data["validate"], "learning_check": False}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return parse_config(data)


def build_upstream(cfg: PipelineConfig, reporter: Reporter | None = None) -> StageContext:
    write_demo_dataset(cfg.resolve(cfg.dataset.path))
    ctx = StageContext(cfg, reporter=reporter or Reporter())
    for name in ("scan", "latents", "text"):
        run_stage(ctx, stage(name), PIPELINE)
    return ctx


def train(cfg: PipelineConfig, reporter: Reporter | None = None) -> Path:
    return run_stage(StageContext(cfg, reporter=reporter or Reporter()), stage("train"), PIPELINE)[0]
