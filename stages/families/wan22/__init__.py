"""Wan 2.2 text-to-video: the A14B layout of two timestep experts (high-noise `transformer`, low-noise `transformer_2`)."""
