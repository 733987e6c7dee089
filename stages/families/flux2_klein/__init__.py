"""FLUX.2 [klein]: builds on the FLUX.2 [dev] folder's adapter with its own Qwen3 text encoder."""
