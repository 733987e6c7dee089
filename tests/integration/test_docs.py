"""The README is a front page and the rest of the documentation a site that builds: links that resolve, every page
in the navigation, the config reference generated from the schema."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from tests.helpers import ROOT, readme_commands

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_is_a_front_page_whose_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < 150
    demo, tests = readme_commands()
    assert demo.endswith("tuneline run") and tests.endswith("python -m pytest -q")
    targets = [t for t in LINK.findall(text) if "://" not in t]
    assert "docs/demo-grid.png" in targets and "docs/install.md" in targets
    missing = [t for t in targets if not (ROOT / t).is_file()]
    assert not missing, f"README links to files that do not exist: {missing}"
    for command in ("run", "stage", "status", "plan", "config", "captions", "deploy", "worker", "lineage", "gc"):
        assert f"`tuneline {command}" in text, f"the README's command table leaves out `tuneline {command}`"
    assert "tuneline remote" in text and "--version" in text


def test_the_install_claim_names_the_cuda_download_and_the_cpu_index():
    for page in ("README.md", "docs/install.md"):
        text = " ".join((ROOT / page).read_text(encoding="utf-8").split())
        assert "https://download.pytorch.org/whl/cpu" in text, page
        assert "CUDA build" in text and "2.7 GB" in text, page
    assert "picks the CPU build instead" not in (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_docs_page_is_in_the_navigation():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    listed = set(re.findall(r"[\w-]+\.md", str(nav)))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == listed, (
        f"pages not in mkdocs.yml's nav: {pages - listed}; nav entries without a page: {listed - pages}"
    )


def test_site_builds_strictly_with_the_generated_config_reference(tmp_path):
    pytest.importorskip("mkdocs", reason='the docs extra: pip install -e ".[docs]"')
    from tuneline.schemas.reference import field_docs

    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    reference = (tmp_path / "site" / "config" / "index.html").read_text(encoding="utf-8")
    keys = [d.key for d in field_docs()]
    assert len(keys) > 100 and all(f"<code>{k}</code>" in reference for k in keys)
    assert "where artifacts go" in reference  # a description, read from the schema
    bench = (tmp_path / "site" / "benchmarks" / "index.html").read_text(encoding="utf-8")
    assert "noop_vs_full" in bench  # bench/README.md, included at build time
