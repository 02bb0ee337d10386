"""State dicts of models and optimizers keyed by fully qualified names, as torch.distributed.checkpoint
builds them, and the RNG state of a mesh as a Stateful checkpoint entry.

`get_state_dict` / `set_state_dict` are DCP's (torch.distributed.checkpoint.state_dict), which work on
a module whose parameters are MeshTensors: values stay MeshTensors (no gather), optimizer state is keyed
by parameter name, so a checkpoint moves between meshes, and between monarch and plain torch.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state

from monarch.runtime.session.session import session_of
from monarch.shape import MeshLike
from monarch.tensor import random

Optimizers = torch.optim.Optimizer | list[torch.optim.Optimizer] | tuple[torch.optim.Optimizer, ...]


def get_state_dict(model: nn.Module, optimizers: Optimizers | None = None, *,
                   options: dcp_state.StateDictOptions | None = None) -> dict[str, Any]:
    """{"model": ..., "optim": ...} (no "optim" without optimizers), FQN-keyed, MeshTensor values."""
    if optimizers is None:
        return {"model": dcp_state.get_model_state_dict(model, options=options)}
    model_sd, optim_sd = dcp_state.get_state_dict(model, optimizers, options=options)
    return {"model": model_sd, "optim": optim_sd}


def set_state_dict(model: nn.Module, optimizers: Optimizers | None = None, state_dict: dict[str, Any] | None = None,
                   *, model_state_dict: dict[str, Any] | None = None, optim_state_dict: dict[str, Any] | None = None,
                   options: dcp_state.StateDictOptions | None = None) -> Any:
    """Load `state_dict` (what get_state_dict returned, after `load`) into the model and optimizers; DCP's
    keyword form (model_state_dict=, optim_state_dict=) works too. Returns the model's missing and
    unexpected keys, as torch does."""
    sd = state_dict or {}
    model_sd = model_state_dict if model_state_dict is not None else sd.get("model", {})
    if optimizers is None:
        return dcp_state.set_model_state_dict(model, model_sd, options=options)
    optim_sd = optim_state_dict if optim_state_dict is not None else sd.get("optim", {})
    return dcp_state.set_state_dict(model, optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd,
                                    options=options)


class RNGState:
    """A Stateful checkpoint entry (`sd | {"rng": RNGState(procs)}`): monarch.manual_seed's stream, which
    every random op on MeshTensors draws from, and the torch generator of each worker of `mesh` (what
    actor code draws from). The stream resumes exactly on any mesh. Worker generators resume exactly
    on a mesh with as many ranks; otherwise rank r gets the state saved by rank r mod the saved count."""

    def __init__(self, mesh: MeshLike) -> None:
        self.mesh = mesh

    def state_dict(self) -> dict[str, Any]:
        s = session_of(self.mesh)
        (handle,) = s.on_ranks("monarch::dcp_rng_state", lambda r, _: ())
        return {"monarch": list(random.get_state()), "workers": tuple(s.values(handle).get())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        random.set_state(tuple(state_dict["monarch"]))
        workers = state_dict["workers"]
        s = session_of(self.mesh)
        (handle,) = s.on_ranks("monarch::dcp_set_rng_state", lambda r, _: (workers[r % len(workers)],))
        s.values(handle).get()
