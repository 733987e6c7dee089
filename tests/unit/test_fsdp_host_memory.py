"""The malloc settings FSDP's training processes start with where the host holds the training state
(stages/train/fsdp.py): glibc hands the memory of freed tensors back to the system, where by default it keeps it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from tuneline.schemas.train import TrainConfig
from tuneline.stages.train.fsdp import HOST_MALLOC, host_memory_env

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
# A block freed after an mmapped one of 8 MiB (glibc's threshold rises to it), then 64 blocks of 4 MiB between smaller
# ones that stay (as FSDP's gathered weights between the tensors a step keeps): how much freeing them gives back.
GIVEN_BACK = """
import ctypes, re
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) // 1024
first = libc.malloc(8 << 20)
ctypes.memset(first, 1, 8 << 20)
libc.free(first)
blocks, kept = [], []
for _ in range(64):
    blocks.append(libc.malloc(4 << 20))
    ctypes.memset(blocks[-1], 1, 4 << 20)
    kept.append(libc.malloc(96 << 10))
before = rss()
for b in blocks:
    libc.free(b)
print(before - rss())
"""


def _given_back_mb(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", GIVEN_BACK], env=env, check=True, capture_output=True, text=True)
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's tunables")
def test_fsdp_processes_give_freed_tensors_back_where_glibc_keeps_them():
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    fsdp = plain | host_memory_env(TrainConfig(parallelism="fsdp", validate_every=0), CPU, plain)
    assert _given_back_mb(plain) < 64  # of the 256 MB freed
    assert _given_back_mb(fsdp) > 200


def test_only_sharded_runs_holding_state_on_the_host_get_them_and_a_users_tunables_stay():
    fsdp = TrainConfig(parallelism="fsdp", validate_every=0)
    assert host_memory_env(TrainConfig(), CPU, {}) == {}  # DDP keeps its processes as they were
    assert host_memory_env(fsdp, CUDA, {}) == {}  # the state is on the GPU
    offload = TrainConfig(parallelism="fsdp", fsdp_cpu_offload=True, validate_every=0)
    assert host_memory_env(offload, CUDA, {}) == {}  # unmeasured with the state offloaded from a GPU
    mine = host_memory_env(fsdp, CPU, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert mine == {"GLIBC_TUNABLES": ":".join(("glibc.malloc.arena_max=2", *HOST_MALLOC))}
