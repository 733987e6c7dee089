"""Fault injection on demand: >= 10 SIGKILLs per stage, then a rerun; prints the counts and the pass fraction.

    .venv/bin/python bench/faults.py            # 10 kills per stage (about 15 min on 2 cores)
    TUNELINE_FAULT_KILLS=20 TUNELINE_FAULT_SEED=3 .venv/bin/python bench/faults.py

Each trial is one `tuneline run` of a tiny config on a shared workdir, SIGKILLed as a whole process group at a
seeded random point of its target stage (drawn over that stage's measured duration); the next run must resume
and finish what it left. A trial passes when, after its kill: no process of the run is left (torchrun's agent
and workers included), nothing under the workdir still changes, no lock is held, no directory under
artifacts/<stage>/ without a leading dot lacks a manifest that verifies; and, once its stage is published
again, the new version is the one the killed run was building (its .partial directory was reused; latents
resumed every finished block; training resumed from its last checkpoint). Walks are repeated with new seeds
until every stage has taken its kills. See tests/reliability/killwalk.py.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import PrefectServer  # noqa: E402
from tests.reliability import (
    faultlib as fl,  # noqa: E402
    killwalk,  # noqa: E402
)

KILLS = int(os.environ.get("TUNELINE_FAULT_KILLS", "10"))
SEED = int(os.environ.get("TUNELINE_FAULT_SEED", "0"))


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="tuneline-faults-"))
    config = fl.write_config(tmp / "config.yaml", fl.small_config(tmp / "data"))
    started = time.monotonic()
    kills: list[killwalk.Kill] = []
    problems: list[str] = []
    final: list[str] = []
    with PrefectServer() as server:
        print(f"fault injection: {KILLS} kills per stage, seed {SEED}, work in {tmp}", flush=True)
        walk_no = 0
        while walk_no < 3 and any(_aimed(kills, s) < KILLS for s in fl.STAGES):
            need = max(KILLS - _aimed(kills, s) for s in fl.STAGES)
            w = killwalk.walk(
                tmp / f"walk{walk_no}", config, server.env, need, SEED + walk_no, tmp / f"walk{walk_no}.log"
            )
            kills += w.kills
            problems += w.problems
            final += w.final
            print(f"walk {walk_no}: {w.summary()}", flush=True)
            walk_no += 1
        leaked = fl.train_slots(server.env)
    failed = {id(k) for k in kills if k.problems}
    for s in fl.STAGES:
        ks = [k for k in kills if k.landed == s]
        print(
            f"{s:9s} kills {len(ks):3d}  in build {sum(k.phase == 'build' for k in ks):3d}  "
            f"preparing {sum(k.phase == 'prepare' for k in ks):3d}  "
            f"failed {sum(id(k) in failed for k in ks):3d}"
        )
    print(
        f"outside any stage: {sum(k.landed == '-' for k in kills)}; total {len(kills)} kills in "
        f"{time.monotonic() - started:.0f} s"
    )
    print(f"tuneline-train concurrency slots still held after the walks: {leaked} (killed trainings' leases)")
    for p in problems[:40]:
        print(f"PROBLEM {p}")
    fraction = (len(kills) - len(failed)) / max(1, len(kills))
    enough = all(_aimed(kills, s) >= KILLS for s in fl.STAGES)
    print(
        f"kills aimed at each stage that landed in it: "
        f"{', '.join(f'{s} {_aimed(kills, s)}' for s in fl.STAGES)}; final runs completed: {not final}"
    )
    ok = fraction >= 1 and enough and not final
    print(f"RESULT fault_trials_passed {fraction:.3f} goal >= 1 {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def _aimed(kills: list[killwalk.Kill], stage: str) -> int:
    return sum(k.target == k.landed == stage for k in kills)


if __name__ == "__main__":
    sys.exit(main())
