"""Every document a project file names is in the repository: comments, docstrings, docs, CI and packaging cite
files a maintainer can open, not notes kept elsewhere."""

from __future__ import annotations

import re
import subprocess

from tests.helpers import ROOT

DOC = re.compile(r"(?<![\w/.-])([\w./-]*[A-Za-z0-9_-]\.md)\b")


def _project_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def test_every_named_document_exists_in_the_repository():
    files = _project_files()
    names = {f.rsplit("/", 1)[-1] for f in files}
    missing = []
    for rel in files:
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for ref in DOC.findall(line):
                ref = ref.lstrip("./")
                here = (ROOT / rel).parent / ref
                if not ((ROOT / ref).is_file() or here.is_file() or ("/" not in ref and ref in names)):
                    missing.append(f"{rel}:{lineno}: {ref}")
    assert not missing, "files name documents the repository does not have:\n" + "\n".join(missing)
