"""How a training ends other than by finishing: the train stage's errors, each with the `tuneline` command's exit
code (docs/stopping.md). Apart from the launcher (stages/train/launch.py), which imports torch, so that the CLI
names them without it: a `tuneline stage scan` needs no torch."""

from __future__ import annotations

from tuneline.stages.common.stage import StageStopped


class TrainingFailed(RuntimeError):
    exit_code = 1  # the `tuneline` command's exit code (docs/stopping.md)


class TrainingOutOfMemory(TrainingFailed):
    exit_code = 4


class RankLost(TrainingFailed):
    """A rank was killed, lost its node, or hit a CUDA error."""

    exit_code = 5


class TrainingStopped(TrainingFailed, StageStopped):
    """Stopped on request after writing a checkpoint: `status` shows `stopped`, the rerun continues from it."""

    exit_code = 3


FAILED_AS = {"oom": TrainingOutOfMemory, "cuda": RankLost, "lost": RankLost}
