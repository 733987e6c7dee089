"""FLUX.2: Flux2Transformer2DModel on the 32-channel AutoencoderKLFlux2 latents, patchified 2x2 into 128 channels,
normalised by the VAE's batch-norm statistics and packed into tokens (stages/families/flux2/latents.py); flow
matching (the transformer takes sigma). Flux2Family is what [dev] and [klein] (its own folder) share;
Flux2DevFamily captions through Mistral Small 3 (Mistral3ForConditionalGeneration: hidden states of layers 10, 20,
30 side by side, FLUX.2's system message in the chat template) with distilled guidance: Flux2Pipeline has no
negative prompt, so a negative is dropped. Both take reference images (dataset.control) as the stock pipelines take
`image=` (references.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import MicroCond, TextEncoders
from tuneline.stages.families.common import DiffusersFamily, module_device, unwrap
from tuneline.stages.families.flux2 import latents as lat
from tuneline.stages.families.flux2.references import reference_tokens
from tuneline.stages.families.qwen import TINY_TEXT_WIDTH, build_bpe_tokenizer
from tuneline.stages.families.stock import dynamic_shift_scheduler
from tuneline.stages.families.tiny.adapter import demo_pictures, demo_vae_widened_state

CONTROL_KEY = "control_latents"  # the conditioning key the training loop fills for a family that takes control
DEV_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers
SPECIALS = ("<pad>", "<s>", "</s>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]", "[IMG]")
# Mistral Small 3's template for what Flux2Pipeline sends (a system turn and a user turn, content as text parts).
CHAT_TEMPLATE = (
    "<s>{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{% elif m['role'] == 'user' %}[INST]"
    "{% endif %}{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{% if m['role'] == 'system' %}"
    "[/SYSTEM_PROMPT]{% elif m['role'] == 'user' %}[/INST]{% endif %}{% endfor %}"
)


def tiny_vae(facts: FamilyFacts):
    """AutoencoderKLFlux2 with the demo's pretrained VAE (stages/families/tiny) widened to 32 channels and identity
    quant convolutions, so latents carry the picture (a random-init VAE's tell the demo colors apart by about a tenth
    of the noise, and the edit demo learns nothing) and renders show colors and shapes. Its batch-norm statistics
    are measured as the released ones were gathered, over the latents of pictures of the demo's domain
    (demo_pictures), so the normalised space is unit-wide and the pipeline's normalisation is exercised with
    statistics away from (0, 1)."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        block_out_channels=(16, 32, 32, 32),
        layers_per_block=1,
        latent_channels=facts.latent_channels,
        norm_num_groups=8,
        sample_size=64,
    )
    state = demo_vae_widened_state(facts.latent_channels)
    for name in ("quant_conv", "post_quant_conv"):
        conv = getattr(vae, name)
        state[f"{name}.weight"] = torch.eye(conv.in_channels).view(*conv.weight.shape)
        state[f"{name}.bias"] = torch.zeros_like(conv.bias)
    state |= {k: v for k, v in vae.state_dict().items() if k.startswith("bn.")}  # measured below
    vae.load_state_dict(state, strict=True)
    with torch.no_grad():
        patches = lat.patchify(vae.encode(demo_pictures()).latent_dist.mean)
        vae.bn.running_mean.copy_(patches.mean(dim=(0, 2, 3)))
        vae.bn.running_var.copy_(patches.var(dim=(0, 2, 3)))
    return vae


