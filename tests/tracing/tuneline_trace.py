"""Observing a training run from the tests, with nothing in the product: which images each rank trains per
micro-batch, which models are alive between steps, and which model components a process loaded.

`enable(directory)` in the test process sets TRACE_ENV and puts this folder's sitecustomize.py on PYTHONPATH, so
every process the run starts (torchrun workers included) installs the same wrappers when it imports the modules they
wrap. The wrappers call through to the real methods and only record what they see.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import time
from pathlib import Path

TRACE_ENV = "TUNELINE_TEST_TRACE"  # a directory: each rank appends one line per micro-batch it trains
# Test only: seconds a checkpoint written after a stop takes in addition to its own writing, standing in for a
# large model's checkpoint on a slow disk (the stop grace test needs step + checkpoint > torchrun's default 30 s).
SLOW_STOP_ENV = "TUNELINE_TEST_SLOW_STOP_S"
# Test only: "RANK:STEP": that rank raises at that step, as a rank-local failure (a bad read, a CUDA error) would.
FAIL_RANK_ENV = "TUNELINE_TEST_FAIL_RANK"
HERE = Path(__file__).resolve().parent
LOADED: list[str] = []  # components this process loaded from model folders, in order
_depth = [0]


def enable(monkeypatch, directory: Path) -> None:
    monkeypatch.setenv(TRACE_ENV, str(directory))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))


def live_models() -> dict[str, int]:
    """Model instances alive in this process by class (diffusers and transformers models)."""
    import torch

    found: dict[str, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.nn.Module) and type(obj).__module__.startswith(
            ("diffusers.models", "transformers.models")
        ):
            if hasattr(obj, "config"):
                found[type(obj).__name__] = found.get(type(obj).__name__, 0) + 1
    return found


def _recording(method, names):
    """`method` wrapped to append names(self, args, kwargs, result) to LOADED, outermost call only (a loader that
    falls back to another loader records once)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        _depth[0] += 1
        try:
            result = method(self, *args, **kwargs)
        finally:
            _depth[0] -= 1
        if _depth[0] == 0:
            LOADED.extend(names(self, args, kwargs, result))
        return result

    return wrapper


def install_family_wrappers(module) -> None:
    import torch

    cls = module.DiffusersFamily
    if getattr(cls, "_traced", False):
        return
    cls._traced = True
    cls.load_vae = _recording(cls.load_vae, lambda s, a, k, r: ["vae"])
    cls.load_vae_encoder = _recording(cls.load_vae_encoder, lambda s, a, k, r: ["vae"])
    cls.load_denoiser = _recording(cls.load_denoiser, lambda s, a, k, r: [s.denoiser_component])
    cls.load_text_encoders = _recording(cls.load_text_encoders, lambda s, a, k, r: list(s.text_components))
    cls.load_pipeline = _recording(
        cls.load_pipeline,
        lambda s, a, k, r: [
            c
            for c, m in r.components.items()
            if isinstance(m, torch.nn.Module)
            and not (c == s.denoiser_component and (k.get("denoiser") is not None or len(a) > 3))
        ],
    )


def install_trainer_wrapper(module) -> None:
    """Before each optimizer step (after the previous step's checkpoint and validation render): per micro-batch,
    the images the step trains on, the models alive and the components loaded so far."""
    _wrap_once(module.Trainer, "train_step", _traced_step)


def _wrap_once(owner, name: str, make) -> None:
    """owner.<name> replaced by make(the original), once however often the module is imported."""
    mark = f"_traced_{name}"
    if getattr(owner, mark, False):
        return
    setattr(owner, mark, True)
    setattr(owner, name, make(getattr(owner, name)))


def _traced_step(step):
    @functools.wraps(step)
    def train_step(self, micro, *args, **kwargs):  # the stop/checkpoint flags pass through
        folder = os.environ.get(TRACE_ENV)
        if folder:
            with open(Path(folder) / f"trace-rank{self.rank}.jsonl", "a", encoding="utf-8") as f:
                for m, fed in enumerate(micro):
                    paths = self.data.reader.batch(fed.mb.bucket, fed.mb.rows).paths
                    f.write(
                        json.dumps(
                            {
                                "step": self.step + 1,
                                "micro": m,
                                "bucket": fed.mb.bucket,
                                "paths": list(paths),
                                "models": live_models(),
                                "loaded": list(LOADED),
                            }
                        )
                        + "\n"
                    )
        fail = os.environ.get(FAIL_RANK_ENV, "").split(":")
        if fail != [""] and (self.rank, self.step + 1) == (int(fail[0]), int(fail[1])):
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step + 1}")
        return step(self, micro, *args, **kwargs)

    return train_step


def install_slow_stop(module) -> None:
    """checkpoint.save sleeps SLOW_STOP_ENV seconds first once the launcher has marked a stop (the mark beside the
    work folder: tuneline.stages.train.stopping)."""
    if os.environ.get(SLOW_STOP_ENV):
        _wrap_once(module, "save", _slow_save)


def _slow_save(save):
    @functools.wraps(save)
    def slow_save(root, *args, **kwargs):
        work = Path(root).parent
        if list(work.parent.glob(f"{work.name}.stop-*.json")):
            time.sleep(float(os.environ[SLOW_STOP_ENV]))
        return save(root, *args, **kwargs)

    return slow_save


def install_render_trace(module) -> None:
    """Each rank's in-training validation renders: one line per render with its prompts."""
    _wrap_once(module.Hooks, "render", _traced_render)


def _traced_render(render):
    @functools.wraps(render)
    def traced(self, samples):
        folder = os.environ.get(TRACE_ENV)
        if folder:
            with open(Path(folder) / f"render-rank{self.run.rank}.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": self.trainer.step, "prompts": [s.prompt for s in samples]}) + "\n")
        return render(self, samples)

    return traced


WRAP = {
    "tuneline.stages.families.common": install_family_wrappers,
    "tuneline.stages.train.hooks": install_render_trace,
    "tuneline.stages.train.loop": install_trainer_wrapper,
    "tuneline.stages.train.checkpoint": install_slow_stop,
}


class _AfterImport:
    """A meta path finder that lets the normal finder and loader do the import, then wraps the module (nothing is
    imported at start-up, so processes that never train pay nothing)."""

    def find_spec(self, name, path=None, target=None):
        if name not in WRAP:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        real = spec.loader.exec_module

        def exec_module(module):
            real(module)
            WRAP[name](module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Wrap the modules now if imported, else when they are."""
    for name, wrap in WRAP.items():
        if name in sys.modules:
            wrap(sys.modules[name])
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
