"""What the quick start's `tuneline run` says while it works and what its pipeline run shows: read from the
session's demo run (conftest's demo_run), so this costs no run of its own."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

import tuneline.flows  # noqa: F401  (its Prefect settings: the ephemeral server read below may start slowly)
from tests.helpers import prefect_api

pytestmark = pytest.mark.slow

STEP = re.compile(r"step (\d+)/(\d+) loss [\d.]+ lr \S+ \(([\d.]+) steps/s, (\d+s|\d+m\d\ds|\d+h\d\dm) left\)")


def test_the_run_says_what_it_is_doing(demo_run):
    err = demo_run["stderr"]
    lines = err.splitlines()
    first = next(i for i, line in enumerate(lines) if "starting a temporary Prefect server" in line)
    assert "set PREFECT_API_URL to use yours" in lines[first]
    assert first < next(i for i, line in enumerate(lines) if "Beginning flow run" in line)
    steps = [m.groups() for m in map(STEP.search, lines) if m]
    assert steps and steps[-1][0] == steps[-1][1], "no `step N/M loss … (X steps/s, T left)` lines"
    assert all(float(rate) > 0 for _, _, rate, _ in steps)
    assert len([line for line in lines if re.search(r"validate: image \d+/4 \S+\.png 'a ", line)]) == 4
    assert "procwatch" not in err and ".partial.spec-" not in err  # the launcher's own command line is not news
    assert "━" not in err  # no progress bars in a log that is not a terminal
    final = re.search(r"final loss: [\d.]+ \(training loss averaged over the last 10 steps", demo_run["stdout"])
    assert final, demo_run["stdout"][-2000:]


def test_the_pipeline_run_holds_the_grid_loss_and_learning(demo_run):
    """The pipeline run's own artifacts (read from the run's Prefect database): the labelled grid, the loss curve
    and the learning figures, pictures inline."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowFilter, FlowFilterName

    async def artifacts() -> dict[str, str]:
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["tuneline-pipeline"])))
            # Other tests of the session run pipelines against the same Prefect database: the demo's is the one
            # whose config names the quick start's workdir.
            [run] = [r for r in runs if r.parameters["config"]["workdir"] == str(demo_run["workdir"])]
            arts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])), limit=200
            )
        return {a.key: a.data for a in arts if a.flow_run_id == run.id and a.key}

    with prefect_api():  # the demo's own temporary server's database, as `tuneline run` left it
        arts = asyncio.run(artifacts())
    grid, loss = arts["pipeline-validate-grid"], arts["pipeline-train-loss"]
    assert grid.startswith("![grid](data:image/png;base64,")
    for prompt in ("a red square", "a green circle", "a blue square", "a yellow circle"):
        assert re.search(rf"\| !\[\d+-seed\d+\.png\]\(data:image/png;base64,[^)]+\) \| {prompt} \|", grid), prompt
    assert "![loss](data:image/png;base64," in loss
    assert "color_accuracy" in arts["pipeline-learning"] and "final loss" in arts["pipeline-learning"]


def test_the_run_measures_its_step_and_the_plan_shows_it(demo_run):
    """The pace after the warm-up, the manifest's step_seconds, and `tuneline plan` of the same config naming it."""
    from tests.helpers import tuneline

    pace = r"pace: [\d.]+ s/step measured over steps 2-3 \(step 1, with the warm-up, took [\d.]+ s\): the 997 steps"
    assert re.search(pace + r" left take about (\d+s|\d+m\d\ds|\d+h\d\dm)", demo_run["stderr"])
    out = tuneline("plan", cwd=demo_run["clone"])
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.search(r"time per step: ([\d.]+) s, measured by train version (\S+) \(2 process", out.stdout)
    assert found, out.stdout
    manifest = json.loads((demo_run["workdir"] / "artifacts" / "train" / found[2] / "manifest.json").read_text())
    assert manifest["step_seconds"] > 0 and float(found[1]) == float(f"{manifest['step_seconds']:.3g}")
