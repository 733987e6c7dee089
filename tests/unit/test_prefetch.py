"""The bounded background prefetch the training feed runs on (tuneline.stages.common.prefetch.ahead)."""

from __future__ import annotations

import random
import threading
import time

import pytest

from tuneline.stages.common.prefetch import ahead


def _slow_square(x: int) -> tuple[int, str]:
    time.sleep(random.random() / 500)  # items finish out of order across threads
    return x * x, threading.current_thread().name


@pytest.mark.parametrize("workers,depth", [(1, 1), (1, 3), (3, 5)])
def test_items_come_back_in_order_prepared_off_the_calling_thread(workers, depth):
    got = list(ahead(range(40), _slow_square, workers=workers, depth=depth, name="feed-test"))
    assert [v for v, _ in got] == [x * x for x in range(40)]
    assert all(name.startswith("feed-test") for _, name in got)


def test_an_endless_stream_is_read_only_depth_items_ahead():
    pulled = []

    def endless():
        i = 0
        while True:
            pulled.append(i)
            yield i
            i += 1

    it = ahead(endless(), lambda x: x, depth=3)
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    assert len(pulled) <= 5 + 3
    it.close()


def test_an_error_reaches_the_caller_at_its_item_and_closing_leaves_no_thread():
    def prepare(x: int) -> int:
        if x == 2:
            raise ValueError("block 2 is damaged")
        return x

    before = {t.name for t in threading.enumerate()}
    it = ahead(range(10), prepare, workers=2, depth=4, name="feed-err")
    assert [next(it), next(it)] == [0, 1]
    with pytest.raises(ValueError, match="block 2 is damaged"):
        next(it)
    it = ahead(range(10), prepare, name="feed-close")
    next(it)
    it.close()
    left = {t.name for t in threading.enumerate()} - before
    assert not [n for n in left if n.startswith(("feed-err", "feed-close"))]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="workers >= 1"):
        next(ahead([1], lambda x: x, workers=0))


def test_workers_run_torch_on_their_own_thread_and_leave_the_process_count_alone():
    """A worker at the process's intra-op count starts an OpenMP team of its own beside the caller's; once the teams
    outnumber the cores every parallel op of the step sleeps and wakes at its barriers (stages/common/prefetch.py)."""
    import torch

    def count_in_new_thread() -> int:
        got = []
        t = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
        t.start()
        t.join()
        return got[0]

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the caller's count as a run with train.threads_per_process: 2 has it
    try:
        it = ahead(range(3), lambda _: torch.get_num_threads(), workers=2, depth=2)
        assert list(it) == [1, 1, 1]
        assert torch.get_num_threads() == 2
        assert count_in_new_thread() == 2  # per thread: what a thread started later takes is unchanged
    finally:
        torch.set_num_threads(before)
