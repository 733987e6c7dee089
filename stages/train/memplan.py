"""The memory plan: the peak device memory one training process will need, worked out before any worker starts.

The denoiser is built from its config on the meta device (shapes, no weights, no compute), so a released model's
plan costs seconds on any machine; what the plan reads of it is kept (tuneline.stages.train.planfacts), so a model
planned before answers without building anything. Terms:

- weights: every parameter at the dtype training holds it in (full: float32 masters; LoRA: model.dtype, int8/fp8
  linears at one byte), the swapped blocks' weights counted only for the R = B - N blocks resident at a time;
- trainable parameters, their gradients and optimizer state (AdamW two float32 moments, adamw8bit two bytes);
  the EMA copy (train.ema);
- activations: a forward of the largest bucket at train.batch_size traced on the meta device, summing the tensors
  autograd saves for backward (saved_tensors_hooks), per transformer block and outside them, with CUDA autocast's
  casts where training runs under autocast (tuneline.stages.train.memtrace); for a paired dataset
  of an edit family the forward includes a control image's tokens at the size they are cached at. With checkpointing
  the blocks keep only their inputs (offload: not even those) plus one block's worth recomputed in backward;
- with in-training validation on, the VAE decoder and text encoders every rank loads to render, less the
  activations they replace (tuneline.stages.train.memextra); DDP's gradient buckets are the gradients
  (gradient_as_bucket_view=True);
- on CUDA a fixed reserve for the context and the caching allocator;
- under train.parallelism fsdp, the sharded terms and FSDP's gathered copies (tuneline.stages.train.fsdpplan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tuneline.stages.common.sizing import latent_frames
from tuneline.stages.train.fsdpplan import allowed, sharded_terms, shards_that_fit
from tuneline.stages.train.memtrace import Trace
from tuneline.stages.train.metamodel import largest_fitting
from tuneline.stages.train.model import gpu_autocast
from tuneline.stages.train.optimizers import STATE_BYTES
from tuneline.stages.train.planfacts import Facts
from tuneline.stages.train.swap import max_blocks_to_swap

GIB = 1024**3
CUDA_RESERVE = int(0.75 * GIB)  # CUDA context, cuBLAS workspace, allocator rounding
SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


def largest_edge(buckets, alignment: int) -> int:
    """The edge of a square with the target bucket area (attention and convolutions scale with the area). With
    resolution_type pixel the shorter edge is the resolution, so the square is the planned bucket; a wider one
    (up to buckets.max_aspect) needs more, in proportion to its area."""
    r = buckets.resolution
    if buckets.resolution_type == "area":
        area = r * 1024 * 1024
    elif buckets.resolution_type == "pixel_area":
        area = r * r
    else:
        area = r * r
    return max(alignment, int(math.sqrt(area)) // alignment * alignment)


def fix_edges(edge: int, alignment: int) -> list[int]:
    """The smaller resolutions the fix search may suggest, largest first."""
    a = alignment
    return sorted({max(a, int(edge * f) // a * a) for f in (0.875, 0.75, 0.625, 0.5)} - {edge}, reverse=True)


@dataclass
class Setting:
    """What the plan varies to find a fix."""

    blocks_to_swap: int
    checkpointing: bool | str
    quantize: str | None
    optimizer: str
    batch: int
    edge: int
    shards: int | None = None  # train.parallelism fsdp over this many processes (None: DDP)
    frames: int = 1  # a video family's clip length (its largest frame budget); 1 for images


def planned_frames(cfg, fam) -> int:
    """A video family's longest clip as trained (its largest buckets.frames budget: the plan reads the config, not
    the scan), 1 for an image family."""
    return max(cfg.buckets.frames or fam.facts.frame_buckets) if fam.facts.video else 1


def planned_controls(cfg, fam) -> int:
    """Control images per sample the training feeds: one for a paired dataset (dataset.control, a folder or the
    samples' members, the edit demo's included) of a family that takes control, else none. Folders of several references are not counted (the plan
    reads the config, not the scan): each adds one control's tokens."""
    from tuneline.stages.scan.controls import by_members, paired

    return int(fam.takes_control and (paired(cfg) or bool(by_members(cfg))))


def amp_dtype(cfg, autocast: bool) -> torch.dtype | None:
    """The dtype autocast computes in on a bf16-capable GPU (the trainer's own choice), or None."""
    return gpu_autocast(cfg.train.mixed_precision, cfg.model.dtype, True) if autocast else None


def size(b: int) -> str:
    return f"{b / GIB:8.2f} GiB" if abs(b) >= GIB / 10 or b == 0 else f"{b / 2**20:8.1f} MiB"