class Flux2Family(DiffusersFamily):
    """What [dev] and [klein] share: VAE, latent space, transformer call."""

    facts: ClassVar[FamilyFacts]
    prompt_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds",)
    # Reference images (dataset.control): the training loop hands over the cached control latents as
    # text["control_latents"], (B, C, H, W) or (B, N, C, H, W) for several per target (references.py).
    takes_control: ClassVar[bool] = True
    multiple_references: ClassVar[bool] = True  # several per image: <control>/<stem>/*.png (stages/scan/controls.py)
    one_control_per_call: ClassVar[bool] = True
    # Every linear layer of every block, as ai-toolkit and musubi-tuner train FLUX.2: the double blocks' attention
    # of both streams (image to_q/k/v/to_out.0, text add_q/k/v_proj/to_add_out) and both feed-forwards, and the
    # single blocks' fused qkv+mlp input (to_qkv_mlp_proj) and output (attn.to_out), where most of the model's
    # parameters are. The shared modulation layers outside the blocks stay frozen. ComfyUI maps each of them
    # (lora_layout.py).
    lora_target_modules: tuple[str, ...] = (
        *("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        *("ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"),
        *("attn.to_qkv_mlp_proj", "attn.to_out"),
    )

    # ---- latents -----------------------------------------------------------------------------
    def load_vae(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        from diffusers import AutoencoderKLFlux2

        vae = AutoencoderKLFlux2.from_pretrained(model_dir, subfolder="vae", dtype=dtype).to(device)
        return vae.eval().requires_grad_(False)

    def load_vae_encoder(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        vae = self.load_vae(model_dir, dtype, device)
        vae.decoder = None  # caching only encodes
        return lat.NormalisedEncoder(vae)

    def vae_factors(self, vae: torch.nn.Module) -> tuple[float, float]:
        """The cache already holds the pipeline's normalised space (latents.py): no further scale or shift."""
        return 1.0, 0.0

    def check_max_length(self, tokenizers: list[Any], max_length: int) -> None:
        self.check_pipeline_length(max_length)

    def save_tiny(self, out_dir: Path, tok: Any, text_encoder, text_layers: int, guidance: bool, **extra) -> None:
        """The tiny folder: FLUX.2's tiny transformer (text features `text_layers` x the tiny text width), VAE and
        scheduler around `tok` and the text encoder `text_encoder()` makes (random weights drawn in this order:
        transformer, VAE, then the encoder's where it makes one)."""
        transformer = tiny_transformer(self.facts, text_layers * TINY_TEXT_WIDTH, guidance=guidance)
        vae = tiny_vae(self.facts)
        pipe = self.pipeline_class(
            scheduler=dynamic_shift_scheduler(),
            vae=vae,
            text_encoder=text_encoder(),
            tokenizer=tok,
            transformer=transformer,
            **extra,
        )
        pipe.save_pretrained(out_dir, safe_serialization=True)

    # ---- training ----------------------------------------------------------------------------
    def denoise(
        self,
        denoiser: torch.nn.Module,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        text: dict[str, torch.Tensor],
        micro: list[MicroCond] | None = None,
    ) -> torch.Tensor:
        """Velocity (noise - x0) for normalised latents (B, 32, H, W): patchified, packed, the transformer called
        as Flux2Pipeline calls it (timestep = sigma, all caption tokens, 4-axis position ids), and unpacked."""
        b, _, h, w = noisy.shape
        dt, dev = noisy.dtype, noisy.device
        embeds = text["prompt_embeds"].to(device=dev, dtype=dt)
        guidance = None
        if getattr(unwrap(denoiser).config, "guidance_embeds", False):
            guidance = torch.full((b,), self.train_guidance, device=dev, dtype=dt)
        tokens, ids = lat.pack(lat.patchify(noisy)), lat.latent_ids(b, h // 2, w // 2, dev)
        n = tokens.shape[1]
        if (control := text.get(CONTROL_KEY)) is not None:  # reference images (references.py)
            ref_tokens, ref_ids = reference_tokens(control, noisy)
            tokens, ids = torch.cat([tokens, ref_tokens], dim=1), torch.cat([ids, ref_ids], dim=1)
        out = denoiser(
            hidden_states=tokens,
            timestep=timesteps.to(dev, dt) / 1000,
            guidance=guidance,
            encoder_hidden_states=embeds,
            txt_ids=lat.text_ids(b, embeds.shape[1], dev),
            img_ids=ids,
            return_dict=False,
        )[0]
        return lat.unpatchify(lat.unpack(out[:, :n], h // 2, w // 2))

    def control_kwargs(self, images: list[Any] | None, width: int, height: int) -> dict[str, Any]:
        """Pipeline arguments for one sample's reference images, already at the render size (None: text to image).
        Flux2Pipeline's `image` is the list of references every prompt of the call shares, so the renderer renders
        such samples one per call (`one_control_per_call`)."""
        if images is None:
            return {}
        if len(images) != 1:
            raise ValueError(f"family {self.facts.name!r} renders one sample's references per call, got {len(images)}")
        refs = images[0]
        return {"image": list(refs) if isinstance(refs, (list, tuple)) else [refs]}

    def rendered_latents(self, latents: torch.Tensor, width: int, height: int, vae: Any) -> torch.Tensor:
        """The pipeline's output_type="latent" result (B, tokens, 128), normalised, as (B, 32, H, W) cache-space
        latents (the edit learning check compares them with the cache)."""
        f = 2 * self.facts.vae_factor
        return lat.unpatchify(lat.unpack(latents, height // f, width // f))

    train_guidance: float = 1.0  # distilled guidance fed to guidance-embedding ([dev]) models while training

    def comfy_lora_state(
        self, denoiser: torch.nn.Module, peft_state: dict[str, torch.Tensor], alpha: float
    ) -> dict[str, torch.Tensor]:
        from tuneline.stages.families.flux2.lora_layout import flux2_comfy_state

        return flux2_comfy_state(peft_state, alpha)

    def prompt_kwargs(self, text: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """Embeds at the cached length, so a "" negative the pipeline encodes itself has the same length."""
        kwargs = super().prompt_kwargs(text, negative)
        kwargs["max_sequence_length"] = text["prompt_embeds"].shape[1]
        return kwargs


def tiny_mistral3(tokenizer: Any, width: int = TINY_TEXT_WIDTH):
    """Mistral3ForConditionalGeneration with 31 text layers `width` wide and a one-layer Pixtral vision tower (never
    fed images here). 31, so the pipeline's hidden states 10, 20, 30 are all taken before the final norm, as in the
    released 40-layer model: with 30, state 30 was the final norm's output, about 20 times the length of states 10
    and 20 at every position, and it outweighed them in the features the transformer reads."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    text = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=31,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = PixtralVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        image_size=32,
        patch_size=16,
        head_dim=16,
    )
    cfg = Mistral3Config(
        text_config=text,
        vision_config=vision,
        spatial_merge_size=1,
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
    )
    return Mistral3ForConditionalGeneration(cfg)


def tiny_transformer(facts: FamilyFacts, text_width: int, guidance: bool) -> torch.nn.Module:
    """The tiny flavors' FLUX.2 transformer: in_channels = 4 x the latent channels (patchified), head dim 16 =
    sum(axes_dims_rope), text features `text_width` wide; a guidance embedding for [dev] ([klein] samples with true
    CFG). Two double and two single blocks of 4 heads, as FLUX.1 Kontext's tiny flavor: with one of each and 2
    heads the edit demo did not learn the instructed color in 1000 steps (bench/README.md)."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * facts.latent_channels,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=text_width,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance,
    )


class Flux2DevFamily(Flux2Family):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["flux2"]

    def build_tiny(self, out_dir: Path) -> None:
        # The released folder's tokenizer is a Pixtral processor (it needs torchvision); the pipeline only uses its
        # chat template and tokenizer, which a plain tokenizer provides (AutoProcessor falls back to it).
        from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE

        # The system message is one token of the tiny tokenizer. Spelled out it came first and filled most of the
        # caption's positions (about 130 of 140 in bytes, about 50 of 64 as whole words), and the causal encoder
        # carries a caption only into the positions after it: "make it red" differed from "make it green" in 15 of 64,
        # and the edit demo learned the instructed color weakly (bench/README.md). As one token the color word sits at
        # position 11 and every later position, padding included, carries it.
        tok = build_bpe_tokenizer(
            out_dir / "tokenizer", self.facts.max_length_limit, (*SPECIALS, SYSTEM_MESSAGE), CHAT_TEMPLATE
        )
        # No distilled-guidance embedding: a random-init one only ever sees the training value (1.0), and rendering
        # at validate.guidance_scale would condition the model on a value it never learned.
        self.save_tiny(out_dir, tok, lambda: tiny_mistral3(tok), len(DEV_LAYERS), guidance=False)

    def encode_text(self, enc: TextEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
        """As Flux2Pipeline._get_mistral_3_small_prompt_embeds: system message + caption through the chat template,
        hidden states 10/20/30 side by side at max_length tokens (the transformer sees every position)."""
        from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input

        tok, te = enc.tokenizers[0], enc.encoders[0]
        inputs = tok.apply_chat_template(
            format_input(captions, SYSTEM_MESSAGE),
            add_generation_prompt=False,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=enc.max_length,
        )
        dev = module_device(te)
        mask = inputs["attention_mask"].to(dev)
        with torch.no_grad():
            out = te(
                input_ids=inputs["input_ids"].to(dev), attention_mask=mask, output_hidden_states=True, use_cache=False
            )
        hidden = torch.cat([out.hidden_states[i] for i in DEV_LAYERS], dim=-1)
        return {"prompt_embeds": hidden, "prompt_attention_mask": mask}

    def prompt_kwargs(self, text: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """Flux2Pipeline takes no negative prompt (guidance is distilled into the model): a negative is dropped."""
        return super().prompt_kwargs(text, None)
