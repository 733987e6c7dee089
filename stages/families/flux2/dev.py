"""FLUX.2 [dev]: captions through Mistral Small 3 (Mistral3ForConditionalGeneration; hidden states of layers 10, 20,
30 side by side, FLUX.2's system message in the chat template), guidance-distilled transformer (the pipeline has
no negative prompt: a negative is ignored), everything else as [klein] (adapter.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import TextEncoders
from tuneline.stages.families.common import module_device
from tuneline.stages.families.flux2.adapter import Flux2Family, tiny_vae
from tuneline.stages.families.qwen import TINY_TEXT_WIDTH, build_bpe_tokenizer

DEV_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers
SPECIALS = ("<pad>", "<s>", "</s>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]", "[IMG]")
# Mistral Small 3's template for what Flux2Pipeline sends (a system turn and a user turn, content as text parts).
CHAT_TEMPLATE = (
    "<s>{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{% elif m['role'] == 'user' %}[INST]"
    "{% endif %}{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{% if m['role'] == 'system' %}"
    "[/SYSTEM_PROMPT]{% elif m['role'] == 'user' %}[/INST]{% endif %}{% endfor %}"
)


def tiny_mistral3(tokenizer: Any, width: int = TINY_TEXT_WIDTH):
    """Mistral3ForConditionalGeneration with 30 text layers (so layers 10, 20, 30 exist) `width` wide and a
    one-layer Pixtral vision tower (never fed images here)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    text = MistralConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
                                 image_size=32, patch_size=16, head_dim=16)
    cfg = Mistral3Config(text_config=text, vision_config=vision, spatial_merge_size=1,
                         image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"))
    return Mistral3ForConditionalGeneration(cfg)


class Flux2DevFamily(Flux2Family):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["flux2"]

    def build_tiny(self, out_dir: Path) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

        # The released folder's tokenizer is a Pixtral processor (it needs torchvision); the pipeline only uses its
        # chat template and tokenizer, which a plain tokenizer provides (AutoProcessor falls back to it).
        tok = build_bpe_tokenizer(out_dir / "tokenizer", self.facts.max_length_limit, SPECIALS, CHAT_TEMPLATE)
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=4 * self.facts.latent_channels, num_layers=1, num_single_layers=1,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=len(DEV_LAYERS) * TINY_TEXT_WIDTH,
            timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096)
        pipe = self.pipeline_class(scheduler=scheduler, vae=tiny_vae(self.facts), text_encoder=tiny_mistral3(tok),
                                   tokenizer=tok, transformer=transformer)
        pipe.save_pretrained(out_dir, safe_serialization=True)

    def check_max_length(self, tokenizers: list[Any], max_length: int) -> None:
        if max_length > self.facts.max_length_limit:
            raise ValueError(f"text.max_length {max_length} exceeds the {self.facts.max_length_limit} tokens family "
                             f"{self.facts.name!r}'s pipeline encodes; lower it or leave it automatic")

    def encode_text(self, enc: TextEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
        """As Flux2Pipeline._get_mistral_3_small_prompt_embeds: system message + caption through the chat template,
        hidden states 10/20/30 side by side at max_length tokens (the transformer sees every position)."""
        from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input

        tok, te = enc.tokenizers[0], enc.encoders[0]
        inputs = tok.apply_chat_template(format_input(captions, SYSTEM_MESSAGE), add_generation_prompt=False,
                                         tokenize=True, return_dict=True, return_tensors="pt", padding="max_length",
                                         truncation=True, max_length=enc.max_length)
        dev = module_device(te)
        mask = inputs["attention_mask"].to(dev)
        with torch.no_grad():
            out = te(input_ids=inputs["input_ids"].to(dev), attention_mask=mask, output_hidden_states=True,
                     use_cache=False)
        hidden = torch.cat([out.hidden_states[i] for i in DEV_LAYERS], dim=-1)
        return {"prompt_embeds": hidden, "prompt_attention_mask": mask}

    def prompt_kwargs(self, text: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None
                      ) -> dict[str, Any]:
        """Flux2Pipeline takes no negative prompt (guidance is distilled into the model): a negative is dropped."""
        return super().prompt_kwargs(text, None)