@dataclass
class MemoryPlan:
    terms: list[tuple[str, int]]
    free: int | None  # bytes the device has for this process; None on a CPU device
    where: str
    blocks: int
    fixes: list[str] = field(default_factory=list)
    step_flops: int = 0  # one sample's forward and backward, for the stop grace (tuneline.stages.train.stopping)
    checkpoint_bytes: int = 0  # trainable weights, optimizer state and EMA
    grace: int = 0  # seconds a stop may take to finish its step and checkpoint

    @property
    def total(self) -> int:
        return sum(b for _, b in self.terms)

    @property
    def fits(self) -> bool:
        return self.free is None or self.total <= self.free

    def as_json(self) -> dict:
        return {
            "terms": {n: b for n, b in self.terms},
            "total": self.total,
            "free": self.free,
            "fits": self.fits,
            "device": self.where,
            "blocks": self.blocks,
            "max_blocks_to_swap": max_blocks_to_swap(self.blocks),
            "fixes": self.fixes,
            "step_flops": self.step_flops,
            "checkpoint_bytes": self.checkpoint_bytes,
            "grace": self.grace,
        }

    def text(self) -> str:
        width = max(len(n) for n, _ in self.terms)
        lines = [f"memory plan per training process ({self.where}):"]
        lines += [f"  {n:<{width}}  {size(b)}" for n, b in self.terms]
        lines.append(f"  {'planned peak':<{width}}  {size(self.total)}")
        if self.free is None:
            lines.append("  training on the CPU: no device memory to check")
        else:
            lines.append(
                f"  {'device free':<{width}}  {self.free / GIB:8.2f} GiB -> {'fits' if self.fits else 'does NOT fit'}"
            )
        lines.append(
            f"  transformer blocks: {self.blocks} (train.blocks_to_swap can be 0..{max_blocks_to_swap(self.blocks)})"
        )
        lines.append(
            f"  a stop may take up to {self.grace} s to finish its step and checkpoint: give the job at least that "
            f"(Kubernetes terminationGracePeriodSeconds, Slurm --signal; docs/stopping.md)"
        )
        if not self.fits:
            lines.append(
                "  settings that would make it fit:"
                if self.fixes
                else "  no combination of the planned settings fits: use a GPU with more memory"
            )
            lines += [f"    {f}" for f in self.fixes]
        return "\n".join(lines)


