"""Prefect artifacts that show each stage's result in the UI, built from its published manifest.

They are written for fresh (skipped) stages too, so every flow run shows what it used. Stage cores report
their own progress while they build; this adds the summary, cache statistics, the loss plot, the validation
grid (tuneline.flows.results builds those two, for the pipeline run too) and the lineage table.
"""

from __future__ import annotations

import json
from pathlib import Path

from tuneline.flows.reporter import PrefectReporter
from tuneline.flows.results import grid_markdown, image_url, inline_png, learning_rows, train_loss_markdown
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
        rep.markdown("train-loss", train_loss_markdown(cfg, path, m), f"training loss, {len(m['losses'])} steps")
        samples = [s for s in (inline_png(path / rel) for rel in m.get("samples", [])[-4:]) if s]
        if samples:
            rep.markdown(
                "train-samples",
                "\n\n".join(f"![]({s})" for s in samples),
                "sample grids rendered during training (latest last)",
            )
    elif name == "validate":
        _report_validation(rep, cfg, path, m, "validate-grid")
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


def _report_validation(rep: PrefectReporter, cfg: PipelineConfig, path: Path, m: dict, key: str) -> None:
    url = image_url(cfg, "validate", path.name, m.get("grid", "grid.png"))
    if url:
        rep.image(f"{key}-image", url, f"validation grid of {path.name}")
    what = "edits" if m.get("controls") else "images"
    rep.markdown(key, grid_markdown(cfg, path, m), f"validation {what} of {path.name}, labelled with their prompts")


def report_results(rep: PrefectReporter, cfg: PipelineConfig, runs: dict[str, dict]) -> None:
    """The pipeline run's own copy of its results (the grid, the loss curve, the learning figures), so they are
    on the page of the run the user started, not only on its stage runs'."""
    train = _manifest(Path(runs["train"]["path"])) if "train" in runs else {}
    validate = _manifest(Path(runs["validate"]["path"])) if "validate" in runs else {}
    if validate:
        _report_validation(rep, cfg, Path(runs["validate"]["path"]), validate, "pipeline-validate-grid")
    if train.get("losses"):
        rep.markdown(
            "pipeline-train-loss",
            train_loss_markdown(cfg, Path(runs["train"]["path"]), train),
            f"training loss, {train.get('step')} steps",
        )
    from tuneline.flows.summary import final_loss

    rows = learning_rows(final_loss(Path(runs["train"]["path"])) if train else None, validate)
    if rows:
        rep.table(
            "pipeline-learning", rows, "what the run learned (the demos also measure it against the untrained model)"
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
        shown = f"![{md.text(r['ref'])}]({thumb})" if thumb else md.text(r["ref"])
        lines.append(f"| {shown} | {md.text(r['caption'])} | {r['source']} |")
    return "\n".join(lines)


def _manifest(path: Path) -> dict:
    try:
        return json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
