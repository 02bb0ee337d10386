"""torch's OpInfo samples for every op monarch claims, sharded on a real 4-process mesh vs plain torch.

An OpInfo is claimed when every aten op its samples dispatch (on tensors) has a sharding rule, a
decomposition, or a rewrite of its data-dependent shape into such ops. Everything runs under
MONARCH_STRICT=1; each sample runs with its tensors replicated, then sharded on their largest dims (two
mesh-dim orders); outputs must match plain torch on the controller, with no wrong value anywhere. Ops
in `opinfo_passing.txt` must keep passing, at least MIN_PASSING pass; what is missing is reported by
family. MONARCH_OPINFO_REPORT=path also writes the full table to that file;
MONARCH_OPINFO_OPS=regex runs only the OpInfos whose names match (the floors are then not checked).
"""
from __future__ import annotations

import os
import re
import textwrap
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import monarch
from monarch.errors import MonarchError, SupervisionError, UnsupportedOpError
from monarch.graph.decompose import decomposition
from monarch.graph.rules.table import RULES
from monarch.runtime.control.futures import Future
from monarch.tensor import data_dependent
from monarch.tensor.meshtensor import MeshTensor
from monarch.tensor.placement import Placement, R, Shard

pytestmark = pytest.mark.timeout(600)  # one module fixture runs every OpInfo (about 90 s on 2 cores)
PASSING = Path(__file__).with_name("opinfo_passing.txt")
MAX_SAMPLES = 4          # samples per op (the first usable ones)
TIMEOUT = 20.0           # seconds for any one fetch
WARMUP = 180.0           # seconds for the first one (the workers load torch)
MIN_CLAIMED = 600        # sanity floor on the number of claimed OpInfos (289 when written, 608 now)
MIN_PASSING = 600        # strict mode: OpInfos passing every sample (288 before decompositions, 440 after, 608 now)
FAMILIES = (("linalg", ("linalg", "cholesky", "_lu", "lu_", "svd", "qr", "eig", "triangular", "inverse", "det")),
            ("fft", ("fft",)), ("conv and pooling", ("conv", "pool", "upsample", "im2col", "col2im", "pad")),
            ("sort and scan", ("sort", "topk", "kthvalue", "median", "cum", "mode", "unique", "searchsorted")),
            ("scatter and index", ("scatter", "index", "put", "take", "masked_", "nonzero", "gather")),
            ("view", ("view", "squeeze", "unfold", "strided", "flip", "roll", "diagonal", "split", "unbind")))
DTYPES = (torch.float32, torch.int64, torch.bool)  # the first one an op supports on CPU is sampled
IGNORED = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default}


@dataclass
class Outcome:
    """What happened to one OpInfo: status pass / fail / skip, the reason or first error, sample counts."""
    name: str
    status: str = "pass"
    detail: str = ""
    samples: int = 0
    passed: int = 0
    missing: tuple[str, ...] = ()  # aten ops without a rule

    @property
    def claimed(self) -> bool:
        return self.status != "skip"

    def fail(self, where: str, e: BaseException | str) -> None:
        if self.status != "fail":
            msg = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
            self.status, self.detail = "fail", f"{where}: " + " | ".join(msg.split("\n"))[:240]


@dataclass
class Case:
    """One sample of one op, with its plain-torch result and the aten ops it dispatched."""
    input: Any
    args: tuple
    kwargs: dict
    expected: Any
    funcs: set[torch._ops.OpOverload] = field(default_factory=set)


class Recorder(TorchDispatchMode):
    """Collects every aten op that receives at least one tensor argument."""

    def __init__(self) -> None:
        super().__init__()
        self.funcs: set[torch._ops.OpOverload] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(isinstance(a, torch.Tensor) for a in tree_flatten((args, kwargs))[0]):
            self.funcs.add(func)
        return func(*args, **(kwargs or {}))


