"""Prefect artifacts that show each stage's result in the UI, built from its published manifest.

They are written for fresh (skipped) stages too, so every flow run shows what it used. Stage cores report
their own progress while they build; this adds the summary, cache statistics, the loss plot, the validation
grid and the lineage table. Browsers cannot open local paths, so images become image artifacts only when a
URL reaches them (ops.report_url, or a signed URL of the pushed remote copy); markdown artifacts carry
size-capped thumbnails inline as data: URIs, which the UI renders without any web server.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

from PIL import Image

from tuneline.flows.reporter import PrefectReporter
from tuneline.schemas.config import PipelineConfig
from tuneline.stages.common import markdown as md
from tuneline.stages.common.lineage import Version

FACTS = (
    "accepted",
    "rejected",
    "count",
    "captioned",
    "encoded",
    "reused",
    "resumed",
    "step",
    "world_size",
    "mode",
    "class_separation_accuracy",
    "untrained_class_separation_accuracy",
    "color_accuracy",
    "untrained_color_accuracy",
)
PLOT_WIDTH, PLOT_HEIGHT = 60, 10
THUMB_SIDE, THUMB_BYTES = 768, 150_000  # an artifact is stored in Prefect's database: keep each image small


def report_stage(rep: PrefectReporter, cfg: PipelineConfig, name: str, path: Path, built: bool) -> None:
    m = _manifest(path)
    rep.markdown(f"{name}-summary", summary_markdown(name, path, m, built), f"{name} {path.name}")
    if name == "scan" and not built:  # a build already reported its bucket table
        rep.table(
            "scan-buckets",
            [
                {"bucket": f"{b['width']}x{b['height']}", "count": b["count"], "dropped": b.get("dropped", False)}
                for b in m.get("buckets", [])
            ],
            "aspect buckets of the scan in use",
        )
    elif name == "latents":
        rep.table("latents-cache", cache_rows(m), cache_description(m))
    elif name == "train" and m.get("losses"):
        rep.markdown(
            "train-loss",
            _with_image(path / m.get("loss_curve", "loss.png"), loss_markdown(m["losses"])),
            f"training loss, {len(m['losses'])} steps",
        )
        samples = [s for s in (inline_png(path / rel) for rel in m.get("samples", [])[-4:]) if s]
        if samples:
            rep.markdown(
                "train-samples",
                "\n\n".join(f"![]({s})" for s in samples),
                "sample grids rendered during training (latest last)",
            )
    elif name == "validate":
        _report_validation(rep, cfg, path, m)
    elif name == "caption":
        rep.markdown("caption-samples", caption_markdown(path), f"sample captions of {path.name}")


def summary_markdown(name: str, path: Path, m: dict, built: bool) -> str:
    how = "built in this run" if built else "fresh: reused as is, nothing rebuilt"
    ups = ", ".join(f"{s} `{v}`" for s, v in m.get("upstream", {}).items()) or "none"
    lines = [
        f"### {name} `{path.name}`",
        "",
        f"- {how}",
        f"- path: {md.text(path)}",
        f"- created: {m.get('created_at')}",
        f"- upstream: {ups}",
    ]
    lines += [f"- {k}: {m[k]}" for k in FACTS if m.get(k) is not None]
    return "\n".join(lines)


def cache_rows(m: dict) -> list[dict]:
    return [
        {"bucket": f"{b['width']}x{b['height']}", "latent shape": "x".join(map(str, b["shape"])), "rows": b["count"]}
        for b in m.get("buckets", [])
    ]


def cache_description(m: dict) -> str:
    total = m.get("count", 0)
    reused = m.get("reused", 0) + m.get("resumed", 0)
    rate = f"{reused / total:.0%}" if total else "n/a"
    return (
        f"{total} cached images: {m.get('encoded', 0)} encoded, {m.get('reused', 0)} reused from the previous "
        f"version, {m.get('resumed', 0)} resumed; {m.get('rejected', 0)} rejected; reuse rate {rate}"
    )


def loss_plot(losses: list[float], width: int = PLOT_WIDTH, height: int = PLOT_HEIGHT) -> str:
    """A text chart (renders anywhere, needs no image URL): one column per bucket of steps, mean loss."""
    n = len(losses)
    cols = min(width, n)
    means = [_mean(losses[i * n // cols : (i + 1) * n // cols]) for i in range(cols)]
    lo, hi = min(means), max(means)
    span = (hi - lo) or 1.0
    levels = [round((v - lo) / span * (height - 1)) for v in means]
    rows = []
    for level in range(height - 1, -1, -1):
        label = f"{lo + span * level / (height - 1):9.4f} |" if level in (0, height - 1) else " " * 10 + "|"
        rows.append(label + "".join("*" if lv == level else " " for lv in levels))
    rows.append(" " * 10 + "+" + "-" * cols)
    rows.append(" " * 11 + f"step 1 .. {n}")
    return "\n".join(rows)


def loss_markdown(losses: list[float]) -> str:
    head = (
        f"first {losses[0]:.4f}, last {losses[-1]:.4f}, min {min(losses):.4f} "
        f"(mean of the last {min(10, len(losses))}: {_mean(losses[-10:]):.4f})"
    )
    return f"{head}\n\n```\n{loss_plot(losses)}\n```"


def lineage_table(versions: list[Version]) -> list[dict]:
    return [
        {
            "stage": v.stage,
            "version": v.version,
            "fresh": "yes" if v.fresh else "",
            "upstream": v.upstream_text(),
            "created_at": v.created_at,
        }
        for v in versions
    ]


def image_url(cfg: PipelineConfig, stage: str, version: str, rel: str) -> str | None:
    if cfg.ops.report_url:
        return f"{cfg.ops.report_url.rstrip('/')}/{stage}/{version}/{rel}"
    if cfg.ops.remote:
        from tuneline.stages.common.remote import Remote

        return Remote(cfg.ops.remote, cfg.ops.remote_options).signed_url(stage, version, rel)
    return None


def _report_validation(rep: PrefectReporter, cfg: PipelineConfig, path: Path, m: dict) -> None:
    grid = m.get("grid", "grid.png")
    url = image_url(cfg, "validate", path.name, grid)
    if url:
        rep.image("validate-grid-image", url, f"validation grid of {path.name}")

    def link(rel: str) -> str:
        return f"[{md.text(rel)}]({image_url(cfg, 'validate', path.name, rel) or rel})"

    controls = m.get("controls") or []  # an edit family: each row's control (input) beside its result
    rows = [
        f"| {link(controls[n]) + ' | ' if controls else ''}{link(i['file'])} | {md.text(i['prompt'])} | "
        f"{md.text(i['negative_prompt'])} | {i['seed']} |"
        for n, i in enumerate(m.get("images", []))
    ]
    head = ["| control | image | prompt | negative | seed |", "|---|---|---|---|---|"] if controls else []
    head = head or ["| image | prompt | negative | seed |", "|---|---|---|---|"]
    thumb = inline_png(path / grid)
    where = f"![grid]({thumb})" if thumb else ""
    where += "\n\neach row: control | result" if controls else ""
    where += f"\n\nfull size: [{grid}]({url})" if url else f"\n\nfull size: `{path / grid}`"
    rep.markdown(
        "validate-grid",
        "\n".join([where, "", *head, *rows]),
        f"validation {'edits' if controls else 'images'} of {path.name}",
    )


def caption_markdown(path: Path, count: int = 8) -> str:
    """A table of sample images (inline thumbnails) and their captions from a caption artifact."""
    from tuneline.schemas.caption import CaptionManifest
    from tuneline.stages.caption.export import image_paths, sample
    from tuneline.stages.common.artifacts import ArtifactStore

    store = ArtifactStore(path.parents[2])
    picked = sample(path, count)
    files = image_paths(store, store.read(path, CaptionManifest), picked)
    lines = ["| image | caption | source |", "|---|---|---|"]
    for r, f in zip(picked, files):
        thumb = inline_png(f, side=128, max_bytes=20_000) if f is not None else None
        cell = f"![{md.text(r['ref'])}]({thumb})" if thumb else md.text(r["ref"])
        lines.append(f"| {cell} | {md.text(r['caption'])} | {r['source']} |")
    return "\n".join(lines)


def inline_png(file: Path, side: int = THUMB_SIDE, max_bytes: int = THUMB_BYTES) -> str | None:
    """A data:image/png;base64 thumbnail of file, halved until it fits max_bytes; None when unreadable."""
    try:
        img = Image.open(file).convert("RGB")
    except OSError:
        return None
    img.thumbnail((side, side))
    while True:
        buf = io.BytesIO()
        img.save(buf, format="PNG", optimize=True)
        if buf.tell() <= max_bytes or min(img.size) < 32:
            return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
        img = img.resize((max(1, img.width // 2), max(1, img.height // 2)))


def _with_image(file: Path, text: str) -> str:
    thumb = inline_png(file)
    return f"![]({thumb})\n\nfull size: `{file}`\n\n{text}" if thumb else text


def _manifest(path: Path) -> dict:
    try:
        return json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)