class Planner:
    """Plans one config's training on one device, and the settings that would make it fit."""

    def __init__(self, cfg, fam, model_dir: Path, cuda: bool, dtype: torch.dtype, autocast: bool):
        self.cfg, self.fam, self.t, self.cuda, self.autocast = cfg, fam, cfg.train, cuda, autocast
        self.dtype = dtype if self.t.mode == "lora" else torch.float32
        self.facts = Facts(fam, model_dir, self.t, self.dtype, planned_controls(cfg, fam), amp_dtype(cfg, autocast))
        self.alignment = cfg.buckets.alignment or fam.facts.vae_factor * fam.facts.patch_size
        render_dtype = dtype if autocast else torch.float32  # what hooks.Hooks.render computes in
        # The folder's denoisers a run holds (model.expert high or low: one of two timestep experts); a render
        # loads the others too (Family.load_pipeline), beside the VAE decoder and text encoders.
        self.held, idle = fam.expert_split(model_dir, cfg.model.expert)
        self.render_bytes, self.unsized = 0, []
        if cfg.train.effective_validate_every():
            count, self.unsized = self.facts.render(idle)
            self.render_bytes = count * torch.empty(0, dtype=render_dtype).element_size()

    def trace(self, batch: int, edge: int, frames: int = 1) -> Trace:
        """Activations grow with the batch in proportion (every saved tensor has the batch dimension but the
        few shared ones), so one sample is traced per edge (and clip length) and scaled."""
        one = self.facts.trace(edge, frames)
        return Trace(one.outside * batch, [b * batch for b in one.blocks], [i * batch for i in one.inputs])

    def describe(self, quantize: str | None) -> tuple[list[dict], int, int]:
        """Per block, outside the blocks, trainable: of every timestep expert the run holds (each one denoiser of
        the planned shape; model.expert both holds them all, one at a time a single one)."""
        per, outside, trainable = self.facts.describe(quantize)
        n = self.held
        return [{k: v * n for k, v in x.items()} for x in per], outside * n, trainable * n

    @property
    def blocks(self) -> int:
        return len(self.facts.counts()["blocks"])

    def current(self) -> Setting:
        t = self.t
        return Setting(
            t.blocks_to_swap,
            t.gradient_checkpointing,
            self.cfg.model.quantize,
            t.optimizer,
            t.batch_size,
            largest_edge(self.cfg.buckets, self.alignment),
            t.processes * t.nodes if t.parallelism == "fsdp" else None,
            planned_frames(self.cfg, self.fam),
        )

    def terms(self, s: Setting) -> list[tuple[str, int]]:
        t, full = self.t, self.t.mode == "full"
        per, outside, trainable = self.describe(s.quantize)
        key = "weights" if full else "frozen"  # what swaps: every weight of a block, or its frozen base
        r = len(per) - s.blocks_to_swap
        window = max(sum(x[key] for x in per[i : i + r]) for i in range(len(per) - r + 1)) if per else 0
        if s.blocks_to_swap:  # swapping timestep experts keep one expert's blocks on the device (swap.ExpertSwappers)
            window //= self.held
        swapped_trainable = sum(x["trainable"] for x in per[r:]) if full and s.blocks_to_swap else 0
        tr = self.trace(s.batch, s.edge, s.frames)
        kept = tr.outside + (
            sum(tr.blocks) if not s.checkpointing else 0 if s.checkpointing == "offload" else sum(tr.inputs)
        )
        out = [
            (
                f"weights ({'float32 masters' if full else self.label(s.quantize)})",
                4 * trainable if full else outside + sum(x["frozen"] for x in per),
            ),
            (f"swapped blocks ({s.blocks_to_swap} of {len(per)} in CPU memory)", -(sum(x[key] for x in per) - window)),
            ("trainable parameters (float32)", 0 if full else 4 * trainable),
            ("gradients", 4 * trainable),
            (f"optimizer state ({s.optimizer})", STATE_BYTES[s.optimizer] * (trainable - swapped_trainable)),
            ("EMA", 4 * trainable if t.ema else 0),
            (
                f"activations ({self.ckpt_label(s.checkpointing)}, batch {s.batch}, {s.edge}x{s.edge}"
                + (f", {s.frames} frames)" if s.frames > 1 else ")"),
                kept,
            ),
            ("backward working memory (one block)", max(tr.blocks, default=0)),
        ]
        freed = out[-1][1] + out[-2][1]  # a render runs between steps, when the activations are gone
        unsized = (
            f" ({', '.join(self.unsized)}: no weights or config here to size, not counted)" if self.unsized else ""
        )
        render = ("validation render models beyond the freed activations" + unsized, max(0, self.render_bytes - freed))
        out.append(render)
        if s.shards:  # tuneline.stages.train.fsdpplan
            gathered = 2 if self.autocast else torch.finfo(self.dtype).bits // 8
            counts = self.facts.counts()
            out = sharded_terms(out, s.shards, counts["blocks"], counts["root"], gathered, t.fsdp_cpu_offload)
        if self.cuda:
            out.append(("CUDA context and allocator reserve", CUDA_RESERVE))
        return out

    def label(self, quantize: str | None) -> str:
        return f"{quantize} linears" if quantize else str(self.dtype).removeprefix("torch.")

    @staticmethod
    def ckpt_label(c) -> str:
        return {True: "checkpointed", False: "not checkpointed", "offload": "checkpointed, offloaded"}[c]

    def plan(self, free: int | None, where: str) -> MemoryPlan:
        from tuneline.stages.train.stopping import grace_seconds

        s = self.current()
        p = MemoryPlan(self.terms(s), free, where, self.blocks)
        if not p.fits:
            p.fixes = self.fixes(s, free)
        p.step_flops, p.checkpoint_bytes = self.step_figures(s)
        p.grace = grace_seconds(p.as_json(), self.cfg)
        return p

    def step_figures(self, s: Setting) -> tuple[int, int]:
        """(FLOPs of one sample's step: 6 per parameter and latent position, 8 when checkpointing recomputes the
        forward; bytes of a checkpoint). A UNet's lower levels see fewer positions: an over-estimate there. A clip's
        positions are its latent frames' (video tokens: latent frames x h x w)."""
        params, trainable = self.facts.counts()["params"], self.facts.counts()["trainable"]
        side = s.edge // (self.fam.facts.vae_factor * self.fam.facts.patch_size)
        positions = side * side * latent_frames(s.frames, self.fam.facts.temporal_factor)
        flops = (8 if s.checkpointing else 6) * params * positions
        return flops, trainable * (4 + STATE_BYTES[s.optimizer] + (4 if self.t.ema else 0))

    def total(self, s: Setting) -> int:
        return sum(b for _, b in self.terms(s))

    def fixes(self, s: Setting, free: int) -> list[str]:
        """Each single change that brings the plan under `free` (the smallest such swap, batch or resolution),
        or, when none does alone, the combination that does."""
        from dataclasses import replace

        def fits(x: Setting) -> bool:
            return self.total(x) <= free

        def show(change: str, x: Setting) -> str:
            return f"{change}  (planned peak {self.total(x) / GIB:.2f} GiB)"

        out, nmax = [], max_blocks_to_swap(self.blocks)
        full = self.t.mode == "full"
        quant = None if full or s.quantize else ("fp8" if self.cuda else "int8")
        singles = [
            ("train.gradient_checkpointing: true", replace(s, checkpointing=True)) if not s.checkpointing else None,
            ("train.gradient_checkpointing: offload", replace(s, checkpointing="offload"))
            if s.checkpointing != "offload"
            else None,
            (f"model.quantize: {quant}", replace(s, quantize=quant)) if quant else None,
            ("train.optimizer: adamw8bit", replace(s, optimizer="adamw8bit")) if s.optimizer == "adamw" else None,
        ]
        out += [show(c, x) for c, x in filter(None, singles) if fits(x)]
        swap = next((n for n in range(s.blocks_to_swap + 1, nmax + 1) if fits(replace(s, blocks_to_swap=n))), None)
        if swap is not None:
            out.append(show(f"train.blocks_to_swap: {swap}", replace(s, blocks_to_swap=swap)))
        shards = shards_that_fit(lambda n: self.total(replace(s, shards=n)), s.shards or 1, free)
        if shards is not None:
            out.append(
                show(
                    f"train.parallelism: fsdp on {shards} processes (train.processes x train.nodes)",
                    replace(s, shards=shards),
                )
            )
        batch = next((b for b in range(s.batch - 1, 0, -1) if fits(replace(s, batch=b))), None)
        if batch is not None:
            out.append(
                show(
                    f"train.batch_size: {batch} (raise train.grad_accumulation to keep the global batch)",
                    replace(s, batch=batch),
                )
            )
        budgets = sorted(self.cfg.buckets.frames or self.fam.facts.frame_buckets)
        frames = next((f for f in reversed(budgets) if f < s.frames and fits(replace(s, frames=f))), None)
        if frames is not None:
            kept = [f for f in budgets if f <= frames]
            out.append(show(f"buckets.frames: {kept} (shorter clips)", replace(s, frames=frames)))
        edge = largest_fitting(fix_edges(s.edge, self.alignment), lambda e: fits(replace(s, edge=e)))
        if edge is not None:
            res = edge if self.cfg.buckets.resolution_type != "area" else round(edge * edge / 1024**2, 3)
            out.append(show(f"buckets.resolution: {res}", replace(s, edge=edge)))
        if not out:
            all_in = replace(s, checkpointing="offload", quantize=s.quantize or quant, optimizer="adamw8bit")
            swap = next((n for n in range(s.blocks_to_swap, nmax + 1) if fits(replace(all_in, blocks_to_swap=n))), None)
            if swap is not None:
                parts = (
                    ["train.gradient_checkpointing: offload", "train.optimizer: adamw8bit"]
                    + ([f"train.blocks_to_swap: {swap}"] if swap != s.blocks_to_swap else [])
                    + ([f"model.quantize: {quant}"] if quant else [])
                )
                out.append(show(" + ".join(parts), replace(all_in, blocks_to_swap=swap)))
        return allowed(out, s.shards)


