"""The Wan video families' rows of schemas/families.py: Wan 2.1 and Wan 2.2 A14B share one layout; Wan 2.2 TI2V 5B
has its own VAE (48 channels, 16x spatial)."""

from __future__ import annotations

from dataclasses import replace

from tuneline.schemas.family_facts import FamilyFacts


def _wan_video(name: str, **more) -> FamilyFacts:
    """Wan's text-to-video layout: a causal video VAE (8x spatial, 4x temporal: clips of 4k+1 frames) normalised per
    channel, 1x2x2 patches, UMT5 captions of up to 512 tokens, flow matching with the scheduler's fixed shift,
    trained at 832x480 as Wan LoRAs usually are."""
    return FamilyFacts(
        name,
        8,
        2,
        16,
        1.0,
        0.0,
        "flow_matching",
        512,
        max_length_limit=512,
        pipeline="WanPipeline",
        denoiser_model="WanTransformer3DModel",
        denoiser="transformer",
        temporal_factor=4,
        fps=16.0,
        frame_buckets=(17, 33, 49, 81),
        usual_resolution=480,
        **more,
    )


WAN_FACTS: dict[str, FamilyFacts] = {
    # Wan 2.1 text-to-video (the layout _wan_video describes)
    "wan": _wan_video(
        "wan",
        # Wan's original layout (the diffusion_models/ files ComfyUI distributes): the output head's modulation
        checkpoint_marker="head.modulation",
        shipped_config="Wan2.1-T2V-14B",
        shipped_sizes=(("wan_1_3b", "Wan2.1-T2V-1.3B"),),
        tiny_revision="2",  # the tiny VAE's latent statistics measured on the video demo's clips
        tiny_max_length=32,  # the video demo's captions ("a yellow square moving right") are about 17 tokens
    ),
    # Wan 2.2 A14B: Wan 2.1's layout with two timestep experts. WanPipeline's `transformer` denoises timesteps
    # >= boundary_ratio * 1000, `transformer_2` the rest; the LoRA files are named as Wan 2.2 LoRAs are distributed
    # for ComfyUI (..._high_noise, ..._low_noise).
    "wan22": _wan_video(
        "wan22",
        checkpoint_marker="head.modulation",  # each expert's transformer file is in Wan's layout
        shipped_config="Wan2.2-T2V-A14B",
        experts=(("transformer", "high_noise"), ("transformer_2", "low_noise")),
        expert_boundary=0.875,  # Wan2.2-T2V-A14B's: the high-noise expert denoises t >= 875 of 1000
    ),
    "wan22_ti2v": replace(
        # Wan 2.2 TI2V 5B (text-to-video here): one transformer on the Wan 2.2 VAE's 48 channels, 16x spatial (2x2
        # patchified pixels, then 8x), 4x temporal like Wan 2.1's; released at 1280x704, 121 frames at 24 fps.
        # Picked under the family it is a layout of by model.config naming this row, or by a folder whose
        # model_index.json has expand_timesteps (WanPipeline's per-token timesteps).
        _wan_video(
            "wan22_ti2v",
            checkpoint_marker="head.modulation",
            shipped_config="Wan2.2-TI2V-5B",
            tiny_max_length=32,
            variant_of="wan22",
            variant_flag="expand_timesteps",
        ),
        vae_factor=16,
        latent_channels=48,
        fps=24.0,
        frame_buckets=(17, 33, 49, 81, 121),
        usual_resolution=704,
    ),
}
