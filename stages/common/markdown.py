"""User text in Prefect Markdown artifacts: rendered as written, and only that.

Prompts, captions, file names and rejection reasons come from users. Put into a Markdown table as they are, a `|`
or a newline splits the row, backticks and brackets become code or links, and raw HTML reaches the page (Prefect's
UI strips scripts, but `<img src=http://…>` makes the browser fetch from the host it names). Every character that
Markdown or HTML gives a meaning becomes a numeric character reference, which a renderer shows as the character
itself and never parses as markup (CommonMark: entity references are not used to recognise structure).
"""

from __future__ import annotations

import re

# Markup characters of Markdown (tables, emphasis, code, links, images, headings, lists, escapes) and HTML.
_MARKUP = re.compile(r"[&<>|`\[\]()*_~!#\\{}+=:-]")
_NEWLINES = re.compile(r"\s*[\r\n]+\s*")


def text(value: object) -> str:
    """`value` as literal text for a Markdown table cell, a list item or an artifact description: one line (a
    newline becomes a space), every markup character a character reference."""
    one_line = _NEWLINES.sub(" ", str(value))
    return _MARKUP.sub(lambda m: f"&#{ord(m.group())};", one_line)
