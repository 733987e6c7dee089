"""Pretrain the demo's tiny VAE on the demo's shape domain and write the weights the tiny family ships.

    PYTHONPATH=. python infra/demo_vae/train_demo_vae.py            # writes stages/families/tiny/assets/demo_vae.safetensors

Why a script outside the package: pretraining is a build step, run once by a developer, never by a workdir, a test
or CI (they load the shipped file). Kept out of stages/families/, editing the recipe does not change the stages'
code versions; what the stages depend on is the weights file, and `tiny_revision` (schemas/families.py) is bumped
whenever it is replaced, so cached tiny models are rebuilt.

Deterministic on CPU: fixed seeds for the image generator (random.Random) and torch, deterministic algorithms,
one thread (float sums depend on how work is split across threads; one thread also avoids the many-fold slowdown
of oversubscribed OpenMP threads on a shared machine). The same torch version on the same CPU type reproduces the
file byte for byte. About 5 minutes on one idle core (1500 steps of 8 images).

Recipe: the architecture is exactly the tiny family's (stages/families/sd15.py `tiny_vae`, 4 latent channels); an
autoencoder on freshly drawn images every step (the demo's own drawing code for half of each batch, wider
variety for the rest: palette colors with shade jitter, sizes, positions, backgrounds, sometimes two shapes),
MSE on pixels, a small penalty on latent magnitude so the scale stays put, and a little noise on the latents so
the decoder tolerates the imperfect latents a briefly trained denoiser produces. Afterwards the posterior's
log-variance is pinned to POSTERIOR_LOGVAR (near-deterministic, like a trained SD VAE) and the scaling factor that
gives the demo's latent means unit std is measured and stored in the file's metadata.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from tuneline.schemas.demo import DEMO_COLORS, DEMO_SHAPES  # noqa: E402
from tuneline.schemas.families import FAMILY_FACTS  # noqa: E402
from tuneline.stages.families.sd15.adapter import tiny_vae  # noqa: E402
from tuneline.stages.families.tiny.adapter import DEMO_VAE_FILE, POSTERIOR_LOGVAR  # noqa: E402
from tuneline.stages.scan.demo import RGB, SIZES, _draw  # noqa: E402

SEED = 0
THREADS = 1


def draw_varied(rng: random.Random) -> Image.Image:
    """Beyond the demo's images: any size 0.3-1.0 of the short edge, anywhere, light or tinted background,
    sometimes a second shape."""
    w, h = rng.choice(SIZES)
    base = rng.randint(150, 250)
    bg = tuple(max(0, min(255, base + rng.randint(-20, 20))) for _ in range(3))
    img = Image.new("RGB", (w, h), bg)
    draw = ImageDraw.Draw(img)
    for _ in range(1 if rng.random() < 0.75 else 2):
        fill = tuple(max(0, min(255, c + rng.randint(-30, 30))) for c in RGB[rng.choice(DEMO_COLORS)])
        edge = max(4, int(min(w, h) * rng.uniform(0.3, 1.0)))
        left, top = rng.randint(0, w - edge), rng.randint(0, h - edge)
        box = (left, top, left + edge - 1, top + edge - 1)
        (draw.ellipse if rng.choice(DEMO_SHAPES) == "circle" else draw.rectangle)(box, fill=fill)
    return img


def to_tensor(images: list[Image.Image]) -> torch.Tensor:
    """[-1, 1] NCHW, as diffusers' VAE image processor feeds the VAE."""
    arr = np.stack([np.asarray(i, dtype=np.float32) for i in images]) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous()


def batch(rng: random.Random, size: tuple[int, int], n: int) -> torch.Tensor:
    """n images of one size (a batch must share it): half drawn as the demo draws, half varied."""
    images = []
    for i in range(n):
        if i % 2 == 0:
            images.append(_draw(rng.choice(DEMO_COLORS), rng.choice(DEMO_SHAPES), size, rng))
        else:
            img = draw_varied(rng)
            images.append(img if img.size == size else img.resize(size, Image.NEAREST))
    return to_tensor(images)


def demo_images() -> torch.Tensor:
    """64x64 images as the demo draws them, every class, for measuring the scaling factor and the final error."""
    rng = random.Random(12345)
    return to_tensor([_draw(c, s, (64, 64), rng) for c in DEMO_COLORS for s in DEMO_SHAPES for _ in range(8)])


def train(steps: int, batch_size: int, lr: float, log_every: int) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(SEED)
    vae = tiny_vae(4, FAMILY_FACTS["tiny"])
    c = vae.config.latent_channels
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(SEED)
    noise = torch.Generator().manual_seed(SEED + 1)
    start = time.monotonic()
    for step in range(steps):
        # Cosine decay after a short warm-up: stable start, a settled end.
        warm = min(1.0, (step + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
        x = batch(rng, SIZES[step % len(SIZES)], batch_size)
        moments = vae.quant_conv(vae.encoder(x))
        z = moments[:, :c]
        z_noisy = z + 0.05 * z.detach().std() * torch.randn(z.shape, generator=noise)
        y = vae.decode(z_noisy).sample
        rec = torch.nn.functional.mse_loss(y, x)
        loss = rec + 1e-4 * z.pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if (step + 1) % log_every == 0 or step == 0:
            print(f"step {step + 1}/{steps} mse {rec.item():.5f} ({time.monotonic() - start:.0f}s)", flush=True)
    with torch.no_grad():
        vae.quant_conv.weight[c:] = 0
        vae.quant_conv.bias[c:] = POSTERIOR_LOGVAR
    vae.eval()
    with torch.no_grad():
        x = demo_images()
        mean = vae.encode(x).latent_dist.mean
        mse = torch.nn.functional.mse_loss(vae.decode(mean).sample, x).item()
    # Scaling factor as SD defines it: 1 / std of the latents; rounded so facts and file can agree exactly.
    scale = round(1.0 / mean.std().item(), 4)
    info = {
        "scaling_factor": scale,
        "demo_mse": round(mse, 6),
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": SEED,
        "torch": torch.__version__,
    }
    # Printed, not stored: the file must not depend on how long the run took.
    print(f"trained in {time.monotonic() - start:.0f}s", flush=True)
    return vae, info


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--out", type=Path, default=DEMO_VAE_FILE)
    ap.add_argument("--log-every", type=int, default=100)
    args = ap.parse_args(argv)
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    vae, info = train(args.steps, args.batch_size, args.lr, args.log_every)
    from safetensors.torch import save_file

    args.out.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in vae.state_dict().items()}
    # One metadata entry holding sorted JSON: safetensors writes several entries in no fixed order, which would make
    # two identical trainings differ in bytes.
    save_file(state, str(args.out), metadata={"demo_vae": json.dumps(info, sort_keys=True)})
    print(json.dumps(info), f"-> {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
