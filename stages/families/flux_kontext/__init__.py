"""FLUX.1 Kontext [dev]: FLUX.1 with the input (control) image packed beside the generated tokens."""
