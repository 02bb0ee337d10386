"""`python -m monarch` (also the `monarch` command): look into a running controller, write Kubernetes manifests,
run an attach-mode worker agent.

  monarch query "SELECT ..."      run SQL over its telemetry and print a table (--timeout S: cancelled after S s)
  monarch top [--once]            a live view: hosts, procs and actors, message rates, busy time,
                                  memory, the latest failures, and a SQL prompt (runtime/telemetry/top.py)
  monarch debug [--pid P]         the debugger of ranks paused at breakpoint(): list, attach <actor> <rank>,
                                  cast <actor> ranks(...) <pdb command>, continue (runtime/debug/console.py)
All three attach to the newest controller of this user on this machine (or `--pid`), see runtime/debug/admin.py.

  monarch k8s manifest --name N --replicas R --image I [--gpus G] [--port P] [--namespace NS]
                       [--secret-name S] [--create-secret] [--python PY] [--addresses]
                                  print YAML for `kubectl apply -f -`: a headless Service and a StatefulSet
                                  of attach-mode workers (cluster/k8s.py); on stderr the addresses to pass
                                  to attach_to_workers (`--addresses`: only those, on stdout)

  monarch worker [--listen tcp://HOST:PORT] [--secret-file F]
                                  wait for controllers (attach_to_workers) and start their ranks here
                                  (cluster/agent.py); the secret: F, else MONARCH_ATTACH_SECRET, else the
                                  file MONARCH_ATTACH_SECRET_FILE
"""
from __future__ import annotations

import argparse
import logging
import sys
from functools import partial

from rich.console import Console

