"""Wan 2.2 TI2V 5B text-to-video: Wan 2.1's layout on the Wan 2.2 VAE (48 channels, 16x spatial), with per-token timesteps (WanPipeline's expand_timesteps)."""
