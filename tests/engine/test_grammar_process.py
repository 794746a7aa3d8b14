"""A grammar process's step posts: the engine's wakes ahead of a step are told from the steps' posts."""

import threading
import time

import numpy as np
import pytest

from nanoinfer.engine import grammar_process
from nanoinfer.engine.grammar_process import StepPosts, poll


class Engine:
    """The engine's side of one process's posts, as ``_GrammarProcess.post_step`` and ``wake`` make
    them, with ``threading`` primitives."""

    def __init__(self):
        self.work = threading.Semaphore(0)
        self.posted = np.zeros(2, dtype=np.int64)
        self.closed = threading.Event()

    def post_step(self) -> None:
        self.posted[1] += 1
        self.work.release()

    def wake(self) -> None:
        self.work.release()

    def pending_posts(self) -> int:
        """How many posts are not taken yet (taking them)."""
        count = 0
        while self.work.acquire(blocking=False):
            count += 1
        return count


class Served:
    """Runs ``StepPosts.next_step`` on a thread and counts the steps it returns."""

    def __init__(self, engine: Engine):
        self.steps = StepPosts(engine.work, engine.posted, 1, engine.closed)
        self.count = 0
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.steps.next_step():
            with self.changed:
                self.count += 1
                self.changed.notify_all()

    def wait_for(self, count: int, timeout: float = 5.0) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.count >= count, timeout), (self.count, count)

    def stays_at(self, count: int, seconds: float) -> bool:
        time.sleep(seconds)
        return self.count == count


@pytest.fixture
def engine():
    engine = Engine()
    yield engine
    engine.closed.set()
    engine.wake()


def test_each_step_is_served_once_whatever_the_wakes_around_it(engine, monkeypatch):
    """A wake before a step's post, one after it (both taken before the process looks: it serves the
    step once, then polls on the post left over and sleeps), and a wake that no step follows: every step
    is served exactly once, and no post is left behind to be taken as a step later."""
    monkeypatch.setattr(grammar_process, "POLL_S", 0.002)
    served = Served(engine)
    engine.post_step()  # a step alone
    served.wait_for(1)
    engine.wake()  # the process polls for the step ...
    time.sleep(0.0005)
    engine.post_step()  # ... which comes within the poll
    served.wait_for(2)
    assert served.stays_at(2, 0.01)
    engine.wake()  # a wake that no step follows: the process polls, then sleeps
    assert served.stays_at(2, 0.02)
    engine.post_step()
    served.wait_for(3)
    for i in range(50):  # the engine's pattern: a wake, then the step, whose answers it waits for
        engine.wake()
        if i % 2:
            time.sleep(0.0002)
        engine.post_step()
        served.wait_for(4 + i)
    assert served.stays_at(53, 0.02)
    engine.post_step()
    served.wait_for(54)
    assert served.stays_at(54, 0.02)
    # The posts of steps served with the wake before them were taken by the polls.
    assert engine.pending_posts() == 0


def test_a_step_posted_while_the_process_served_the_one_before_is_not_lost(engine, monkeypatch):
    """A wake and a step posted together before the process takes either: served at the first post;
    the second post is taken by a poll that finds no new step."""
    monkeypatch.setattr(grammar_process, "POLL_S", 0.002)
    engine.wake()
    engine.post_step()
    served = Served(engine)
    served.wait_for(1)
    assert served.stays_at(1, 0.02)
    assert engine.pending_posts() == 0
    engine.post_step()
    served.wait_for(2)


def test_closing_ends_the_loop_while_it_sleeps_or_polls(engine, monkeypatch):
    monkeypatch.setattr(grammar_process, "POLL_S", 1.0)
    served = Served(engine)
    engine.wake()  # polling, for up to a second
    time.sleep(0.01)
    engine.closed.set()
    engine.wake()
    served.thread.join(timeout=0.5)
    assert not served.thread.is_alive() and served.count == 0


def test_poll_gives_up_after_its_time_and_takes_a_post_at_once():
    semaphore = threading.Semaphore(0)
    started = time.perf_counter()
    assert not poll(semaphore, 0.005)
    assert time.perf_counter() - started >= 0.005
    semaphore.release()
    assert poll(semaphore, 10.0)
