"""The main thread's waits in `up`/`down` (podagent/launch/interrupts.py): sleeps between short
looks, never threading's Condition.wait, so that a signal's KeyboardInterrupt can end them at
any moment without leaving a lock that another thread then fails to release."""

from __future__ import annotations

import concurrent.futures
import queue
import signal
import threading
import time

import pytest

from podagent.launch import interrupts


def test_wait_until_says_whether_it_came_before_the_timeout():
    flag = threading.Event()
    threading.Timer(0.1, flag.set).start()
    assert interrupts.wait_until(flag.is_set, timeout=10.0)
    assert not interrupts.wait_until(lambda: False, timeout=0.1)


def test_results_and_failures_come_back_in_the_order_they_finish():
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        slow = pool.submit(time.sleep, 0.3)
        fast = pool.submit(lambda: "fast")
        broken = pool.submit(lambda: 1 / 0)
        order = list(interrupts.as_completed([slow, fast, broken]))
        assert order[-1] is slow and set(order) == {slow, fast, broken}
        assert interrupts.result(fast) == "fast"
        with pytest.raises(ZeroDivisionError):
            interrupts.result(broken)


def test_next_item_is_the_queues_next_or_empty_after_the_timeout():
    items: queue.Queue[int] = queue.Queue()
    threading.Timer(0.1, items.put, (7,)).start()
    assert interrupts.next_item(items, 10.0) == 7
    with pytest.raises(queue.Empty):
        interrupts.next_item(items, 0.1)


def test_interrupts_while_waiting_leave_the_waited_for_threads_unharmed():
    """Ctrl-C after Ctrl-C while the main thread waits for creates that go on finishing: each
    wait ends with KeyboardInterrupt, and the pool's threads, which notify every waiter when a
    result is set, never fail ("release unlocked lock" was seen in `up`). The interrupts come
    from a timer signal (no thread of the test's own waits in the main thread)."""
    failures: list[BaseException] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: failures.append(args.exc_value)

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    interrupted = 0
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for round_ in range(40):
                calls = [pool.submit(time.sleep, 0.001 * (i + round_ % 5)) for i in range(4)]
                signal.setitimer(signal.ITIMER_REAL, 0.0005 + 0.001 * (round_ % 7))
                try:
                    for call in interrupts.as_completed(calls):
                        interrupts.result(call)
                    interrupts.wait_until(lambda: False, timeout=5.0)  # the signal comes here
                except KeyboardInterrupt:
                    interrupted += 1
                for call in calls:  # the futures themselves are unharmed
                    assert interrupts.result(call) is None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        threading.excepthook = hook
    assert interrupted == 40
    assert failures == []
