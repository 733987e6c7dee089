"""MkDocs hook: pages generated at build time from the sources they describe, so nothing generated is committed.

- `<!-- config-reference -->` becomes the config reference, one table per section, from the pydantic schema's
  field descriptions (tuneline.schemas.reference).
- `<!-- bench-readme -->` becomes bench/README.md, the benchmarks' own figures, its headings one level down.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def on_page_markdown(markdown: str, page, config, files) -> str:
    if "<!-- config-reference -->" in markdown:
        from tuneline.schemas.reference import reference_markdown

        markdown = markdown.replace("<!-- config-reference -->", reference_markdown())
    if "<!-- bench-readme -->" in markdown:
        bench = (ROOT / "bench" / "README.md").read_text(encoding="utf-8")
        bench = bench.split("\n", 1)[1]  # its title: the page has its own
        markdown = markdown.replace("<!-- bench-readme -->", re.sub(r"^(#+) ", r"#\1 ", bench, flags=re.M))
    return markdown
