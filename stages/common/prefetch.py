"""A bounded, ordered background prefetch: `ahead(items, prepare)` yields prepare(item) for each item in order,
computed up to `depth` items ahead by `workers` threads while the caller works on the current one.

The training loop feeds its steps through it (reads of the latent and text caches overlap the step), and a
remote cache (one GET per array and block) keeps several reads in flight with more workers. Items are pulled from
`items` lazily, so an endless stream is fine; what is prepared ahead and never taken is discarded. An exception
raised by prepare reaches the caller when it takes that item.

Each worker runs torch's CPU ops on its own thread alone (`serial_torch`): the caller owns the cores. A worker left
at the process's intra-op count starts an OpenMP team of its own at its first large copy, and once the teams'
threads outnumber the cores, OpenMP stops spinning at its barriers and puts every waiting thread to sleep, the
caller's included: each parallel op of the step then pays a sleep and a wake (a CPU training step of the tiny SDXL
at two threads took 75.7 ms with the feed running beside it, 16.4 ms with its threads on one; bench/README.md).
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ahead(
    items: Iterable[T], prepare: Callable[[T], R], *, workers: int = 1, depth: int = 2, name: str = "prefetch"
) -> Iterator[R]:
    if workers < 1 or depth < 1:
        raise ValueError(f"ahead needs workers >= 1 and depth >= 1, got {workers} and {depth}")
    pool = ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=serial_torch)
    pending: deque[Future] = deque()
    source = iter(items)
    try:
        while True:
            while len(pending) < depth:
                item = next(source, _END)
                if item is _END:
                    break
                pending.append(pool.submit(prepare, item))
            if not pending:
                return
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_END = object()


def serial_torch() -> None:
    """Run this thread's torch CPU ops on one thread. OpenMP's thread count is per thread, where
    torch.set_num_threads would also change the count every thread started later takes."""
    import torch

    torch.get_num_threads()  # torch sets each thread's OpenMP count at its first op: before ours, not after
    try:  # the OpenMP runtime torch's own extension links, found through its dependencies whatever its file name
        ctypes.CDLL(torch._C.__file__).omp_set_num_threads(1)
    except (AttributeError, OSError):
        pass  # a torch built without OpenMP (its own thread pool): no per-thread teams to limit
