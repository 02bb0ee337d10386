"""Partitioning: a TracedGraph becomes one RankProgram per mesh point, with frees after last uses.

Every node's emitter writes its instructions for each mesh coordinate (most ops emit one shared
instruction for all ranks). A buffer that no MeshTensor holds any more is freed right after the last
node that reads it; with a `free_batch` budget, small dead buffers wait to be freed together (one
instruction for many ops of a chain) until their bytes reach the budget.
"""
from __future__ import annotations

import itertools

import networkx as nx
import torch.fx as fx

from monarch.graph.rules.table import Emit, op_name
from monarch.graph.trace import TracedGraph, redistribute
from monarch.program.instr import Free, Instr, Local
from monarch.program.program import RankProgram

FREE_BATCH = 1 << 20  # an eager flush's budget: small dead buffers are freed together, up to this many bytes


def partition(traced: TracedGraph, free_batch: int = 0) -> tuple[RankProgram, ...]:
    """One program per mesh point; dead buffers are freed once `free_batch` bytes of them (global sizes)
    have died since the last free, and at the end (0: each right after its last reader)."""
    coords = list(traced.mesh.coords())
    programs: list[list[Instr]] = [[] for _ in coords]
    dead = dead_after(traced)
    base = 0  # temporaries get negative ids, unique in the program and the same on every rank
    held: list[int] = []  # dead buffers not freed yet, and their bytes
    held_bytes = 0
    for node in traced.graph.nodes:
        emit = node.meta.get("emit")
        if emit is Emit.default:
            shared = Local(op_name(node.target), node.meta["local_args"], node.meta["local_kwargs"], node.meta["ids"])
            for prog in programs:
                prog.append(shared)
        elif emit is not None:
            used = 0
            for prog, c in zip(programs, coords, strict=True):
                instrs, n = _emit(node, c, base)
                prog.extend(instrs)
                used = max(used, n)
            base += used
        dying = dead.get(node)
        if dying:
            held += dying[0]
            held_bytes += dying[1]
            if held_bytes >= free_batch:
                _append_all(programs, Free(tuple(held)))
                held, held_bytes = [], 0
    if held:
        _append_all(programs, Free(tuple(held)))
    produced, read = _produced(traced), _read(traced)
    unused = tuple(i for i in traced.released if i not in produced and i not in read)
    head = [Free(unused)] if unused else []
    return tuple(RankProgram(c, tuple(head + p)) for c, p in zip(coords, programs, strict=True))


def _append_all(programs: list[list[Instr]], ins: Instr) -> None:
    for prog in programs:
        prog.append(ins)


def _emit(node: fx.Node, coords: tuple[int, ...], base: int) -> tuple[list[Instr], int]:
    """One rank's instructions for a node, its temporaries numbered from -(base + 1) down, freed at
    the end; and how many temporaries it used."""
    temps = itertools.count(base + 1)
    m = node.meta
    ctx = Emit(m["call"], m["in_specs"], m["specs"], coords, m["local_args"], m["local_kwargs"], m["ids"],
               lambda: -next(temps), m.get("seed", 0))
    instrs = list(m["emit"](ctx))
    used = sorted({i for ins in instrs for i in _outs(ins) if i < 0}, reverse=True)
    if not used:
        return instrs, 0
    return instrs + [Free(tuple(used))], -used[-1] - base


def _outs(ins: Instr) -> tuple[int, ...]:
    return ins.outs if isinstance(ins, Local) else (ins.out,) if hasattr(ins, "out") else ()


def outline(traced: TracedGraph) -> str:
    """The graph as a DAG (networkx): how many nodes, its longest dependency chain and how many
    redistributions sit on it (they cannot overlap anything), and its widest level."""
    g = nx.DiGraph()
    for node in traced.graph.nodes:
        if node.op != "placeholder":
            g.add_node(node)
            g.add_edges_from((src, node) for src in node.all_input_nodes if src.op != "placeholder")
    if not g:
        return "no ops"
    chain = nx.dag_longest_path(g)
    moves = sum(1 for n in chain if n.target is redistribute)
    widest = max(len(level) for level in nx.topological_generations(g))
    return (f"{g.number_of_nodes()} ops; longest chain {len(chain)} ops with {moves} redistributions; "
            f"widest level {widest} ops")


def dead_after(traced: TracedGraph) -> dict[fx.Node, tuple[list[int], int]]:
    """For each node, the buffers that die once it has run (no later reader, no MeshTensor holding them),
    and their bytes (global sizes).

    fx keeps nodes in a topological order and each node's readers in `users`, so the last reader of a
    buffer is its user with the highest position.
    """
    order = {n: i for i, n in enumerate(traced.graph.nodes)}
    released = set(traced.released)
    dead: dict[fx.Node, tuple[list[int], int]] = {}
    for node in traced.graph.nodes:
        ids = node.meta.get("ids", ())
        mortal = [k for k, i in enumerate(ids) if i not in traced.live and (node.op != "placeholder" or i in released)]
        if not mortal or (node.op == "placeholder" and not node.users):
            continue
        last = max(node.users, key=order.__getitem__) if node.users else node
        specs = node.meta["specs"]
        had, nbytes = dead.get(last, ([], 0))
        dead[last] = (had + [ids[k] for k in mortal], nbytes + sum(specs[k].nbytes for k in mortal))
    return dead


def _produced(traced: TracedGraph) -> set[int]:
    return {i for n in traced.graph.nodes if n.op != "placeholder" for i in n.meta.get("ids", ())}


def _read(traced: TracedGraph) -> set[int]:
    return {n.meta["ids"][0] for n in traced.graph.nodes if n.op == "placeholder"}
