"""The CLI names the train stage's errors (the exit codes of docs/stopping.md) without importing the training
launcher, and with it torch: a `tuneline stage scan` or a refused command spends no seconds importing it."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT

CHECK = (
    "import sys\n"
    "from tuneline.flows.cli_common import user_errors\n"
    "from tuneline.stages.train.failures import TrainingStopped\n"
    "assert TrainingStopped in [c for e in user_errors() for c in e.__subclasses__()]\n"
    "print(sorted(m for m in ('torch', 'tuneline.stages.train.launch') if m in sys.modules))\n"
)


def test_the_cli_knows_training_errors_without_torch():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_the_launcher_raises_the_errors_the_cli_names():
    from tuneline.stages.train import failures, launch, workers

    assert launch.TrainingFailed is failures.TrainingFailed
    assert workers.TrainingFailed is failures.TrainingFailed and workers.TrainingStopped is failures.TrainingStopped
