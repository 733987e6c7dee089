"""Shared parts of bench/gpu.py: where the figures run (device, tiny or full size), the random-weight full-size
models from the shipped configs, the caches through the plain stage runner, the step timer. The in-process
Trainer is the tests' (tests/trainer.py): one copy, reading the caches as the training worker does."""

from __future__ import annotations

import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

from gpu_text import add_text_encoder

STEPS, WARMUP = 10, 3  # timed steps after warm-up steps (--tiny: 3 after 1, enough to run the code)
ROUNDS = 3  # a comparison's timed rounds on the GPU (--tiny: 1)
IMAGES = 8
# The caching figures' dataset: enough images that the stage's fixed costs (loading the VAE, starting its decode
# workers, publishing) weigh as little beside the encoding as in a user's run of thousands. With 8, on an H200,
# the stage's SDXL rate was 0.53 of the encoder's, most of the gap those fixed costs.
CACHE_IMAGES = 64


class Bench:
    """Where and how big: the device, tiny flavors or full size, the working folder, the examples folder, the
    folder of --trace's profiles (None: no profiling), and whether the timed training figures run with
    train.compile (--compile)."""

    def __init__(self, tiny: bool, work: Path, examples: Path | None, trace: Path | None = None, compile=False):
        import torch

        self.tiny, self.work, self.examples, self.trace, self.compile = tiny, work, examples, trace, compile
        self.steps, self.warmup = (3, 1) if tiny else (STEPS, WARMUP)
        self.rounds = 1 if tiny else ROUNDS  # timed rounds of a comparison (alternating sides, or best of)
        self.cache_images = IMAGES if tiny else CACHE_IMAGES
        self.device = "cpu" if tiny else "cuda"
        self.sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)

    def timed(self, name: str, train: dict) -> tuple[str, dict]:
        """A timed training figure's RESULT name and train keys: `<name>_compiled` with train.compile under
        --compile (each denoiser block compiled; the first steps compile, the warm-up takes them)."""
        return (f"{name}_compiled", {**train, "compile": True}) if self.compile else (name, train)

    def resolution(self, family: str) -> int:
        return 64 if self.tiny else (512 if family == "sd15" else 1024)

    def model(self, family: str) -> str | None:
        """model.path: None (the tiny flavor) or a full-size random-weight folder from the shipped config."""
        return None if self.tiny else str(full_model(family, self.work / "models" / family))

    def config(self, name: str, family: str, train: dict | None = None, images: int = IMAGES, **sections):
        from tuneline.schemas.config import parse_config

        data = {
            "workdir": str(self.work / name),
            "dataset": {"path": str(self.images(family, images))},
            "model": {
                "family": family,
                "path": self.model(family),
                "device": self.device,
                "dtype": "float32" if self.tiny else "bfloat16",
            },
            "buckets": {"resolution": self.resolution(family)},
            "train": {
                "mode": "lora",
                "lora_rank": 16,
                "batch_size": 1,
                "processes": 1,
                "steps": 1000,
                "mixed_precision": "no" if self.tiny else "bf16",
                "ema": False,
                **(train or {}),
            },
            "validate": {"learning_check": False},
        }
        for key, values in sections.items():
            data[key] = {**data.get(key, {}), **values}
        return parse_config(data)

    def images(self, family: str, count: int = IMAGES) -> Path:
        from PIL import Image

        folder = self.work / "images" / f"{self.resolution(family)}-{count}"
        if not folder.is_dir():
            import numpy as np

            folder.mkdir(parents=True)
            rng = np.random.default_rng(0)
            edge = self.resolution(family)
            for i in range(count):
                pixels = rng.integers(0, 255, (edge, edge, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:03d}.png")
                (folder / f"{i:03d}.txt").write_text(f"a photo number {i}")
        return folder


def full_model(family: str, out: Path) -> Path:
    """A diffusers folder of random weights in the released model's sizes (bf16 on disk), built once."""
    if (out / "model_index.json").is_file():
        return out
    import importlib
    import shutil

    import torch

    from tuneline.stages.families.shipped import shipped_dir

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(shipped_dir(family), tmp)
    index = json.loads((tmp / "model_index.json").read_text())
    torch.manual_seed(0)
    # Random initialisation of billions of weights takes minutes on the CPU and seconds on the GPU.
    init = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name, entry in index.items():
        if not (isinstance(entry, list) and (tmp / name / "config.json").is_file()) or name == "scheduler":
            continue
        cls = getattr(importlib.import_module(entry[0]), entry[1])
        with init, bfloat16_default():  # float32 weights of a 20 B model would outgrow an H100
            model = build(cls, entry[0], tmp / name)
        model.to(torch.bfloat16).save_pretrained(tmp / name)
        del model
    if "text_encoder" not in index:  # the shipped config has none: the figures still need the text cache
        add_text_encoder(family, tmp, init)
    tmp.rename(out)
    return out


@contextmanager
def bfloat16_default():
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build(cls, library: str, folder: Path):
    """One component of random weights from its config.json."""
    if library == "diffusers":
        return cls.from_config(cls.load_config(folder))
    return cls(cls.config_class.from_pretrained(folder))


def result(metric: str, value: float, op: str, target: float, also: bool = True, **second: float) -> None:
    """A RESULT line; `second`: the second value and the anchor's, after the PASS|FAIL word (which also needs
    `also`, the second value's own goal)."""
    ok = (value <= target if op == "<=" else value >= target) and also
    tail = "".join(f" {k} {v:.6g}" for k, v in second.items())
    print(f"RESULT {metric} {value:.6g} goal {op} {target:g} {'PASS' if ok else 'FAIL'}{tail}", flush=True)


def caches(cfg):
    """Scan, latents and text for `cfg` through the plain stage runner; returns the context."""
    from tuneline.stages.common.stage import StageContext, run_stage
    from tuneline.stages.pipeline import PIPELINE, stage

    ctx = StageContext(cfg)
    for name in ("scan", "latents", "text"):
        run_stage(ctx, stage(name), PIPELINE)
    return ctx


def median_seconds(b: Bench, call) -> float:
    """Median seconds of `call()` over b.steps calls after b.warmup, the device synchronised around each."""
    times = []
    for _ in range(b.warmup + b.steps):
        b.sync()
        start = time.perf_counter()
        call()
        b.sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[b.warmup :])


