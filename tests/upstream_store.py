"""A session's store of built upstream artifacts (scan → latents → text), so tests that differ only downstream of
them build the caches once.

    store = UpstreamStore(tmp_root)
    data = store.dataset("demo", write_demo_dataset)   # one shared folder: the scan key holds its path and mtimes
    cfg = small_config(workdir, {...}, dataset={"path": str(data)})
    ctx = store.upstream(cfg)                          # scan, latents and text fresh in cfg.workdir

`upstream(cfg)` runs the stages through the real stage runner in the store's own workdir, so a set of artifacts
is built once per distinct set of stage keys (config, inputs, code version, upstream versions: the stages' own
freshness rule) and reused by every later config with the same keys. It then copies the published version
directories, and the tiny model folder they were built from, into `cfg.workdir` and records the content-addressed
scan's key there, as a build in that workdir would have: the test's stages see them as fresh and verify them
(manifest digest, listed files) exactly as built ones. Copies, not links: a test that tampers with its caches
must not tamper with the store.

One store per test run (the `upstream_store` fixture in tests/conftest.py), shared by pytest-xdist's workers:
one builds or copies at a time (a lock file in the store), the others wait and then reuse what it built.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tuneline.schemas.config import PipelineConfig
from tuneline.schemas.families import facts
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.stage import INDEX, StageContext, key_parts, run_stage
from tuneline.stages.families.folders import tiny_dir
from tuneline.stages.pipeline import stages_for

UPSTREAM = ("scan", "caption", "latents", "text")  # every stage before train (caption only when it is on)


class UpstreamStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.work = self.root / "work"
        self.builds = 0  # stages this process built (not reused): how well a session shares them

    @contextmanager
    def _held(self) -> Iterator[None]:
        """The store to this process alone while it writes (a build, a dataset) or copies."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            yield

    def dataset(self, name: str, write: Callable[[Path], None]) -> Path:
        """A dataset folder shared by the session, written once by `write(folder)`."""
        folder, written = self.root / "datasets" / name, self.root / "datasets" / f"{name}.written"
        with self._held():
            if not written.is_file():
                shutil.rmtree(folder, ignore_errors=True)  # a write that did not finish
                write(folder)
                written.touch()
        return folder

    def upstream(self, cfg: PipelineConfig) -> StageContext:
        """Scan, latents and text (and caption when on) for `cfg`, fresh in `cfg.workdir`; the context to go on
        with (train, validate) there."""
        with self._held():
            return self._upstream(cfg)

    def _upstream(self, cfg: PipelineConfig) -> StageContext:
        shared = StageContext(cfg.model_copy(update={"workdir": str(self.work)}))
        ctx = StageContext(cfg)
        for sd in stages_for(cfg):
            if sd.name not in UPSTREAM:
                continue
            path, built = run_stage(shared, sd, stages_for(cfg))
            self.builds += built
            self._copy(path, ctx.store.version_dir(sd.name, path.name))
            if sd.content_addressed:
                key = digest(key_parts(ctx, sd, {}))
                _index(ctx.store.stage_dir(sd.name), key, path.name)
        tiny = tiny_dir(facts(cfg.model.family), self.work / "models")
        if cfg.model.path is None and tiny.is_dir():  # the tiny flavor the caches were encoded with
            self._copy(tiny, ctx.workdir / "models" / tiny.name)
        return ctx

    @staticmethod
    def _copy(src: Path, dest: Path) -> None:
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.copy")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(src, tmp)
            tmp.rename(dest)


def _index(stage_dir: Path, key: str, version: str) -> None:
    """Record key -> version in a content-addressed stage's index, as its build does."""
    path = stage_dir / INDEX
    index = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    path.write_text(json.dumps(index | {key: version}, indent=1), encoding="utf-8")
