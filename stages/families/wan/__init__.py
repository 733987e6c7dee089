"""Wan 2.1 text-to-video: clips of 4k+1 frames through a causal video VAE, UMT5 captions, WanTransformer3DModel."""
