"""The model facts a memory plan reads: the denoiser's parameter bytes per transformer block, the activations a
forward of one sample saves per edge, the models a render loads. They come from the denoiser built on the meta
device and a traced forward (seconds for a released model, most of it importing diffusers and peft), so they are
kept on disk under a fingerprint of everything they depend on: the model's component configs (the VAE's without
its latent normalisation), the family, the training mode and adapter settings, the dtype, the control images per
sample, the source of the code that computes them and the versions of torch and diffusers. A plan whose facts are
all known builds nothing and imports neither diffusers nor peft; any change to what they depend on is a new
fingerprint, computed afresh.

Where: plan_facts.json beside this file (the default plans of the shipped `--model-config`s and every family's
tiny flavor on a CPU, written by `python -m tuneline.stages.train.planfacts`), then the user's cache
(`plan-facts/` in TUNELINE_CACHE_DIR, else XDG_CACHE_HOME/tuneline or ~/.cache/tuneline). TUNELINE_PLAN_CACHE=off
computes every fact afresh and keeps none.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from functools import cache, cached_property
from importlib import metadata
from pathlib import Path

import torch

from tuneline.stages.train.memtrace import Trace, trace_activations
from tuneline.stages.train.metamodel import denoiser_class, quiet_cast
from tuneline.stages.train.swap import transformer_blocks

PACKAGE = Path(__file__).resolve().parents[2]  # the folder holding stages/ and schemas/
SHIPPED = Path(__file__).with_name("plan_facts.json")
# The code the facts come from (a family's own folder is added per family).
SOURCES = (
    "stages/train/planfacts.py",
    "stages/train/memtrace.py",
    "stages/train/metamodel.py",
    "stages/train/model.py",
    "stages/train/adapters.py",
    "stages/train/swap.py",
    "stages/train/memcheck.py",
    "stages/train/lean.py",
    "stages/families/*.py",
    "schemas/famil*.py",
)
# What computes the facts: the denoiser's traced activations and every module's tensors come from torch and the
# diffusers model code. transformers and peft give only parameter counts, which the component configs (in the key)
# fix, and a machine resolves their patch releases independently of ours (one minor apart is common).
LIBRARIES = ("torch", "diffusers")
ADAPTER_FIELDS = ("mode", "adapter", "lora_rank", "lora_alpha", "lokr_factor")
# The numbers a VAE scales its latents by: no fact depends on them, and the tiny flavors measure them on the demo's
# pictures (their last digits follow the machine's float rounding: thread count, vector instructions).
LATENT_SCALING = ("latents_mean", "latents_std", "scaling_factor", "shift_factor")


def build_meta(fam, model_dir: Path, t, dtype: torch.dtype, quantize: str | None):
    """The denoiser on the meta device, with LoRA adapters when training LoRA, and the lean norms and LoRA inputs
    training gives it (tuneline.stages.train.lean)."""
    cls = denoiser_class(fam, model_dir)
    config = cls.load_config(model_dir, subfolder=fam.denoiser_component)
    with torch.device("meta"):
        den = cls.from_config(config)
    from tuneline.stages.train.lean import HALF, lean_activations
    from tuneline.stages.train.model import freeze_unused, lora_config

    if t.mode == "full":
        den = den.float().requires_grad_(True)
        freeze_unused(fam, den, fam.denoiser_component)
    else:
        den = quiet_cast(den, dtype).requires_grad_(False)
        den.add_adapter(lora_config(t, fam, den))
        for p in den.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    lean_activations(den, t.mode == "lora" and dtype in HALF)
    return den


def weight_bytes(name: str, p: torch.nn.Parameter, linears: set[str], quantize: str | None) -> int:
    if quantize and not p.requires_grad and name.rsplit(".", 1)[0] in linears and p.dim() == 2:
        return p.numel() + 4 * p.shape[0]  # one byte per weight, a float32 scale per row
    return p.numel() * p.element_size()


def describe(fam, den, quantize: str | None) -> tuple[list[dict], int]:
    """(per transformer block: bytes of its frozen weights, of all its weights, its trainable count; bytes of the
    frozen weights outside the blocks)."""
    linears = {n for n, m in den.named_modules() if isinstance(m, torch.nn.Linear)}
    blocks = transformer_blocks(den, fam.block_stacks(den))
    owner = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
    per = [{"frozen": 0, "weights": 0, "trainable": 0} for _ in blocks]
    outside = 0
    for name, p in den.named_parameters():
        i, size = owner.get(id(p)), weight_bytes(name, p, linears, quantize)
        if i is not None:
            per[i]["weights"] += size
            per[i]["trainable" if p.requires_grad else "frozen"] += p.numel() if p.requires_grad else size
        elif not p.requires_grad:
            outside += size
    return per, outside


@cache
def code_digest(family: str) -> str:
    files = {f for pattern in SOURCES for f in PACKAGE.glob(pattern)}
    files |= set((PACKAGE / "stages" / "families" / family).rglob("*.py"))
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.relative_to(PACKAGE).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def config_text(path: Path, component: str) -> str:
    """A component's config as the key reads it: the VAE's without its latent normalisation (LATENT_SCALING)."""
    text = path.read_text(encoding="utf-8")
    if component != "vae":
        return text
    data = json.loads(text)
    return json.dumps({k: v for k, v in data.items() if k not in LATENT_SCALING}, sort_keys=True)


def fingerprint(
    fam, model_dir: Path, t, dtype: torch.dtype, controls: int, amp: torch.dtype | None = None
) -> str | None:
    """The key of a model's facts; None when a component config cannot be read (then nothing is kept)."""
    configs = {}
    for comp in (fam.denoiser_component, "vae", *fam.text_components):
        path = Path(model_dir) / comp / "config.json"
        try:
            configs[comp] = config_text(path, comp) if path.exists() else None
        except (OSError, ValueError):
            return None
    if configs[fam.denoiser_component] is None:
        return None
    key = {
        "configs": configs,
        "family": fam.facts.name,
        "train": {f: getattr(t, f) for f in ADAPTER_FIELDS},
        "dtype": str(dtype),
        "autocast": str(amp),
        "controls": controls,
        "code": code_digest(fam.facts.name),
        # major.minor, as the stages' own keys: a patch release or a local build tag (+cpu, +cu128) traces the same
        "libraries": {lib: ".".join(metadata.version(lib).split(".")[:2]) for lib in LIBRARIES},
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def trace_key(edge: int, frames: int) -> str:
    return f"trace/{edge}" + (f"x{frames}f" if frames > 1 else "")


def cache_file(key: str) -> Path | None:
    if os.environ.get("TUNELINE_PLAN_CACHE") == "off":
        return None
    from tuneline.stages.families.folders import user_cache_dir

    return user_cache_dir() / "plan-facts" / f"{key}.json"


def known(key: str | None) -> dict:
    """The facts kept under `key`: the shipped ones, then the user's."""
    if key is None or cache_file(key) is None:
        return {}
    found: dict = {}
    for path in (SHIPPED, cache_file(key)):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        entry = data.get(key, {}) if path == SHIPPED else data
        found.update(entry if isinstance(entry, dict) else {})
    return found


class Facts:
    """One model's facts for one training setup: read from the caches, computed (and then kept) when missing."""

    def __init__(self, fam, model_dir: Path, t, dtype: torch.dtype, controls: int, amp: torch.dtype | None = None):
        self.fam, self.model_dir, self.t, self.dtype, self.controls = fam, Path(model_dir), t, dtype, controls
        self.amp = amp  # the dtype training's autocast computes in (None: no autocast)
        self.key = fingerprint(fam, model_dir, t, dtype, controls, amp)
        self.data = known(self.key)
        self.added = False

    @cached_property
    def den(self):
        return build_meta(self.fam, self.model_dir, self.t, self.dtype, None)

    def get(self, name: str, compute):
        if name not in self.data:
            self.data[name], self.added = compute(), True
        return self.data[name]

    def save(self) -> None:
        """Keep what was computed in the user's cache (a failed write only costs the next plan its time)."""
        path = cache_file(self.key) if self.key and self.added else None
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.partial")
            tmp.write_text(json.dumps(self.data), encoding="utf-8")
            os.replace(tmp, path)
        except OSError:
            pass

    def describe(self, quantize: str | None) -> tuple[list[dict], int, int]:
        """(describe(), the trainable parameter count) at `quantize`."""

        def compute():
            trainable = sum(p.numel() for p in self.den.parameters() if p.requires_grad)
            return [*describe(self.fam, self.den, quantize), trainable]

        per, outside, trainable = self.get(f"describe/{quantize}", compute)
        return per, outside, trainable

    def trace(self, edge: int, frames: int = 1) -> Trace:
        """The activations one sample of `edge` x `edge` pixels (a clip: `frames` of them) saves
        (memtrace.trace_activations)."""
        found = self.get(
            trace_key(edge, frames),
            lambda: asdict(trace_activations(self.fam, self.den, 1, edge, self.dtype, self.controls, frames, self.amp)),
        )
        return Trace(**found)

    def counts(self) -> dict:
        """Parameters: all, trainable; per transformer block (params, trainable) and outside them (FSDP's root)."""

        def compute():
            blocks = transformer_blocks(self.den, self.fam.block_stacks(self.den))
            per = [
                {
                    "params": sum(p.numel() for p in b.parameters()),
                    "trainable": sum(p.numel() for p in b.parameters() if p.requires_grad),
                }
                for b in blocks
            ]
            params = sum(p.numel() for p in self.den.parameters())
            return {
                "params": params,
                "trainable": sum(p.numel() for p in self.den.parameters() if p.requires_grad),
                "blocks": per,
                "root": params - sum(b["params"] for b in per),
            }

        return self.get("counts", compute)

    def render(self, idle: tuple[str, ...] = ()) -> tuple[int, list[str]]:
        """(parameters of the models an in-training render loads, with the `idle` denoiser components the run
        does not hold; the components nothing here can size)."""
        from tuneline.stages.train.memcheck import render_params

        key = "+".join(("render", *idle))
        count, missing = self.get(key, lambda: list(render_params(self.fam, self.model_dir, idle)))
        return count, missing


def ship(names: list[str]) -> None:
    """Write plan_facts.json: every fact the default plan of each shipped config may read (`tuneline plan
    --model-config NAME`, any --gpu-memory): every resolution the fix search may try, every quantization."""
    from tuneline.schemas.model import SHIPPED_CONFIGS
    from tuneline.stages.families.shipped import shipped_dir
    from tuneline.stages.train.memplan import fix_edges, planner_for
    from tuneline.stages.train.planning import model_user_config

    os.environ["TUNELINE_PLAN_CACHE"] = "off"  # computed afresh, not read back from a cache
    out = tiny_flavors()
    for name in names:
        planner = planner_for(model_user_config(name, None), shipped_dir(name), True, SHIPPED_CONFIGS[name])
        planner.plan(24 * 1024**3, "a 24 GiB CUDA GPU")
        edge, frames = planner.current().edge, planner.current().frames
        for e in (edge, *fix_edges(edge, planner.alignment)):
            planner.facts.trace(e, frames)
        for q in (None, "int8", "fp8"):
            planner.facts.describe(q)
        out[planner.facts.key] = planner.facts.data
        print(f"{name}: {sorted(planner.facts.data)}", flush=True)
    SHIPPED.write_text(json.dumps(out, sort_keys=True, separators=(",", ":")) + "\n", encoding="utf-8")


TINY_MODES = ("lora", "full")


def tiny_flavors() -> dict:
    """The facts of every family's tiny flavor as a CPU run plans it (TINY_MODES at the demo's settings): the
    demo and a first trial of a family plan without building a model on the meta device."""
    import tempfile

    from tuneline.stages.families.registry import family_names, get_family
    from tuneline.stages.train.memplan import planner_for
    from tuneline.stages.train.planning import tiny_user_config

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in family_names():
            model_dir = get_family(name).ensure_model(None, Path(tmp))
            for mode in TINY_MODES:
                planner = planner_for(tiny_user_config(name, mode, tmp), model_dir, False)
                planner.plan(None, "cpu")
                out[planner.facts.key] = planner.facts.data
            print(f"{name} tiny: {sorted(planner.facts.data)}", flush=True)
    return out


if __name__ == "__main__":
    from tuneline.schemas.model import SHIPPED_CONFIGS

    ship(sorted(SHIPPED_CONFIGS))
