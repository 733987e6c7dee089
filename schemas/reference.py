"""The config's own documentation, read from the schema: every key with its type, default and description.

One walk over the pydantic models serves the docs site's config reference (docs/hooks/reference.py builds it at
`mkdocs build` time) and the comments of `tuneline config example`, so neither can drift from the schema.
"""

from __future__ import annotations

import re
import textwrap
import typing
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class FieldDoc:
    key: str  # dotted, with `[]` for a list's items: `validate.prompts[].seed`
    type: str
    default: str
    description: str
    section: bool  # a nested model (its own keys follow)


def _models(annotation) -> list[type[BaseModel]]:
    """The pydantic models inside an annotation (`X | None`, `list[X]`, `Annotated[...]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _is_list(annotation) -> bool:
    if typing.get_origin(annotation) is list:
        return True
    return any(_is_list(a) for a in typing.get_args(annotation) if a is not type(None))


def _type_name(annotation) -> str:
    text = re.sub(r"\b(?:typing|tuneline\.schemas\.\w+|pydantic\.\w+)\.", "", repr(annotation))
    text = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", text)
    text = re.sub(r"Annotated\[(.*?), .*\]$", r"\1", text)
    return text.replace("NoneType", "None").replace("Literal", "one of ")


def _default(info) -> str:
    if info.default_factory is not None:
        return ""
    if info.default is PydanticUndefined:
        return "required"
    return repr(info.default) if not isinstance(info.default, str) else f'"{info.default}"'


def _description(info, model: type[BaseModel] | None) -> str:
    text = info.description or (model.__doc__ or "" if model is not None else "")
    return " ".join(text.split())


def field_docs(model: type[BaseModel] | None = None, prefix: str = "") -> list[FieldDoc]:
    """Every key of `model` (default: the pipeline config) and of the models nested in it, in schema order."""
    if model is None:
        from tuneline.schemas.config import PipelineConfig

        model = PipelineConfig
    out: list[FieldDoc] = []
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        nested = _models(info.annotation)
        sub = nested[0] if len(nested) == 1 else None
        out.append(FieldDoc(key, _type_name(info.annotation), _default(info), _description(info, sub), bool(sub)))
        if sub is not None:
            out += field_docs(sub, key + ("[]." if _is_list(info.annotation) else "."))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference_markdown() -> str:
    """The config reference: one table per top-level section."""
    docs = field_docs()
    parts: list[str] = []
    for top in (d for d in docs if "." not in d.key and "[" not in d.key):
        parts.append(f"## `{top.key}`\n\n{top.description}\n" if top.description else f"## `{top.key}`\n")
        rows = [d for d in docs if d.key.startswith(top.key + ".") or d.key.startswith(top.key + "[]")]
        rows = rows if top.section else [top]
        parts.append("| key | type | default | what it does |\n|---|---|---|---|")
        parts += [
            f"| `{d.key}` | {_cell(d.type)} | {_cell(f'`{d.default}`' if d.default else '')} | {_cell(d.description)} |"
            for d in rows
        ]
        parts.append("")
    return "\n".join(parts)


KEY_LINE = re.compile(r"^(?P<indent> *)(?P<dash>- )?(?P<key>[A-Za-z_][\w]*):")


def commented_yaml(text: str, width: int = 100) -> str:
    """YAML as PyYAML's safe_dump writes it (block style, indentless lists), each key preceded by its description
    from the schema as a comment (a list's item keys on its first item only). Comments leave the data unchanged."""
    described = {d.key: d.description for d in field_docs()}
    stack: list[tuple[int, str]] = []  # (indent, key path) of the enclosing keys
    seen: set[str] = set()
    out: list[str] = []
    for line in text.splitlines():
        m = KEY_LINE.match(line)
        if m is None:
            out.append(line)
            continue
        indent = len(m.group("indent"))
        if m.group("dash"):
            while stack and stack[-1][0] > indent:
                stack.pop()
            owner = stack[-1][1] if stack else ""
            stack.append((indent + 1, owner + "[]"))
            indent += 2
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        path = f"{parent}.{m.group('key')}" if parent else m.group("key")
        stack.append((indent, path))
        note = described.get(path)
        if note and path not in seen:
            seen.add(path)
            pad = " " * indent
            out += [pad + "# " + part for part in textwrap.wrap(note, max(40, width - indent - 2))]
        out.append(line)
    return "\n".join(out) + "\n"


def nearest_key(loc: tuple) -> str | None:
    """For an unknown key at `loc` (pydantic's error location: section names, list indices, the key), the known
    key of the same section closest to it in spelling; None when nothing is close."""
    import difflib

    parent = ".".join(str(x) for x in loc[:-1] if not isinstance(x, int)).replace("validate_", "validate")
    depth = parent.count(".") + 1 if parent else 0
    known: set[str] = set()
    for d in field_docs():
        plain = d.key.replace("[]", "")
        if (plain.rsplit(".", 1)[0] if "." in plain else "") == parent and plain.count(".") == depth:
            known.add(plain.rsplit(".", 1)[-1])
    close = difflib.get_close_matches(str(loc[-1]), sorted(known), n=1, cutoff=0.6)
    return close[0] if close else None
