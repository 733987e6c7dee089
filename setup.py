"""Package discovery: the three top-level folders install as `tuneline.flows`, `tuneline.stages` and
`tuneline.schemas` (pyproject.toml's package-dir), each with every package below it. pyproject.toml cannot prefix
what `packages.find` discovers, so the list is computed here: a new family folder ships without being listed."""

from setuptools import find_packages, setup

TOP = ("flows", "stages", "schemas")

setup(packages=[f"tuneline.{name}" for top in TOP for name in (top, *(f"{top}.{p}" for p in find_packages(top)))])
