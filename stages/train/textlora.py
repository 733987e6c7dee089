"""train.text_encoder_lora: a LoRA on the CLIP text encoder(s) of the CLIP-conditioned UNet families, trained
beside the denoiser's.

The captions are then encoded live, with gradients, by the encoders being trained: the text artifact's cache
(encoded by the frozen encoders) is not read, only its manifest (max length, caption variants), so caption
dropout and tag-shuffle variants draw the same strings the cache would hold. The targets are the family's
(Family.text_encoder_lora_targets: CLIP's attention projections, as diffusers' own SD/SDXL LoRA scripts train them),
less the layers whose output the family never reads (Family.unused_modules); the files carry them as `text_encoder.` /
`text_encoder_2.` keys (diffusers' load_lora_weights) and as kohya's `lora_te_` / `lora_te1_` / `lora_te2_`
modules (the names ComfyUI maps onto CLIP: `lora_te_text_model_encoder_layers_0_self_attn_q_proj`).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from tuneline.stages.families.base import Family
from tuneline.stages.text import TagAugment
from tuneline.stages.train.adapters import exclude_pattern


def lora_config(t, targets: tuple[str, ...], unused: tuple[str, ...]):
    from peft import LoraConfig

    return LoraConfig(
        r=t.lora_rank,
        lora_alpha=t.lora_alpha or t.lora_rank,
        init_lora_weights="gaussian",
        target_modules=list(targets),
        exclude_modules=exclude_pattern(unused),
    )


class TrainedText:
    """The text source of a text-encoder LoRA run: `.get` as TextCache/LiveText (no gradients, for held-out eval),
    `.strings` for the training feed and `.encode` (with gradients) for the step."""

    def __init__(self, fam: Family, model_dir: Path, device: torch.device, t, max_length: int, augment: TagAugment):
        self.fam, self.augment, self.variants = fam, augment, augment.variants
        # float32 like the denoiser's LoRA: CPU trains in float32, CUDA in autocast over float32 master weights.
        self.enc = fam.load_text_encoders(Path(model_dir), torch.float32, device, max_length=max_length)
        self.components = list(fam.text_components)
        torch.manual_seed(t.seed + 1)  # the same LoRA init on every rank, independent of the denoiser's
        self.configs = {}  # component -> its peft config (the diffusers file's adapter metadata)
        for comp, te in zip(self.components, self.enc.encoders):
            self.configs[comp] = lora_config(t, fam.text_encoder_lora_targets, fam.unused_modules(te, comp))
            te.add_adapter(self.configs[comp])
        self._lock = threading.Lock()

    def params(self) -> dict[str, torch.nn.Parameter]:
        """Trainable parameters named `<component>.<parameter>` (checkpoints, EMA, the optimizer)."""
        out = {}
        for comp, te in zip(self.components, self.enc.encoders):
            for n, p in te.named_parameters():
                if p.requires_grad:
                    p.data = p.data.float()
                    out[f"{comp}.{n}"] = p
        return out

    def strings(self, captions: list[str], variant_ids: list[int] | None = None) -> list[str]:
        ids = [0] * len(captions) if variant_ids is None else list(variant_ids)
        return [self.augment.variant(c, v) for c, v in zip(captions, ids)]

    def encode(self, strings: list[str]) -> dict[str, torch.Tensor]:
        """The family's text tensors for `strings`, with gradients to the LoRA weights."""
        with self._lock:
            return self.fam.encode_text(self.enc, strings)

    def get(self, captions: list[str], variant_ids: list[int] | None = None) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {k: v.detach() for k, v in self.encode(self.strings(captions, variant_ids)).items()}

    def layers(self) -> dict[str, dict[str, torch.Tensor]]:
        """component -> its peft LoRA state (`text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight` ...).
        transformers 5 flattened CLIPTextModel (`encoder.layers...`); the files keep CLIP's `text_model.` path,
        which every reader knows (kohya/ComfyUI names, diffusers' loader strips it for a flattened model)."""
        from peft.utils import get_peft_model_state_dict

        def canonical(key: str) -> str:
            return key if key.startswith("text_model.") else f"text_model.{key}"

        return {
            comp: {
                canonical(k): v.detach().to("cpu", torch.float32).contiguous()
                for k, v in get_peft_model_state_dict(te).items()
            }
            for comp, te in zip(self.components, self.enc.encoders)
        }


class Joint(torch.nn.Module):
    """The denoiser and the trained text encoders as one module, so DDP reduces both LoRAs' gradients; calling it
    calls the denoiser (the text encoders run before, in the step)."""

    def __init__(self, denoiser: torch.nn.Module, encoders: list[torch.nn.Module]):
        super().__init__()
        self.denoiser, self.encoders = denoiser, torch.nn.ModuleList(encoders)

    def forward(self, *args, **kwargs):
        return self.denoiser(*args, **kwargs)


def kohya_state(family: str, layers: dict[str, dict[str, torch.Tensor]], alpha: float) -> dict[str, torch.Tensor]:
    """The text encoders' LoRA as kohya modules: `<prefix>_<module path with '_'>.lora_down/lora_up/alpha`."""
    from tuneline.stages.families.kohya_layout import lora_pairs
    from tuneline.stages.families.registry import family_part

    prefixes = dict(family_part(family, "lora").TEXT_ENCODER_KOHYA)
    out: dict[str, torch.Tensor] = {}
    for comp, state in layers.items():
        for path, (down, up) in lora_pairs(state).items():
            stem = f"{prefixes[comp]}_{path.replace('.', '_')}"
            out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"] = down, up
            out[f"{stem}.alpha"] = torch.tensor(float(alpha))
    return out
