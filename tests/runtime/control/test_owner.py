"""Workers die with their controller also when it dies unreaped: a zombie controller (killed, its parent
not waiting for it yet) still has a pid that kill(pid, 0) finds, so the monitors look at its state. Busy
workers and workers that print all the time are gone within seconds.
"""
from __future__ import annotations

import time

import pytest
from processes import owned_processes, run_script

T = 30.0
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("work", ["time.sleep(60)", "while True: print('tick', flush=True); time.sleep(0.01)"],
                         ids=["busy", "chatty"])
def test_workers_die_with_a_zombie_controller(work: str) -> None:
    child = run_script(f"""
        import time
        from monarch.actor import Actor, endpoint, this_host

        class Busy(Actor):
            @endpoint
            def work(self) -> None:
                {work}

        procs = this_host().spawn_procs(per_host={{"gpus": 2}})
        procs.spawn("busy", Busy).work.broadcast()
        print("up", flush=True)
        time.sleep(60)
    """)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        time.sleep(0.5)
        assert owned_processes(child.pid)
        child.kill()  # and not reaped: the controller stays a zombie while the workers are watched
        deadline = time.monotonic() + 4
        while owned_processes(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not owned_processes(child.pid), owned_processes(child.pid)
    finally:
        child.kill()
        child.wait(timeout=T)
