"""The large-buffer pool that round results come from (peerd/codecs/hostmem.py): reused only when no tensor or view
of a buffer is alive, so a result a caller still holds is never overwritten by a later round."""

from __future__ import annotations

import threading
import time

import torch

from peerd.codecs import hostmem

BIG = hostmem.HUGE_FROM_BYTES // 4 + 1_000  # float32 values: just above the pooled size


def test_a_buffer_comes_back_only_when_nothing_uses_it() -> None:
    pool = hostmem.Recycler(keep=2)
    first = pool.empty(BIG, torch.float32)
    first.fill_(1.0)
    view = first[10:20]  # a slice, as a round hands out its parts
    del first
    assert pool.in_use() == 1
    second = pool.empty(BIG, torch.float32)
    second.fill_(2.0)
    assert bool((view == 1.0).all()), "a buffer with a live view was handed out again"
    first_ptr, second_ptr = view.data_ptr() - 10 * 4, second.data_ptr()
    assert second_ptr != first_ptr
    del view
    assert pool.in_use() == 1
    third = pool.empty(BIG - 5, torch.float32)  # the first buffer, now free
    assert third.data_ptr() == first_ptr and third.numel() == BIG - 5 and third.dtype == torch.float32


def test_the_pool_reuses_the_same_memory_round_after_round() -> None:
    pool = hostmem.Recycler(keep=2)
    ptrs = set()
    for _ in range(5):
        t = pool.empty(BIG, torch.float32)
        t.fill_(3.0)
        ptrs.add(t.data_ptr())
        del t
    assert len(ptrs) == 1


def test_when_every_kept_buffer_is_held_a_fresh_one_is_made() -> None:
    pool = hostmem.Recycler(keep=1)
    held = pool.empty(BIG, torch.float32)
    held.fill_(4.0)
    extra = pool.empty(BIG, torch.float32)
    extra.fill_(5.0)
    assert bool((held == 4.0).all()) and extra.data_ptr() != held.data_ptr()
    assert len(pool._buffers) == 1 and pool.in_use() == 1


def test_small_and_tightest_fit_requests() -> None:
    pool = hostmem.Recycler(keep=3)
    small = pool.empty(1_000, torch.float32)
    assert small.numel() == 1_000 and not pool._buffers  # below the huge-page size: plain torch.empty
    big = pool.empty(2 * BIG, torch.float32)
    little = pool.empty(BIG, torch.float32)
    big_ptr, little_ptr = big.data_ptr(), little.data_ptr()
    del big, little
    assert pool.empty(BIG, torch.float32).data_ptr() == little_ptr  # not the larger buffer
    assert pool.empty(4 * BIG, torch.uint8).data_ptr() == little_ptr  # any dtype: the pool holds bytes
    assert pool.empty(2 * BIG, torch.float32).data_ptr() == big_ptr


def test_the_pool_stays_within_its_bytes_and_makes_room_for_a_new_size() -> None:
    """Sizes change (Streaming's fragments): free buffers too small for a request are dropped to make room, and a
    request past max_bytes is an ordinary buffer, so the pool never holds more than max_bytes."""
    big = 4 * BIG * 4  # bytes of a 4 * BIG float32 request
    pool = hostmem.Recycler(keep=2, max_bytes=big)
    a, b = pool.empty(BIG, torch.float32), pool.empty(BIG, torch.float32)
    assert pool.kept_bytes() == 2 * BIG * 4
    del a, b
    large = pool.empty(4 * BIG, torch.float32)  # no free buffer fits: both small ones go, one large one is kept
    assert pool.kept_bytes() == big and pool.in_use() == 1
    held = pool.empty(BIG, torch.float32)  # the large one is in use and the cap is reached: a fresh buffer
    assert pool.kept_bytes() == big and held.data_ptr() != large.data_ptr()
    del large
    too_big = pool.empty(5 * BIG, torch.float32)  # past max_bytes alone: never kept, the free one stays
    assert too_big.numel() == 5 * BIG and pool.kept_bytes() == big and pool.in_use() == 0


def test_threads_never_share_a_live_buffer() -> None:
    """Rounds allocate from executor threads and the event loop at once: a buffer handed to one thread is never handed
    to another while the first still holds it, however many threads ask (keep=2 forces fresh ones too)."""
    pool = hostmem.Recycler(keep=2)
    errors: list[str] = []

    def work(me: int) -> None:
        for _ in range(12):
            t = pool.empty(BIG, torch.float32)
            t.fill_(float(me))
            time.sleep(0.001)
            if not bool((t == float(me)).all()):
                errors.append(f"thread {me}: its buffer was written by another thread")
            del t

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert pool.in_use() == 0 and len(pool._buffers) <= 2
