"""FLUX.2 [klein]: builds on FLUX.2's folder (stages/families/flux2/) with its own Qwen3 text encoder."""
