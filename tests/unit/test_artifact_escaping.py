"""Prefect Markdown artifacts render what users wrote, and only that: hostile prompts and file names go through the
real artifact-building functions, and the artifact, rendered as Markdown with tables (CommonMark + GFM tables,
as Prefect's UI does), shows each string as one table cell of plain text: no tag, no link, no image fetch."""

from __future__ import annotations

from html.parser import HTMLParser
from types import SimpleNamespace

from markdown_it import MarkdownIt
from PIL import Image

from tuneline.flows.visibility import _report_validation, summary_markdown
from tuneline.schemas.config import parse_config
from tuneline.schemas.validate import RenderedImage
from tuneline.stages.common.report import Reporter
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.scan import STAGE as SCAN
from tuneline.stages.validate.core import report as validate_report

HOSTILE = [
    "<img src=http://203.0.113.9/pixel.png>",
    "a | b | c",
    "line one\nline two",
    "`code` and ``more``",
    "[a link](http://203.0.113.9/) ![an image](http://203.0.113.9/x.png)",
    "**bold** _it_ <b>tag</b> &amp; & <script>alert(1)</script>",
]


class Captured(Reporter):
    def __init__(self) -> None:
        self.markdown_texts: dict[str, str] = {}

    def markdown(self, key: str, text: str, description: str = "") -> None:
        self.markdown_texts[key] = text
        self.markdown_texts[f"{key} (description)"] = description


class Page(HTMLParser):
    """The rendered artifact: every tag, and the text of each table cell."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.cells: list[str] = []
        self.text: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "td":
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self.cells.append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)


def _render(markdown: str) -> Page:
    page = Page()
    page.feed(MarkdownIt("commonmark").enable("table").render(markdown))
    return page


def _shown(s: str) -> str:
    return " ".join(s.split("\n"))


def _check_cells(markdown: str, allowed_tags: set[str]) -> Page:
    page = _render(markdown)
    assert set(page.tags) <= allowed_tags, page.tags
    for s in HOSTILE:
        assert _shown(s) in page.cells, (s, page.cells)
    return page


TABLE_TAGS = {"table", "thead", "tbody", "tr", "th", "td", "p"}


def test_validation_tables_show_prompts_as_text(tmp_path):
    cfg = parse_config({"workdir": str(tmp_path)}, "<test>")
    rendered = [
        RenderedImage(file=f"{i:03d}-seed{i}.png", prompt=s, negative_prompt=s, seed=i, width=8, height=8)
        for i, s in enumerate(HOSTILE)
    ]
    rep = Captured()
    work = tmp_path / "artifacts" / "validate" / ".v1.partial"
    train = SimpleNamespace(stage="train", fingerprint="t1", loss_curve="loss.png")
    validate_report(StageContext(cfg, reporter=rep), work, rendered, {"grid": "grid.png"}, train)
    _check_cells(rep.markdown_texts["validate-images"], TABLE_TAGS)  # file names as text: no link opens from the UI

    path = tmp_path / "artifacts" / "validate" / "v1"
    m = {"images": [r.model_dump() for r in rendered]}
    _report_validation(rep, cfg, path, m, "validate-grid")
    page = _check_cells(rep.markdown_texts["validate-grid"], TABLE_TAGS | {"a", "code"})
    assert page.tags.count("a") == 0  # no ops.report_url: no links at all, and no user text became one


def test_scan_rejections_and_summary_show_file_names_as_text(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        Image.new("RGB", (64, 64), (40 * i, 90, 200)).save(data / f"img{i}.png")
    names = [s.replace("/", "_").replace("\n", " ") + ".heic" for s in HOSTILE]  # unsupported: rejected by name
    for name in names:
        (data / name).write_bytes(b"not an image")
    cfg = parse_config(
        {"workdir": str(tmp_path / "work"), "dataset": {"path": str(data)}, "buckets": {"resolution": 32}}, "<t>"
    )
    rep = Captured()
    path, _ = run_stage(StageContext(cfg, reporter=rep), SCAN, [SCAN])
    page = _render(rep.markdown_texts["scan-rejected"])
    assert set(page.tags) <= TABLE_TAGS, page.tags
    assert {name for name in names} <= set(page.cells)
    assert len(page.cells) == 3 * len(names)  # one row of three cells per file: no `|` split a row

    odd = path.parent / "<img src=http:__203.0.113.9_x.png> | `v`"
    page = _render(summary_markdown("scan", odd, {"upstream": {}}, built=True))
    assert "img" not in page.tags and f"path: {odd}" in "".join(page.text)