@contextmanager
def worker_threads(trainer):
    """torch's intra-op threads as a training worker has them (the train stage starts each with OMP_NUM_THREADS =
    train.threads_per_process, 1 by default), not this process's one per core: the in-process trainer is timed as
    the worker steps."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(trainer.t.threads_per_process)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def step_seconds(b: Bench, trainer) -> float:
    """Median seconds of one step of the real loop after warm-up, at the worker's thread count."""
    from tests.trainer import feed

    with worker_threads(trainer), feed(trainer) as fed:
        return median_seconds(b, lambda: trainer.train_step([next(fed) for _ in range(trainer.t.grad_accumulation)]))


TRACE_STEPS = 3


def profile_steps(b: Bench, trainer, name: str) -> None:
    """`--trace DIR`: TRACE_STEPS more steps of the real loop under torch.profiler, after the timed ones, on batches
    fetched first (a feed stall shows in the timed steps, not here): where a figure that misses its anchor spends
    its step."""
    if b.trace is None:
        return
    from tests.trainer import feed

    with worker_threads(trainer):  # traced as timed
        with feed(trainer) as fed:
            batches = [[next(fed) for _ in range(trainer.t.grad_accumulation)] for _ in range(TRACE_STEPS)]
        steps = iter(batches)
        profile_calls(b, name, lambda: trainer.train_step(next(steps)))


def profile_calls(b: Bench, name: str, call) -> None:
    """`--trace DIR`: TRACE_STEPS calls of `call` under torch.profiler. The trace goes to DIR/NAME.json.gz (Perfetto
    opens it as it is) and the ops that took the most device time (host time on the CPU) are printed."""
    if b.trace is None:
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(TRACE_STEPS):
            call()
        b.sync()
    b.trace.mkdir(parents=True, exist_ok=True)
    path = b.trace / f"{name}.json.gz"
    prof.export_chrome_trace(str(path))  # gzipped: the name ends in .gz
    key = "self_device_time_total" if b.device == "cuda" else "self_cpu_time_total"
    print(f"{name}: trace of {TRACE_STEPS} steps in {path}; its ops by {key}:", flush=True)
    print(prof.key_averages().table(sort_by=key, row_limit=15), flush=True)


def free(b: Bench) -> None:
    import gc

    import torch

    gc.collect()
    if b.device == "cuda":
        torch.cuda.empty_cache()