def opinfo_name(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def tensors_of(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def sample_dtype(op: Any) -> torch.dtype | None:
    supported = op.supported_dtypes("cpu")
    return next((d for d in DTYPES if d in supported), None)


def why_unusable(sample: Any) -> str:
    """Why a sample cannot be distributed ('' when it can)."""
    inputs = tensors_of((sample.input, sample.args, sample.kwargs))
    inp = sample.input
    listed = isinstance(inp, (list, tuple)) and len(inp) > 0 and all(isinstance(t, torch.Tensor) for t in inp)
    if not isinstance(inp, torch.Tensor) and not listed:
        return "input is not a tensor or a list of tensors"
    if any(t.is_complex() for t in inputs):
        return "complex input"
    if any(t.device.type != "cpu" or t.layout != torch.strided for t in inputs):
        return "non-strided or non-cpu input"
    return ""


def copy_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`obj` with fn(t) for each tensor t, once per tensor object (so arguments that alias stay aliased)."""
    done: dict[int, Any] = {}

    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and id(x) not in done:
            done[id(x)] = fn(x)
        return done[id(x)] if isinstance(x, torch.Tensor) else x
    return tree_map(one, obj)


def run_plain(op: Any, sample: Any) -> Case:
    """Run on copies (an in-place op must not change the sample before the sharded run)."""
    inp, args, kwargs = copy_tensors((sample.input, tuple(sample.args), dict(sample.kwargs)), torch.clone)
    rec = Recorder()
    with rec:
        expected = op(inp, *args, **kwargs)
    return Case(sample.input, tuple(sample.args), dict(sample.kwargs), expected, rec.funcs)


def cases_of(op: Any, out: Outcome) -> list[Case]:
    """The first usable samples of `op` with their plain results; marks `out` skipped when none is usable."""
    dtype = sample_dtype(op)
    if dtype is None or "empty" in op.name:
        out.status, out.detail = "skip", "no float32/int64/bool on cpu" if dtype is None else "uninitialised output"
        return []
    cases, reasons = [], []
    try:
        torch.manual_seed(0)
        for sample in op.sample_inputs_func(op, "cpu", dtype, False):  # not sample_inputs: it walks the stack
            reason = why_unusable(sample)
            if not reason:
                cases.append(run_plain(op, sample))
                reason = "complex output" if any(t.is_complex() for t in tensors_of(cases[-1].expected)) else ""
                if reason:
                    cases.pop()
            reasons.append(reason)
            if len(cases) == MAX_SAMPLES:
                break
    except Exception as e:  # noqa: BLE001 - plain torch cannot run it here (e.g. a GPU-only op)
        out.status, out.detail = "skip", f"plain torch: {type(e).__name__}: {str(e)[:80]}"
        return []
    if not cases:
        out.status, out.detail = "skip", f"no usable sample ({next((r for r in reasons if r), 'none')})"
    return cases


def unclaimed(cases: list[Case], out: Outcome) -> bool:
    """True (and `out` marked skipped) when some dispatched aten op has no rule or is random. An op that
    dispatches none (conj, contiguous, item of a real tensor) is claimed: it must hand the MeshTensor back.
    So is one rewritten into ops of known shapes after reading a few values (nonzero, unique, equal)."""
    funcs = set().union(*(c.funcs for c in cases)) - IGNORED
    random = sorted(str(f) for f in funcs if torch.Tag.nondeterministic_seeded in f.tags)
    missing = sorted(str(f.name()) for f in funcs if not covered(f))
    if random or missing:
        out.status, out.missing = "skip", () if random else tuple(missing)
        out.detail = "random: " + ", ".join(random) if random else "no rule: " + ", ".join(missing)
        return True
    return False


def covered(f: torch._ops.OpOverload) -> bool:
    """`f` has a sharding rule, a decomposition, or a rewrite of its data-dependent shape (tensor/data_dependent.py)."""
    return f in RULES or decomposition(f) is not None or data_dependent.rewrites(f)


def largest_dims(t: torch.Tensor, n: int) -> list[Placement]:
    """Shard(d) for the n largest dims of size >= 2 (the largest again when fewer exist); R for none."""
    big = sorted((d for d in range(t.ndim) if t.shape[d] >= 2), key=lambda d: (-t.shape[d], d))
    return [Shard(big[i] if i < len(big) else big[0]) if big else R for i in range(n)]


LAYOUTS: dict[str, Callable[[torch.Tensor, int], list[Placement]]] = {
    "replicated": lambda t, n: [R] * n,
    "sharded": largest_dims,                                  # largest dim on the first mesh dim
    "swapped": lambda t, n: largest_dims(t, n)[::-1],         # largest dim on the last mesh dim
}


def distribute(case: Case, mesh: Any, layout: str) -> tuple[Any, tuple, dict]:
    """The sample's arguments with each tensor distributed over `mesh` as `layout` places it."""
    n = len(mesh.sizes)
    return copy_tensors((case.input, case.args, case.kwargs),
                        lambda t: monarch.distribute_tensor(t, mesh, LAYOUTS[layout](t, n)))


@dataclass
class Pending:
    """One sharded call in flight: its futures (or plain outputs) in the order of the expected leaves."""
    where: str
    expected: list[Any]
    actual: list[Any]
    error: Exception | None = None


def launch(op: Any, case: Case, mesh: Any, where: str, layout: str) -> Pending:
    """Call the op on distributed arguments and ask for every output tensor (does not wait)."""
    inp, args, kwargs = distribute(case, mesh, layout)
    result = op(inp, *args, **kwargs)
    expected, spec_e = tree_flatten(case.expected)
    actual, spec_a = tree_flatten(result)
    assert spec_e == spec_a, f"output structure {spec_a}, expected {spec_e}"
    return Pending(where, expected, [monarch.fetch(a) if isinstance(a, MeshTensor) else a for a in actual])


def compare(actual: Any, expected: Any) -> None:
    if not isinstance(expected, torch.Tensor):
        assert actual == expected or actual != actual and expected != expected, f"{actual!r} != {expected!r}"
        return
    assert isinstance(actual, torch.Tensor), f"got {type(actual).__name__}, expected a tensor"
    tol = 1e-5 if expected.dtype == torch.float32 else None  # float reassociation; else torch's defaults
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, equal_nan=True)


def settle(p: Pending) -> None:
    """Wait for the outputs of one call and compare them with plain torch (raises on any mismatch)."""
    if p.error is not None:
        raise p.error
    for a, e in zip(p.actual, p.expected, strict=True):
        compare(a.get(TIMEOUT) if isinstance(a, Future) else a, e)


def run_op(op: Any, mesh: Any) -> Outcome:
    """Launch every sample in every layout (round trips overlap), then check them in order."""
    out = Outcome(opinfo_name(op))
    cases = cases_of(op, out)
    if not cases or unclaimed(cases, out):
        return out
    pending = []
    for i, case in enumerate(cases):
        shardable = any(max(t.shape, default=0) >= 2 for t in tensors_of((case.input, case.args, case.kwargs)))
        for layout in LAYOUTS if shardable else ["replicated"]:
            where = f"sample {i} {layout}"
            try:
                pending.append(launch(op, case, mesh, where, layout))
            except UnsupportedOpError as e:  # a decomposition reaches an op without a rule
                drain(mesh)
                out.status, out.missing = "skip", (unsupported_op(e),)
                out.detail = f"{where}: " + str(e)[:200]
                return out
            except Exception as e:  # noqa: BLE001 - refused on the controller; drain what was recorded
                pending.append(Pending(where, [], [], e))
                drain(mesh)
    for p in pending:
        out.samples += 1
        try:
            settle(p)
            out.passed += 1
        except (TimeoutError, SupervisionError):
            raise
        except Exception as e:  # noqa: BLE001 - a mismatch, a controller refusal or a RemoteError
            out.fail(p.where, e)
    return out


def unsupported_op(e: UnsupportedOpError) -> str:
    """The op an UnsupportedOpError names as lacking a rule (the op itself, or one its decomposition reaches)."""
    found = re.search(r"decomposition needs ([\w:.]+)", str(e)) or re.search(r"([a-z_]+::[\w.]+)", str(e))
    return found.group(1) if found else str(e).split(":", 1)[0]


def drain(mesh: Any) -> None:
    """Run what a refused call left pending, so that its errors are not reported against a later sample."""
    try:
        monarch.synchronize(mesh, TIMEOUT)
    except MonarchError:
        pass


@dataclass
class Run:
    """Outcomes of every OpInfo (by name) and how long they took."""
    outcomes: dict[str, Outcome]
    seconds: float

    def __repr__(self) -> str:
        return f"Run({len(self.outcomes)} OpInfos, {self.seconds:.0f} s)"

    def report(self, full: bool) -> str:
        """The headline, failing claimed ops, the most wanted rules; with `full`, one line per OpInfo."""
        ops = sorted(self.outcomes.values(), key=lambda o: o.name)
        claimed = [o for o in ops if o.claimed]
        good = [o for o in claimed if o.status == "pass"]
        wanted = Counter(f for o in ops for f in o.missing)
        lines = [f"opinfo: {len(good)}/{len(claimed)} claimed ops pass all samples, "
                 f"{sum(o.passed for o in claimed)}/{sum(o.samples for o in claimed)} samples "
                 f"({len(ops)} OpInfos, {len(ops) - len(claimed)} not claimed; {self.seconds:.0f} s)"]
        lines += [f"  FAIL {o.name:36} {o.passed:2}/{o.samples:2}  {o.detail}" for o in claimed if o.status == "fail"]
        lines.append(wrap("pass: " + " ".join(o.name for o in good)))
        lines.append(wrap("most wanted rules: " + ", ".join(f"{f} ({n})" for f, n in wanted.most_common(12))))
        by_family: dict[str, list[str]] = {}
        for f in sorted(wanted):
            by_family.setdefault(family(f), []).append(f"{f.removeprefix('aten::')} ({wanted[f]})")
        lines += [wrap(f"missing, {k}: " + ", ".join(v)) for k, v in sorted(by_family.items())]
        if full:
            lines += [f"{o.status:4} {o.name:48} {o.passed:2}/{o.samples:2}  {o.detail}" for o in ops]
        return "\n".join(lines)


def family(op: str) -> str:
    """The family an aten op without a rule belongs to (for the report of what is missing)."""
    name = op.removeprefix("aten::")
    return next((f for f, words in FAMILIES if any(w in name for w in words)), "other")


def wrong_values(run: Run) -> list[str]:
    """Claimed OpInfos whose outputs differ from plain torch (errors and refusals are not counted)."""
    return [f"{o.name}: {o.detail}" for o in run.outcomes.values()
            if o.status == "fail" and (": AssertionError" in o.detail or "Mismatched" in o.detail)]


def wrap(text: str) -> str:
    return textwrap.fill(text, 118, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False)


@pytest.fixture(scope="module")
def run(procs: Any) -> Run:
    """Every OpInfo run once on the module's mesh (strict: an op without a rule fails instead of gathering)."""
    from torch.testing._internal.common_methods_invocations import op_db  # slow import; needs expecttest
    outcomes: dict[str, Outcome] = {}
    warm = monarch.distribute_tensor(torch.zeros(2), procs)  # the workers load torch before the timed fetches
    monarch.fetch(warm).get(WARMUP)
    hung, start = "", time.monotonic()
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.setenv("MONARCH_STRICT", "1")
        warnings.simplefilter("ignore")
        only = re.compile(os.environ.get("MONARCH_OPINFO_OPS", ""))
        for op in (op for op in op_db if only.search(opinfo_name(op))):
            name = opinfo_name(op)
            if hung:
                outcomes[name] = Outcome(name, "fail", f"not run: the mesh stopped answering during {hung}")
                continue
            try:
                outcomes[name] = run_op(op, procs)
            except (TimeoutError, SupervisionError) as e:
                outcomes[name], hung = Outcome(name, "fail", f"{type(e).__name__}: {e}"), name
    return Run(outcomes, time.monotonic() - start)


def subset() -> bool:
    return bool(os.environ.get("MONARCH_OPINFO_OPS"))


def known_passing() -> list[str]:
    return [line.strip() for line in PASSING.read_text().splitlines() if line.strip()] if PASSING.exists() else []


def test_report(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    path = os.environ.get("MONARCH_OPINFO_REPORT")
    if path:
        Path(path).write_text(run.report(full=True) + "\n")
    with capsys.disabled():
        print("\n" + run.report(full=False))


@pytest.mark.skipif(subset(), reason="MONARCH_OPINFO_OPS runs a subset")
def test_known_passing_ops_still_pass(run: Run) -> None:
    names = known_passing()
    assert names == sorted(set(names)), f"{PASSING.name} must be sorted, one name per line, no duplicates"
    missing = Outcome("", "fail", "no such OpInfo")
    regressed = [f"{n}: {o.status} {o.detail}" for n in names if (o := run.outcomes.get(n, missing)).status != "pass"]
    assert not regressed, "OpInfos that used to pass:\n" + "\n".join(regressed)


@pytest.mark.skipif(subset(), reason="MONARCH_OPINFO_OPS runs a subset")
def test_claimed_ops_floor(run: Run) -> None:
    claimed = [n for n, o in run.outcomes.items() if o.claimed]
    assert len(claimed) >= MIN_CLAIMED, f"only {len(claimed)} OpInfos claimed: {claimed}"


@pytest.mark.skipif(subset(), reason="MONARCH_OPINFO_OPS runs a subset")
def test_strict_passing_floor(run: Run) -> None:
    """MONARCH_STRICT=1 all along: every op reached has a rule, or a decomposition into ops with rules."""
    passing = sorted(n for n, o in run.outcomes.items() if o.status == "pass")
    assert len(passing) >= MIN_PASSING, f"only {len(passing)} OpInfos pass in strict mode"


def test_no_wrong_values(run: Run) -> None:
    wrong = wrong_values(run)
    assert not wrong, "sharded results differ from plain torch:\n" + "\n".join(wrong)
