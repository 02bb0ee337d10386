"""pdb on a worker, over the control plane: `breakpoint()` and `pdb.set_trace()` in an endpoint pause the rank.

`Debugger.install()` (worker start-up) makes both open a `RelayPdb` whose input and output go to the controller:
each time pdb reads a line the worker sends `DebugPaused` (where it stands, what it printed) and waits for a
`DebugInput`, and `DebugResumed` when the session ends (continue, quit, or the endpoint returned). The
controller's side, and `monarch debug`, are control/handlers/breakpoints.py and debug/console.py.
"""
from __future__ import annotations

import dis
import inspect
import pdb
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

from monarch import config
from monarch.runtime.control import codec
from monarch.runtime.control.commands import DebugInput, DebugPaused, DebugResumed
from monarch.runtime.control.heartbeat import Sender

SKIP = ["monarch.runtime.*", "asyncio.*"]  # pdb never stops in these frames (stepping out of the endpoint)
_SUSPENDS = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
READ_POLL_S = 1.0  # how long a paused rank blocks for its next line before it looks for a Stop again
Locate = Callable[[FrameType], tuple[str, str, str, FrameType | None]]  # actor, endpoint, coords, endpoint frame


class Host(Protocol):
    """What the paused rank needs of the worker it runs in (control/worker.py)."""
    rank: int
    sender: Sender

    def flush(self) -> None: ...

    def take_queued(self, kind: type, timeout: float) -> tuple[list[Any], bool]: ...


class Relay:
    """pdb's stdin and stdout on a worker: output is kept until pdb reads, then sent with the read."""

    def __init__(self, host: Host, actor: str, endpoint: str, coords: str, bottom: FrameType | None) -> None:
        self.host, self.actor, self.endpoint, self.coords = host, actor, endpoint, coords
        self.bottom = bottom  # the endpoint's frame: the session ends when it returns
        self.pdb: RelayPdb | None = None
        self._out: list[str] = []
        self._lines: list[DebugInput] = []
        self.ended = False

    def write(self, text: str) -> int:
        self._out.append(text)
        return len(text)

    def flush(self) -> None:
        """pdb flushes after every prompt; what it wrote goes out with the next read or the end."""

    def readline(self) -> str:
        """Tell the controller that pdb waits here; block until its line comes ("" = EOF, pdb quits, when the
        worker is told to stop meanwhile)."""
        frame = self.pdb.curframe if self.pdb is not None else None
        code = frame.f_code if frame is not None else None
        self._send(DebugPaused(self.actor, self.endpoint, self.host.rank, self.coords, socket.gethostname(),
                               code.co_filename if code else "", code.co_name if code else "",
                               frame.f_lineno if frame is not None else 0, self._take_output()))
        while not self._lines:
            got, stopping = self.host.take_queued(DebugInput, READ_POLL_S)
            self._lines += [m for m in got if m.actor == self.actor]  # others: lines for a session that ended
            if stopping and not self._lines:
                return ""
        msg = self._lines.pop(0)
        if msg.resume and self.pdb is not None:
            self.pdb.clear_all_breaks()
            return "continue\n"
        return msg.line + "\n"

    def end(self) -> None:
        """The session is over: stop tracing and tell the controller (once)."""
        if self.ended:
            return
        self.ended = True
        sys.settrace(None)
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:  # bdb hooked every frame up the stack
            frame.f_trace = None
            frame = frame.f_back
        self._send(DebugResumed(self.actor, self.host.rank, self._take_output()))

    def _take_output(self) -> str:
        text, self._out = "".join(self._out), []
        return text

    def _send(self, msg: Any) -> None:
        self.host.flush()  # what the worker queued before, in order
        self.host.sender.sendall(codec.encode_frame([msg]))


class RelayPdb(pdb.Pdb):
    """pdb reading from and writing to a Relay; its session ends with a continue that leaves no breakpoint
    to stop at, or with quit."""

    def __init__(self, relay: Relay) -> None:
        super().__init__(stdin=relay, stdout=relay, skip=SKIP, nosigint=True, readrc=False)  # type: ignore[arg-type]
        self.relay = relay
        relay.pdb = self

    def set_continue(self) -> None:
        super().set_continue()
        if not self.breaks:
            self.relay.end()

    def set_quit(self) -> None:
        super().set_quit()
        self.relay.end()

    def dispatch_return(self, frame: FrameType, arg: Any) -> Any:
        """After pdb had its say (a `--Return--` stop while stepping), the endpoint's own return ends the
        session, so that stepping on never stops in the next call; an await suspending it does not."""
        traced = super().dispatch_return(frame, arg)
        if frame is self.relay.bottom and not _suspends(frame) and not self.relay.ended:
            self.relay.end()
            return None
        return traced


def _suspends(frame: FrameType) -> bool:
    """Whether a 'return' event of `frame` is a coroutine or generator suspending (await, yield), not ending."""
    code = frame.f_code
    return bool(code.co_flags & _SUSPENDS) and code.co_code[frame.f_lasti] == dis.opmap["YIELD_VALUE"]


class Debugger:
    """The relayed pdb of one worker (`host`): at most one session at a time (one thread runs endpoints).
    `locate` finds the actor whose call runs a frame (actors/hosting.py's calling_actor)."""

    def __init__(self, host: Host, locate: Locate) -> None:
        self.host, self.locate = host, locate
        self.active: Relay | None = None  # the session of this worker, while one is open

    def install(self) -> None:
        """Route breakpoint() and pdb.set_trace() of this worker's actors to the controller."""
        sys.breakpointhook = self.breakpointhook
        pdb.set_trace = self.set_trace

    def pause(self, frame: FrameType, header: str | None = None) -> None:
        """Stop the rank in pdb at `frame`, relayed to the controller."""
        if threading.current_thread() is not threading.main_thread():
            print(f"monarch: skipped a breakpoint in thread {threading.current_thread().name!r} at "
                  f"{frame.f_code.co_filename}:{frame.f_lineno}: only the worker's own thread (its actors' endpoints) "
                  "can pause in pdb", file=sys.stderr, flush=True)
            return
        actor, endpoint, coords, bottom = self.locate(frame)
        active = self.active
        if active is not None and not active.ended:
            if active.bottom is bottom and active.pdb is not None:
                active.pdb.set_trace(frame)  # the call continued with breakpoints left: it stops again
                return
            active.end()  # that of an earlier call, which ended unseen
        relay = self.active = Relay(self.host, actor, endpoint, coords, bottom)
        debugger = RelayPdb(relay)
        if header is not None:
            relay.write(header + "\n")
        debugger.set_trace(frame)

    def breakpointhook(self, *args: Any, **kwargs: Any) -> Any:
        """`sys.breakpointhook` on workers. PYTHONBREAKPOINT keeps its meaning: 0 disables breakpoint(), another
        debugger than pdb is called as Python would (it then reads the worker's stdin, which is not a terminal)."""
        wanted = config.external("PYTHONBREAKPOINT")
        if wanted == "0":
            return None
        if wanted not in ("", "pdb.set_trace"):
            return sys.__breakpointhook__(*args, **kwargs)
        self.pause(sys._getframe(1))
        return None

    def set_trace(self, *, header: str | None = None) -> None:
        """`pdb.set_trace` on workers."""
        self.pause(sys._getframe(1), header)

    def stale_input(self, msg: DebugInput) -> None:
        """A line that came after its session ended (the worker's handler for DebugInput outside a pause)."""
