"""FLUX.2 [dev] and [klein]: one folder holds both adapters (the pipelines share the transformer, VAE and packing)."""
