"""The built-in demo: `tuneline run` without a config runs exactly this (and `config example` prints it)."""

from __future__ import annotations

# Colors are the demo's classes: the learning check asks whether "a <color> ..." samples land nearest
# to that color's mean cached latent, and whether their decoded images show that color.
DEMO_COLORS = ("red", "green", "blue", "yellow")
DEMO_SHAPES = ("square", "circle")
# Each class's fill colour in the demo images; the colour check (stages/validate/colors.py) looks for it in renders.
RGB = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (235, 215, 30)}
# The video demo (dataset.demo: video, stages/scan/video_demo.py): a square crossing the frame in each direction,
# (x, y) unit steps in image coordinates (y grows downwards). One square size near the middle across the motion, on a
# dark ground: the tiny Wan flavor's VAE is random-init, so its latents keep the motion only where little else
# varies (and a bright square on dark varies most).
VIDEO_DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
VIDEO_SIZE, VIDEO_FRAMES, VIDEO_FPS = 64, 17, 16  # Wan's shortest frame budget (4k+1) at its frame rate: one second
VIDEO_EDGE = 20  # pixels: large enough to survive the VAE's 8x downsampling
VIDEO_TRAVEL = 34  # pixels the square moves over a clip (2 per frame): several latent cells
VIDEO_BACKGROUND = (20, 60)  # grey levels

DEMO_CONFIG: dict = {
    "workdir": "./tuneline-work",
    "dataset": {"path": "demo-data", "demo": True},
    # The CPU walkthrough on any machine: two gloo processes show DDP where a one-GPU machine could hold only one
    # NCCL rank; a GPU run sets model.device: auto (or cuda) and one train.processes per GPU.
    "model": {"family": "tiny", "path": None, "device": "cpu"},
    "buckets": {"resolution": 64, "resolution_type": "pixel"},
    # Tuned so both learning checks (latent class separation, prompted color in the renders) clear 0.9 in under
    # two minutes of training on 2 CPU cores (measured 1.0 at 1000 steps, 0.84 at 600): min-SNR weighting and noise
    # offset put the effort on the coarse, colour-carrying structure; training on the latent means keeps the
    # VAE's posterior noise out of the data.
    "train": {
        "steps": 1000,
        "batch_size": 8,
        "processes": 2,
        "learning_rate": 1e-3,
        "loss_weighting": "auto",
        "noise_offset": 0.1,
        "latent_sampling": "mean",
        "checkpoint_every": 500,
        "validate_every": 500,
    },
    "validate": {
        "prompts": [
            {"prompt": f"a {c} {s}", "negative_prompt": "", "seed": i}
            for i, (c, s) in enumerate(zip(DEMO_COLORS, DEMO_SHAPES * 2))
        ],
        "steps": 10,
        "learning_check": True,
        "check_seeds": 8,
        "check_steps": 10,
    },
}

# `tuneline config example --minimal`: the keys a run on a user's own images needs; every other key takes its default.
MINIMAL_YAML = """\
# A config for your own images: every key not written here takes its default
# (`tuneline config example` prints them all, each with what it does).
dataset:
  # your images, each with its caption beside it (cat.png + cat.txt). A relative path resolves against
  # the workdir (./tuneline-work), so ../my-images is the my-images folder where you run tuneline.
  path: ../my-images
model:
  # tiny (built in, random-init: a trial run), sd15, sdxl, sd3, flux, qwen_image, z_image, flux2, flux2_klein, ...
  family: tiny
  # your model: a local diffusers folder or a single checkpoint file; null = the family's tiny flavor
  path: null
train:
  mode: lora
  steps: 300
  # one training process per GPU (or 1 on a CPU)
  processes: 1
validate:
  # what the validation grid shows: prompts of your subject
  prompts:
    - {prompt: a photo of my subject, negative_prompt: "", seed: 0}
"""
