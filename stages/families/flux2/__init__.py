"""FLUX.2 [dev]: adapter, latent space, LoRA layout and released-size configs ([klein] builds on them)."""
