"""What a scan tells the user: the bucket table and the rejected files as Prefect artifacts, and the log."""

from __future__ import annotations

from pathlib import Path

from tuneline.schemas.scan import Rejected
from tuneline.stages.common import markdown as md
from tuneline.stages.scan import buckets as bk

REPORT_ROWS = 500  # rejected files listed in the Prefect markdown artifact; rejected.jsonl has them all


def report(
    ctx, root: Path, rows, plan, rejected: list[Rejected], reopened: int, accepted: int, duplicates: list[list[str]]
) -> None:
    ctx.reporter.table(
        "scan-buckets",
        bk.table(rows, plan),
        f"{accepted} images in {len(rows)} buckets from {md.text(root)} ({reopened} files read)",
    )
    ctx.log.info(
        "scan: %d accepted, %d rejected, %d buckets, %d files read", accepted, len(rejected), len(rows), reopened
    )
    if rejected:
        rows = [f"| {md.text(r.path)} | {md.text(r.kind)} | {md.text(r.reason)} |" for r in rejected[:REPORT_ROWS]]
        more = (
            [f"\n... and {len(rejected) - REPORT_ROWS} more in rejected.jsonl"] if len(rejected) > REPORT_ROWS else []
        )
        ctx.reporter.markdown(
            "scan-rejected",
            "\n".join(["| file | kind | reason |", "|---|---|---|", *rows, *more]),
            f"{len(rejected)} files rejected from {md.text(root)}",
        )
    for r in rejected[:20]:
        ctx.log.warning("scan: rejected %s: %s", r.path, r.reason)
    if len(rejected) > 20:
        ctx.log.warning("scan: ... and %d more rejected (see rejected.jsonl)", len(rejected) - 20)
    for group in duplicates[:20]:
        ctx.log.warning("scan: identical content: %s", ", ".join(group))