def free_memory(device: torch.device) -> int | None:
    """Bytes this process can use on `device`, or None on a CPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free


def planner_for(cfg, model_dir: Path, cuda: bool, family: str | None = None) -> Planner:
    """The planner of `cfg` on a CUDA device (model.dtype, autocast bf16 where `auto`) or on the CPU (float32)."""
    from tuneline.stages.families.registry import get_family
    from tuneline.stages.families.resolve import dtypes

    autocast = cuda and cfg.train.mixed_precision != "no"
    dtype = dtypes()[cfg.model.dtype] if cuda else torch.float32
    return Planner(cfg, get_family(family or cfg.model.family), model_dir, cuda, dtype, autocast)


def plan(
    cfg, model_dir: Path, device: torch.device, gpu_memory_gib: float | None = None, family: str | None = None
) -> MemoryPlan:
    """The plan for training `cfg` on `device`, or, with `gpu_memory_gib`, on a CUDA card of that size with
    model.dtype and autocast as they would run there (bf16 where `auto`)."""
    planner = planner_for(cfg, model_dir, gpu_memory_gib is not None or device.type == "cuda", family)
    if gpu_memory_gib is not None:
        p = planner.plan(int(gpu_memory_gib * GIB), f"a {gpu_memory_gib:g} GiB CUDA GPU")
    else:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        p = planner.plan(free_memory(device), name)
    planner.facts.save()
    return p
