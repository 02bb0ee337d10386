"""Rules for pointwise ops (unary, binary, ternary; broadcasting; scalars; comparisons; casts; in-place;
the pointwise `special_*` ops and the elementwise prims their decompositions reach).

An output dim can be sharded when every input that really has that dim (not broadcast) is sharded on
it too. Ops that are linear in an input also pass `Partial(sum)` through: `neg(P)`, `P + P`, `P * R`,
`P / R`, so a reduction can be deferred past them.
"""
from __future__ import annotations

import torch

from monarch.graph.rules.common import aten, broadcast_shard
from monarch.graph.rules.table import OpCall, Strategy, register_rule
from monarch.tensor.placement import P, R, Shard

UNARY = sorted([
    "abs", "acos", "acosh", "angle", "asin", "asinh", "atan", "atanh", "bitwise_not", "ceil", "celu",
    "clamp", "clamp_max", "clamp_min", "clip", "conj_physical", "cos", "cosh", "deg2rad", "digamma", "elu",
    "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "fill", "floor", "frac", "frexp", "gelu", "hardshrink",
    "hardsigmoid", "hardtanh", "i0", "isfinite", "isinf", "isnan", "isneginf", "isposinf", "leaky_relu",
    "lgamma", "log", "log10", "log1p", "log2", "logical_not", "logit", "mish", "mvlgamma", "nan_to_num",
    "polygamma", "reciprocal", "relu", "relu6", "round", "rsqrt", "selu", "sgn", "sigmoid", "sign",
    "signbit", "silu", "sin", "sinc", "sinh", "softplus", "softshrink", "sqrt", "square", "tan", "tanh",
    "threshold", "trunc", "zero", "_to_copy",
])
BINARY = sorted([
    "atan2", "bitwise_and", "bitwise_left_shift", "bitwise_or", "bitwise_right_shift", "bitwise_xor",
    "copysign", "div", "eq", "float_power", "fmax", "fmin", "fmod", "gcd", "ge", "gelu_backward", "gt",
    "heaviside", "hypot", "igamma", "igammac", "lcm", "ldexp", "le", "lerp", "logaddexp", "logaddexp2",
    "logical_and", "logical_or", "logical_xor", "logit_backward", "lt", "masked_fill", "max", "maximum",
    "min", "minimum", "mul", "ne", "nextafter", "pow", "remainder", "rsub", "add", "sub",
    "sigmoid_backward", "silu_backward", "tanh_backward", "threshold_backward", "true_divide", "xlogy",
    "copy", "native_dropout_backward",
])
TERNARY = sorted(["addcdiv", "addcmul", "where"])
# ops whose output is linear in some inputs: op name -> which input patterns may be Partial together
LINEAR_ALL = {"neg", "positive", "clone", "alias", "detach", "add", "sub", "zero"}
# linear in each listed input separately, the others replicated (a quotient is not linear in its divisor)
LINEAR_ONE = {"mul": (0, 1), "div": (0,), "true_divide": (0,)}
EXTRA_TAGGED = {"_to_copy", "clone", "copy", "fill", "zero", "alias", "detach", "neg", "positive"}


def _ops(names: list[str]) -> list[torch._ops.OpOverload]:
    """Every pointwise overload of each name and of its in-place variant."""
    out = []
    for name in names:
        for base in (name, name + "_"):
            packet = getattr(aten, base, None)
            if packet is None:
                continue
            for o in packet.overloads():
                op = getattr(packet, o)
                if torch.Tag.pointwise in op.tags or name in EXTRA_TAGGED:
                    if "out" not in o:
                        out.append(op)
    return out


def _special_ops() -> list[torch._ops.OpOverload]:
    """Every `aten::special_*` overload torch tags pointwise (Bessel functions, orthogonal polynomials, ...)."""
    packets = (getattr(aten, n) for n in sorted(dir(aten)) if n.startswith("special_"))
    return [op for p in packets for o in p.overloads() if "out" not in o
            and torch.Tag.pointwise in (op := getattr(p, o)).tags]


def _elementwise_prims() -> list[torch._ops.OpOverload]:
    """The prims tagged pointwise, and those built as elementwise ops though untagged (their meta is torch's
    elementwise one: prims::bessel_j0, erfcx, zeta, ...)."""
    prims = torch.ops.prims
    elementwise = torch._prims._prim_elementwise_meta
    ops = (getattr(prims, n).default for n in sorted(dir(prims))
           if isinstance(getattr(prims, n), torch._ops.OpOverloadPacket) and "default" in getattr(prims, n).overloads())
    return [op for op in ops if torch.Tag.nondeterministic_seeded not in op.tags and (
        torch.Tag.pointwise in op.tags or getattr(getattr(op, "prim_meta_impl", None), "func", None) is elementwise)]


def pointwise(call: OpCall, mdim: int) -> list[Strategy]:
    out = call.outs[0]
    n_in, n_out = len(call.ins), len(call.outs)
    strategies = [Strategy(tuple(broadcast_shard(x, out, d) for x in call.ins), (Shard(d),) * n_out)
                  for d in range(out.ndim) if all(o.shape == out.shape for o in call.outs)]
    base = call.name.split(".")[0].rstrip("_")
    if base in LINEAR_ALL and _scalar_free(call):
        strategies.append(Strategy((P,) * n_in, (P,) * n_out))
    elif base in LINEAR_ONE:
        for i in LINEAR_ONE[base][:n_in]:
            strategies.append(Strategy(tuple(P if j == i else R for j in range(n_in)), (P,) * n_out))
    return strategies


def _scalar_free(call: OpCall) -> bool:
    """add/sub of a Partial with a plain scalar would add the scalar once per rank."""
    name = call.name
    if name.startswith(("add", "sub")):
        return len(call.ins) == 2 and not name.endswith("Scalar")
    return True


for _op in (_ops(UNARY) + _ops(BINARY) + _ops(TERNARY) + _ops(sorted(LINEAR_ALL)) + _special_ops()
            + _elementwise_prims()):
    register_rule(_op)(pointwise)
