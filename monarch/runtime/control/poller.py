"""Event polling for the controller, driven by whichever thread needs it (leader/follower).

A background thread polls while nobody waits, so worker output and failures are handled promptly.
A user thread that waits for a reply takes the poller over and handles events itself: the reply is
read by the thread that needs it, with no hand-off between threads on the hot path.

On a virtual machine an idle CPU's wake-up costs tens of microseconds, so a process that expects a message
within microseconds spins for it (MONARCH_SPIN_US). The waiting controller spins only while fewer replies are
due than the host has cores (with more, its spin would take a core the repliers need), and yields its core on
every turn to a process ready to run there (a worker woken onto it). A worker's frame loop (`AdaptiveSpin`)
stops spinning when its spins keep failing (a slow peer, an oversubscribed host where the spin takes the core
the peer needs), and probes again now and then.
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from contextlib import suppress

from monarch import config

log = logging.getLogger("monarch.controller")
_STEP_ASIDE = 0.005  # seconds the background thread stays off after a user thread took over
CORES = len(os.sched_getaffinity(0))  # the cores this process may run on (a local job's workers share them)


class Poller:
    """An epoll set with read (and, while output is queued, write) handlers per fd and a periodic
    `tick`, polled by one thread at a time."""

    def __init__(self, tick: Callable[[], float]) -> None:
        self._tick = tick  # runs after every poll; returns seconds until it needs to run again
        self._ep = select.epoll()
        self._handlers: dict[int, Callable[[], None]] = {}
        self._writers: dict[int, Callable[[], None]] = {}
        self._io = threading.Lock()
        self._count_lock = threading.Lock()
        self._waiters = 0
        self._bg_polling = False
        self._spin = config.spin_seconds()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK)
        self.watch(self._wake, lambda: _drain(self._wake))
        self._thread = threading.Thread(target=self._background, name="monarch-poller", daemon=True)

    def start(self) -> None:
        """Start the background thread (once whoever `tick` reads is ready)."""
        self._thread.start()

    def watch(self, fd: int, handler: Callable[[], None]) -> None:
        self._handlers[fd] = handler
        self._ep.register(fd, select.EPOLLIN)

    def unwatch(self, fd: int) -> None:
        self._writers.pop(fd, None)
        if self._handlers.pop(fd, None) is not None:
            self._ep.unregister(fd)

    def want_write(self, fd: int, handler: Callable[[], None]) -> None:
        """Call `handler` whenever `fd` can take more output, until `done_writing(fd)`."""
        if fd in self._handlers and fd not in self._writers:
            self._writers[fd] = handler
            self._ep.modify(fd, select.EPOLLIN | select.EPOLLOUT)

    def done_writing(self, fd: int) -> None:
        if self._writers.pop(fd, None) is not None and fd in self._handlers:
            self._ep.modify(fd, select.EPOLLIN)

    def _poll_once(self, limit: float | None, spin: float = 0.0) -> None:
        timeout = self._tick()
        if limit is not None:
            timeout = min(timeout, max(limit, 0.0))
        events = self._ep.poll(0)
        if spin and not events:  # a reply usually comes within microseconds: don't let the CPU idle
            until = time.perf_counter() + spin
            while not events and time.perf_counter() < until:
                os.sched_yield()  # a process ready to run on this core (the one that answers) goes first
                events = self._ep.poll(0)
        for fd, mask in events or self._ep.poll(timeout):
            if mask & select.EPOLLOUT:
                _run(fd, self._writers.get(fd))
            if mask & ~select.EPOLLOUT:
                _run(fd, self._handlers.get(fd))

    def _background(self) -> None:
        while True:
            if self._waiters or not self._io.acquire(blocking=False):
                time.sleep(_STEP_ASIDE)
                continue
            try:
                self._bg_polling = True
                while not self._waiters:
                    self._poll_once(None)
            finally:
                self._bg_polling = False
                self._io.release()

    def drive(self, done: Callable[[], bool], deadline: float | None, expected: Callable[[], int] = lambda: 1) -> None:
        """Poll in the calling thread until `done()` or the deadline passes. Before each sleep it spins while
        fewer replies are `expected()` than this host has cores (the peers that answer can run meanwhile); with
        more, spinning would take a core they need, so it sleeps until they wake it."""
        with self._count_lock:
            self._waiters += 1
        try:
            if self._bg_polling:
                os.eventfd_write(self._wake, 1)
            while not done():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return
                if not self._io.acquire(timeout=0.001):
                    continue  # another thread is polling; our reply may arrive through it
                try:
                    while not done():
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            return
                        self._poll_once(remaining, self._spin if expected() < CORES else 0.0)
                finally:
                    self._io.release()
        finally:
            with self._count_lock:
                self._waiters -= 1


def _run(fd: int, handler: Callable[[], None] | None) -> None:
    if handler is None:
        return
    try:
        handler()
    except Exception:  # noqa: BLE001 - the control plane must survive any one peer
        log.exception("monarch controller: error while handling fd %d", fd)


def _drain(fd: int) -> None:
    with suppress(BlockingIOError):  # already drained by another poll
        os.eventfd_read(fd)


_MISSES_BEFORE_BACKOFF = 3
_PROBE_EVERY = 32


class AdaptiveSpin:
    """Spin budget in seconds: the limit while spins pay off, zero after repeated misses."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self._misses = 0
        self._sleeps = 0

    def budget(self) -> float:
        if self._misses < _MISSES_BEFORE_BACKOFF:
            return self.limit
        self._sleeps += 1
        return self.limit if self._sleeps % _PROBE_EVERY == 0 else 0.0

    def hit(self) -> None:
        self._misses = 0

    def miss(self) -> None:
        self._misses = min(self._misses + 1, _MISSES_BEFORE_BACKOFF)
