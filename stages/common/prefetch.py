"""A bounded, ordered background prefetch: `ahead(items, prepare)` yields prepare(item) for each item in order,
computed up to `depth` items ahead by `workers` threads while the caller works on the current one.

The training loop feeds its steps through it (reads of the latent and text caches overlap the step), and a
remote cache (one GET per array and block) keeps several reads in flight with more workers. Items are pulled from
`items` lazily, so an endless stream is fine; what is prepared ahead and never taken is discarded. An exception
raised by prepare reaches the caller when it takes that item.
"""

from __future__ import annotations

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
    pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
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
