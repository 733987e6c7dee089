"""What every diffusers-based family shares: model folders, identities, loading, saving.

A family adapter subclasses `DiffusersFamily` and supplies only what differs: its pipeline class, component names,
tiny flavor, text encoding, denoiser call and prompt kwargs (the SD1.5 adapter is the smallest complete one).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FamilyFacts
from tuneline.stages.families import folders
from tuneline.stages.families.base import MicroCond, Place, TextEncoders
from tuneline.stages.families.singlefile_import import convert_single_file
from tuneline.stages.families.split_files import convert_split_files
from tuneline.stages.families.stock import diffusers_pipeline


class DiffusersFamily:
    """Shared implementation of the Family protocol for diffusers pipeline folders."""

    facts: ClassVar[FamilyFacts]
    lora_target_modules: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    text_encoder_lora_targets: ClassVar[tuple[str, ...]] = ()
    negative_required: ClassVar[bool] = False
    single_file_layouts: ClassVar[dict[str, str]] = {}
    # Edit-family abilities (base.Family says what each means); a plain text-to-image family has none.
    takes_control: ClassVar[bool] = False
    text_sees_control: ClassVar[bool] = False
    multiple_references: ClassVar[bool] = False
    one_control_per_call: ClassVar[bool] = False
    prompt_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds",)
    tiny_seed: ClassVar[int] = 0

    # ---- subclass hooks ----------------------------------------------------------------------
    def build_tiny(self, out_dir: Path) -> None:
        """Write the tiny random-init pipeline folder into `out_dir` (RNG already seeded)."""
        raise NotImplementedError

    def single_file_denoiser(self, file: Path, config: Path) -> Any | None:
        """The denoiser read from an original-layout .safetensors `file` (configs from the folder `config`), for a
        family whose layout diffusers' own converter cannot read in general; None: diffusers converts it."""
        return None

    @property
    def pipeline_class(self) -> type:
        """The diffusers pipeline class (imported lazily: importing diffusers pipelines costs seconds)."""
        return diffusers_pipeline(self.facts.pipeline)

    # The folder layout is a static fact (schemas/families.py), so it is known without importing anything.
    @property
    def denoiser_component(self) -> str:
        return self.facts.denoiser

    @property
    def text_components(self) -> tuple[str, ...]:
        return self.facts.text_encoders

    @property
    def tokenizer_components(self) -> tuple[str, ...]:
        return self.facts.tokenizers

    def pipeline_load_kwargs(self) -> dict[str, Any]:
        return {}

    @property
    def denoiser_class(self) -> type:
        """By name (facts.denoiser_model): diffusers imports a model class alone, where reading it from the
        pipeline's signature imports the pipeline with transformers' processors, about 1.5 CPU-s of every training
        process that never renders."""
        import diffusers

        return getattr(diffusers, self.facts.denoiser_model)

    def unused_modules(self, model: torch.nn.Module, component: str) -> tuple[str, ...]:
        return ()

    # ---- timestep experts (facts.experts) ----------------------------------------------------
    def build_denoiser(
        self, model_dir: Path, expert: str | None, build: Callable[[str], torch.nn.Module]
    ) -> torch.nn.Module:
        return build(self.denoiser_component)

    def denoiser_parts(self, denoiser: torch.nn.Module) -> dict[str, torch.nn.Module]:
        return {self.denoiser_component: denoiser}

    def sigma_range(self, denoiser: torch.nn.Module) -> tuple[float, float]:
        return 0.0, 1.0

    def sigma_splits(self, denoiser: torch.nn.Module) -> tuple[float, ...]:
        return ()

    def lora_load_kwargs(self, component: str) -> dict[str, Any]:
        return {}

    def lora_suffixes(self, denoiser: torch.nn.Module) -> dict[str, str]:
        """Component -> the suffix of its LoRA files' stems (a timestep expert's: `high_noise`); none: no suffix."""
        return {}

    def denoiser_files(self, file: Path, config: Path, expert: str | None) -> dict[str, Path]:
        """Denoiser component -> its file, for the transformer file model.path over the model.config folder
        `config` (split files); a family of timestep experts finds the other experts' files."""
        return {self.denoiser_component: file}

    def expert_split(self, model_dir: Path, expert: str | None) -> tuple[int, tuple[str, ...]]:
        """(how many denoisers a run of model.expert `expert` holds, the folder's other denoiser components: an
        in-training render loads those too, load_pipeline)."""
        return 1, ()

    # A transformer's stacks of repeated blocks, in the order its forward runs them (SD3, FLUX, Qwen-Image).
    BLOCK_STACKS: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")

    def block_stacks(self, model: torch.nn.Module) -> tuple[str, ...]:
        return tuple(n for n in self.BLOCK_STACKS if isinstance(getattr(model, n, None), torch.nn.ModuleList))

    def check_full_finetune(self, model_dir: Path, shards: int = 1) -> None:
        from tuneline.stages.families.full_limit import check_full_fits

        check_full_fits(self.facts.name, self.denoiser_class, model_dir, self.denoiser_component, shards)

    def comfy_lora_state(
        self, denoiser: torch.nn.Module, peft_state: dict[str, torch.Tensor], alpha: float
    ) -> dict[str, torch.Tensor] | None:
        return None

    def single_file_state(self, pipe: Any) -> dict[str, torch.Tensor]:
        raise ValueError(
            f"train.export_single_file: family {self.facts.name!r} has no single-file export; set "
            f"train.export_single_file false"
        )

    # ---- edit families -----------------------------------------------------------------------
    def control_size(self, width: int, height: int, area: int | None = None) -> tuple[int, int]:
        return width, height

    def control_kwargs(self, images: list[Any] | None, width: int, height: int) -> dict[str, Any]:
        return {}

    def edit_call(
        self, pipe: Any, enc: TextEncoders, kwargs: dict[str, Any], prompts: list[str], negatives: list[str]
    ) -> tuple[Any, dict[str, Any]]:
        return pipe, kwargs

    def rendered_latents(self, latents: torch.Tensor, width: int, height: int, vae: Any) -> torch.Tensor:
        return latents

    # ---- video families ----------------------------------------------------------------------
    render_kwargs: ClassVar[dict[str, Any]] = {}

    def rendered(self, output: Any) -> Any:
        return output.images

    # ---- model folders -----------------------------------------------------------------------
    def ensure_model(
        self,
        path: str | None,
        cache_dir: Path,
        config: str | None = None,
        text_encoder_path: str | None = None,
        vae_path: str | None = None,
        expert: str | None = None,
    ) -> Path:
        cache_dir = Path(cache_dir)
        if path is None:
            return self._ensure_tiny(cache_dir)
        p = Path(path).expanduser().resolve()
        if p.is_dir():
            if text_encoder_path or vae_path:
                raise ValueError(
                    f"model.text_encoder_path / model.vae_path go beside a transformer file, but model.path {p} is "
                    f"a diffusers folder (it has its own); set them null, or point model.path at the transformer file"
                )
            self.check_folder(p)
            return p
        if p.is_file():
            # A family whose released checkpoints are transformer-only files (no whole-model layout) or a file
            # given with separate text encoder / VAE files: the split-file assembly.
            if text_encoder_path or vae_path or not self.facts.checkpoint_components:
                return convert_split_files(self, p, cache_dir, config, text_encoder_path, vae_path, expert)
            return convert_single_file(self, p, cache_dir, config)
        raise ValueError(
            f"model.path: {p} does not exist (expected a diffusers folder or a .safetensors/.ckpt file "
            f"of family {self.facts.name!r})"
        )

    def check_folder(self, folder: Path) -> None:
        folders.check_folder(self.facts, folder)

    def _ensure_tiny(self, cache_dir: Path) -> Path:
        target = folders.tiny_dir(self.facts, cache_dir)
        if target.is_dir():
            self.check_folder(target)  # published only by os.replace, so a present folder is complete
            return target
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_dir))
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.tiny_seed)
                self.build_tiny(tmp)
            self.check_folder(tmp)
            try:
                os.replace(tmp, target)
            except OSError:
                if not target.is_dir():  # another process published first: theirs is identical, use it
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target

    def identity(self, model_dir: Path, component: str) -> str:
        return folders.identity(self.facts, model_dir, component)

    # ---- loading -----------------------------------------------------------------------------
    def load_vae(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(model_dir, subfolder="vae", dtype=dtype).to(device)
        return vae.eval().requires_grad_(False)

    def load_vae_encoder(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        """The VAE's encode path only: built without importing diffusers when the folder has the plain AutoencoderKL
        layout (tuneline.stages.families.vae_encoder says why), else diffusers' VAE without its decoder."""
        from tuneline.stages.families.vae_encoder import load

        encoder = load(Path(model_dir) / "vae", dtype, device)
        if encoder is None:
            encoder = self.load_vae(model_dir, dtype, device)
            encoder.decoder = None  # caching only encodes: the decoder is half the VAE's memory
        return encoder

    def latent_stats(self, vae: torch.nn.Module) -> tuple[list[float], list[float]] | None:
        return None

    def vae_factors(self, vae: torch.nn.Module) -> tuple[float, float]:
        cfg = vae.config
        scale = getattr(cfg, "scaling_factor", None)
        shift = getattr(cfg, "shift_factor", None)
        return (
            float(scale) if scale is not None else self.facts.scaling_factor,
            float(shift) if shift is not None else self.facts.shift_factor,
        )

    def load_denoiser(
        self, model_dir: Path, dtype: torch.dtype, device: torch.device, expert: str | None = None, place: Place = None
    ) -> torch.nn.Module:
        den = self.denoiser_class.from_pretrained(model_dir, subfolder=self.denoiser_component, dtype=dtype)
        return place(den) if place else den.to(device)

    def load_noise_scheduler(self, model_dir: Path) -> Any:
        """The training noise schedule: DDPM for epsilon/v families, flow-matching Euler for the others; built from
        the folder's scheduler config either way (the inference scheduler class may differ, e.g. PNDM in SD1.5)."""
        from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

        cls = FlowMatchEulerDiscreteScheduler if self.facts.prediction == "flow_matching" else DDPMScheduler
        config = cls.load_config(model_dir, subfolder="scheduler")
        return cls.from_config(config)

    def load_pipeline(
        self, model_dir: Path, dtype: torch.dtype, device: torch.device, denoiser: torch.nn.Module | None = None
    ) -> Any:
        """The folder's pipeline; a given live `denoiser` (training's) takes the place of the folder's own, which
        is then never loaded. Its text encoders serve the renderer too (text_encoders_of): loaded once."""
        parts: dict[str, Any] = self.denoiser_parts(denoiser) if denoiser is not None else {}
        pipe = self.pipeline_class.from_pretrained(model_dir, dtype=dtype, **parts, **self.pipeline_load_kwargs())
        # A live denoiser stays where training keeps it: block swap holds some of its weights in CPU memory
        # (tuneline.stages.train.swap), which moving the whole pipeline would copy onto the GPU.
        live = [id(p) for p in parts.values()]
        for part in pipe.components.values():
            if isinstance(part, torch.nn.Module) and id(part) not in live:
                part.to(device)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def load_text_encoders(
        self, model_dir: Path, dtype: torch.dtype, device: torch.device, max_length: int | None = None
    ) -> TextEncoders:
        types = self.pipeline_class._get_signature_types()
        toks = [_first_type(types[c]).from_pretrained(model_dir, subfolder=c) for c in self.tokenizer_components]
        encs = []
        for comp in self.text_components:
            enc = _first_type(types[comp]).from_pretrained(model_dir, subfolder=comp, dtype=dtype)
            encs.append(enc.to(device).eval().requires_grad_(False))
        length = max_length or self.facts.max_length
        self.check_max_length(toks, length)
        return TextEncoders(tokenizers=toks, encoders=encs, max_length=length)

    def text_encoders_of(self, pipe: Any, max_length: int | None = None) -> TextEncoders:
        """The pipeline's own tokenizers and text encoders, as load_text_encoders returns them."""
        toks = [getattr(pipe, c) for c in self.tokenizer_components]
        encs = [getattr(pipe, c).eval().requires_grad_(False) for c in self.text_components]
        length = max_length or self.facts.max_length
        self.check_max_length(toks, length)
        return TextEncoders(tokenizers=toks, encoders=encs, max_length=length)

    def check_pipeline_length(self, max_length: int) -> None:
        """For a family whose pipeline caps the caption length itself (facts.max_length_limit, not the tokenizer's)."""
        if max_length > self.facts.max_length_limit:
            raise ValueError(
                f"text.max_length {max_length} exceeds the {self.facts.max_length_limit} tokens family "
                f"{self.facts.name!r}'s pipeline encodes; lower it or leave it automatic"
            )

    def check_max_length(self, tokenizers: list[Any], max_length: int) -> None:
        """The main (last) tokenizer sets the caption length; refuse lengths its encoder cannot embed."""
        limit = tokenizers[-1].model_max_length
        if max_length > limit:
            raise ValueError(
                f"text.max_length {max_length} exceeds what family {self.facts.name!r}'s text encoder "
                f"accepts ({limit}); lower it or leave it automatic"
            )

    # ---- saving ------------------------------------------------------------------------------
    def save_pipeline(self, model_dir: Path, denoiser: torch.nn.Module, out_dir: Path) -> None:
        model_dir, out_dir = Path(model_dir), Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        parts = self.denoiser_parts(unwrap(denoiser))
        for item in model_dir.iterdir():
            if item.name in parts or item.name.startswith("."):
                continue
            if item.is_dir():
                shutil.copytree(item, out_dir / item.name, copy_function=_copy, dirs_exist_ok=True)
            else:
                _copy(item, out_dir / item.name)
        for name, part in parts.items():
            # A stale denoiser folder could hold shards the new save does not overwrite; start it empty.
            shutil.rmtree(out_dir / name, ignore_errors=True)
            part.save_pretrained(out_dir / name, safe_serialization=True)

    # ---- validation --------------------------------------------------------------------------
    def prompt_kwargs(self, text: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """Pre-encoded prompt and negative prompt as the pipeline's `*_embeds` arguments. An empty/None negative
        is left out, so the pipeline falls back to its own unconditional input."""
        kwargs: dict[str, Any] = {k: text[k] for k in self.prompt_keys}
        if negative:
            kwargs.update({f"negative_{k}": negative[k] for k in self.prompt_keys})
        return kwargs

    # ---- shared helpers for subclasses -------------------------------------------------------
    def micro_time_ids(self, micro: list[MicroCond] | None, latents: torch.Tensor) -> torch.Tensor:
        """(B, 6) SDXL-style size conditioning; without recorded sizes, the latent size in pixels, no crop."""
        b, _, h, w = latents.shape
        if micro is None:
            px = (h * self.facts.vae_factor, w * self.facts.vae_factor)
            micro = [MicroCond(px, (0, 0), px)] * b
        if len(micro) != b:
            raise ValueError(f"micro-conditioning has {len(micro)} entries for a batch of {b}")
        rows = [[*m.original_size, *m.crop_top_left, *m.target_size] for m in micro]
        return torch.tensor(rows, dtype=latents.dtype, device=latents.device)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain diffusers model inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def tokenize(
    tokenizer: Any, captions: list[str], max_length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) padded and truncated to exactly `max_length`."""
    out = tokenizer(captions, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    return out.input_ids.to(device), out.attention_mask.to(device)


def module_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def _first_type(t: Any) -> type:
    return t[0] if isinstance(t, tuple) else t


def _copy(src: Any, dst: Any) -> Any:
    """A real copy, not a hard link: a later `save_pretrained` over the trained folder truncates files in place
    and would silently rewrite the base model through a shared inode."""
    return shutil.copy2(src, dst)
