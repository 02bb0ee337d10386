"""The controller's record of the ranks paused in pdb (`BREAKPOINTS`): who, where, what pdb printed.

Workers report DebugPaused / DebugResumed (the relayed pdb, runtime/debug/relay.py); the controller's handler
table (controller.py) calls `on_paused` and `on_resumed`, on its poller thread. A console (runtime/debug/console.py:
`monarch debug`, `debug_controller()`) sends a paused rank a line and waits for its next pause or its end. A
call that times out behind a paused rank says so (`waiting_note`, used by futures.py).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from monarch.runtime.control import codec
from monarch.runtime.control.commands import DebugInput, DebugPaused, DebugResumed

Key = tuple[int, str, int]  # (proc mesh id, actor name, rank)


class PausedJob(Protocol):
    """The job of a paused rank, as its record reads it (the controller's Job, conn.py)."""

    @property
    def id(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def live(self) -> bool: ...


class RankConn(Protocol):
    """The connection of a paused rank (the controller's Conn, conn.py): its job, and where its lines go."""

    @property
    def mesh(self) -> PausedJob | None: ...

    def send(self, frame: bytes) -> None: ...


@dataclass
class PausedRank:
    """One rank stopped in pdb: where it stands and what it printed since the last line it was sent."""
    mesh: PausedJob  # the controller's record of the rank's job
    conn: RankConn  # the rank's connection, which its lines go to
    at: DebugPaused  # its latest pause: which call, where (the output is gathered below)
    output: str = ""
    waiting: bool = True  # its pdb reads a line now
    ended: bool = False  # its session is over (the rank runs on)
    seen: int = field(default=0)  # events so far (pauses and the end)

    @property
    def actor(self) -> str:
        return self.at.actor

    @property
    def rank(self) -> int:
        return self.at.rank

    @property
    def key(self) -> Key:
        return (self.mesh.id, self.actor, self.rank)

    @property
    def where(self) -> str:
        return f"{os.path.basename(self.at.filename)}:{self.at.lineno}"

    def describe(self) -> str:
        """`debugee.to_debug on rank 1 (dp=0,tp=1) of mesh 'procs', at test_x.py:12`"""
        call = f"{self.actor}.{self.at.endpoint}" if self.actor else "code outside any actor call"
        coords = f" ({self.at.coords})" if self.at.coords else ""
        return f"{call} on rank {self.rank}{coords} of mesh {self.mesh.name!r}, at {self.where}"


class Breakpoints:
    """The paused ranks of this controller, under one condition that every change notifies."""

    def __init__(self) -> None:
        self._ranks: dict[Key, PausedRank] = {}
        self.changed = threading.Condition()

    def paused(self, mesh: PausedJob, conn: RankConn, msg: DebugPaused) -> None:
        with self.changed:
            key = (mesh.id, msg.actor, msg.rank)
            rec = self._ranks.get(key)
            if rec is None:
                rec = PausedRank(mesh, conn, msg)
                if not any(k[:2] == key[:2] for k in self._ranks):  # the first of its actor mesh says so
                    print(f"monarch: breakpoint: {rec.describe()} is paused in pdb (other ranks may follow); attach "
                          f"from another terminal with `monarch debug` (`list`, then `attach {msg.actor} {msg.rank}`)",
                          file=sys.stderr, flush=True)
                self._ranks[key] = rec
            rec.at = msg
            rec.output += msg.output
            rec.waiting = True
            rec.seen += 1
            self.changed.notify_all()

    def resumed(self, mesh: PausedJob, msg: DebugResumed) -> None:
        with self.changed:
            rec = self._ranks.pop((mesh.id, msg.actor, msg.rank), None)
            if rec is not None:
                rec.output += msg.output
                rec.waiting, rec.ended = False, True
                rec.seen += 1
            self.changed.notify_all()

    def take_output(self, rec: PausedRank) -> str:
        """What `rec` printed that no console has shown yet."""
        with self.changed:
            out, rec.output = rec.output, ""
            return out

    def ranks(self) -> list[PausedRank]:
        """The paused ranks of live meshes, by mesh, actor and rank (those of stopped meshes are dropped)."""
        with self.changed:
            for key in [k for k, r in self._ranks.items() if not r.mesh.live]:
                del self._ranks[key]
            return sorted(self._ranks.values(), key=lambda r: (r.mesh.id, r.actor, r.rank))

    def find(self, actor: str | None, rank: int) -> list[PausedRank]:
        """The paused ranks numbered `rank` (of `actor`, when given)."""
        return [r for r in self.ranks() if r.rank == rank and actor in (None, r.actor)]

    def send(self, recs: list[PausedRank], line: str, timeout: float, resume: bool = False) -> list[PausedRank]:
        """Give each rank of `recs` that reads now `line`; wait up to `timeout` for each to pause again or end.
        Returns the ranks that did neither in time (they run the line still)."""
        with self.changed:
            sent = [(r, r.seen) for r in recs if r.waiting and not r.ended]
            for rec, _ in sent:
                rec.waiting, rec.output = False, ""
                try:
                    rec.conn.send(codec.encode_frame([DebugInput(rec.actor, line, resume)]))
                except OSError:
                    rec.ended = True  # its worker is gone; supervision reports that
                    self._ranks.pop(rec.key, None)
            deadline = time.monotonic() + timeout
            while any(r.seen == seen and not r.ended for r, seen in sent):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.changed.wait(left)
            return [r for r, seen in sent if r.seen == seen and not r.ended]

    def wait_for(self, count: int, timeout: float) -> list[PausedRank]:
        """Wait up to `timeout` until at least `count` ranks are paused and reading; the paused ranks."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while len([r for r in self.ranks() if r.waiting]) < count and time.monotonic() < deadline:
                self.changed.wait(max(0.0, min(0.2, deadline - time.monotonic())))
            return self.ranks()

    def waiting_note(self, mesh_id: int, ranks: set[int]) -> str:
        """What a timed-out call on `ranks` of mesh `mesh_id` adds when some of them are paused in pdb."""
        paused = [r for r in self.ranks() if r.mesh.id == mesh_id and r.rank in ranks]
        if not paused:
            return ""
        first = paused[0]
        return (f"; a breakpoint is waiting on rank {', '.join(str(r.rank) for r in paused)} ({first.describe()}"
                f"{', ...' if len(paused) > 1 else ''}): a paused rank runs nothing else until it continues. "
                f"Attach from another terminal with `monarch debug` (`list`, `attach {first.actor} {first.rank}`, "
                "`continue`), or from this process with monarch.actor.debug_controller()")


BREAKPOINTS = Breakpoints()


def on_paused(_ctl: object, conn: RankConn, msg: DebugPaused) -> None:
    """The controller's handler of DebugPaused (conn: the rank's authenticated connection)."""
    assert conn.mesh is not None
    BREAKPOINTS.paused(conn.mesh, conn, msg)


def on_resumed(_ctl: object, conn: RankConn, msg: DebugResumed) -> None:
    assert conn.mesh is not None
    BREAKPOINTS.resumed(conn.mesh, msg)
