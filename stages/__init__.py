"""Pure stage cores (no Prefect import): scan, latents, text, train, validate, plus model-family adapters."""