from monarch.cluster import k8s
from monarch.errors import MonarchError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="monarch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("query", help="run SQL over a controller's telemetry")
    q.add_argument("sql")
    q.add_argument("--timeout", type=float, default=30.0, help="seconds the query may run before the controller "
                   "cancels it (default 30; its MONARCH_QUERY_TIMEOUT caps this)")
    t = sub.add_parser("top", help="a live view of a controller's meshes")
    t.add_argument("--once", action="store_true", help="print one screen and exit")
    t.add_argument("--interval", type=float, default=1.0)
    d = sub.add_parser("debug", help="attach to the ranks paused at a breakpoint (pdb over the control plane)")
    for s in (q, t, d):
        s.add_argument("--pid", type=int, help="the controller's pid (default: the newest)")
    _add_k8s(sub)
    _add_worker(sub)
    a = p.parse_args(argv)
    if a.cmd == "k8s":
        return _k8s(a)
    if a.cmd == "worker":
        return _worker(a)
    if a.cmd == "debug":
        return _debug(a.pid)
    from monarch.runtime.debug import admin
    from monarch.runtime.telemetry import top
    query = partial(admin.query, pid=a.pid)
    try:
        if a.cmd == "query":
            answer = top.run(query, a.sql, a.timeout)
            Console().print(top.table(answer.columns, answer.rows))
            if answer.late:
                print(f"monarch: no events yet from {', '.join(answer.late)} (busy?)", file=sys.stderr)
        elif a.once:
            Console().print(top.screen(query))
        else:
            top.Top(query, f"controller {a.pid}" if a.pid else "newest controller", a.interval).run()
    except (RuntimeError, ConnectionError) as e:
        print(f"monarch: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


def _debug(pid: int | None) -> int:
    """Relay lines between this terminal and the controller's `monarch_dbg>` console, until quit or EOF."""
    from monarch.runtime.debug import admin
    try:
        sock, answer = admin.open_console(pid)
    except (OSError, ValueError) as e:
        print(f"monarch: {e}", file=sys.stderr)
        return 1
    with sock:
        while True:
            print(answer.get("output", ""), end="", flush=True)
            if answer.get("done"):
                return 0
            try:
                line = input(answer.get("prompt", ""))
            except EOFError:
                line = "quit" if answer.get("prompt") else "detach"
            except KeyboardInterrupt:
                print()
                return 0
            try:
                admin.send_json(sock, {"line": line})
                answer = admin.recv_json(sock)
            except (OSError, ValueError) as e:
                print(f"monarch: the controller closed the debugger: {e}", file=sys.stderr)
                return 1


def _add_k8s(sub: argparse._SubParsersAction) -> None:
    """`monarch k8s manifest ...`: the arguments of monarch.cluster.k8s.manifest."""
    k = sub.add_parser("k8s", help="Kubernetes manifests for attach-mode workers")
    m = k.add_subparsers(dest="k8s_cmd", required=True).add_parser(
        "manifest", help="print a headless Service and a StatefulSet of attach-mode workers as YAML",
        description=k8s.NETWORK_NOTE, formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("--name", required=True, help="names the Service, the StatefulSet and (with an index) the pods")
    m.add_argument("--replicas", type=int, required=True, help="worker pods")
    m.add_argument("--image", required=True, help="a container image with monarch installed")
    m.add_argument("--gpus", type=int, default=0, help="GPUs per pod (nvidia.com/gpu limit; default 0)")
    m.add_argument("--port", type=int, default=k8s.DEFAULT_PORT, help=f"the agent's port (default {k8s.DEFAULT_PORT})")
    m.add_argument("--namespace", default="default")
    m.add_argument("--secret-name", help="the Secret holding the shared secret under key 'secret' "
                   "(default: NAME-attach)")
    m.add_argument("--create-secret", action="store_true", help="also emit that Secret, with a new random secret")
    m.add_argument("--python", default="python", help="the interpreter in the image (default: python)")
    m.add_argument("--addresses", action="store_true", help="print only the workers' addresses, one a line")


def _k8s(a: argparse.Namespace) -> int:
    try:
        docs = k8s.manifest(a.name, a.replicas, a.image, a.gpus, a.port, a.namespace, a.secret_name,
                            create_secret=a.create_secret, python=a.python)
    except MonarchError as e:
        print(f"monarch: {e}", file=sys.stderr)
        return 2
    addresses = k8s.worker_addresses(a.name, a.replicas, a.namespace, a.port)
    if a.addresses:
        print("\n".join(addresses))
        return 0
    print(k8s.to_yaml(docs), end="")
    secret, ns = a.secret_name or k8s.default_secret_name(a.name), a.namespace
    if a.create_secret:
        print(f"monarch: the controller's secret: kubectl -n {ns} get secret {secret} -o jsonpath="
              f"'{{.data.{k8s.SECRET_KEY}}}' | base64 -d", file=sys.stderr)
    else:
        print(f"monarch: the pods need the Secret {secret!r}: kubectl -n {ns} create secret generic {secret} "
              f"--from-literal={k8s.SECRET_KEY}=\"$MONARCH_ATTACH_SECRET\"", file=sys.stderr)
    print(f"monarch: attach with workers={addresses!r}", file=sys.stderr)
    return 0


def _add_worker(sub: argparse._SubParsersAction) -> None:
    """`monarch worker ...`: the arguments of monarch.cluster.agent.run_worker_loop_forever."""
    w = sub.add_parser("worker", help="an attach-mode agent: wait for controllers and start their ranks here")
    w.add_argument("--listen", default=f"tcp://0.0.0.0:{k8s.DEFAULT_PORT}",
                   help=f"tcp://HOST:PORT to listen on (default tcp://0.0.0.0:{k8s.DEFAULT_PORT}; port 0 picks one)")
    w.add_argument("--secret-file", help="a file holding the shared secret (default: MONARCH_ATTACH_SECRET, "
                   "else the file MONARCH_ATTACH_SECRET_FILE)")


def _worker(a: argparse.Namespace) -> int:
    from monarch.cluster import agent, wire
    logging.basicConfig(level=logging.INFO, format="monarch worker: %(message)s", stream=sys.stderr)
    try:
        agent.run_worker_loop_forever(a.listen, wire.read_secret_file(a.secret_file) if a.secret_file else None)
    except MonarchError as e:
        print(f"monarch worker: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
