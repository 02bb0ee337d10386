"""Module-level parallelism on a mesh: tensor-parallel styles with DTensor's names and meanings
(`parallelize_module`, `ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`, `PrepareModuleInput`,
`PrepareModuleOutput`, `distribute_module`), data parallelism and gathered state dicts.
"""
from __future__ import annotations

from monarch.parallel.api import data_parallel, distribute_module, full_state_dict, parallelize_module
from monarch.parallel.styles import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput,
                                     RowwiseParallel, SequenceParallel)

__all__ = ["ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleOutput", "RowwiseParallel",
           "SequenceParallel", "data_parallel", "distribute_module", "full_state_dict", "parallelize_module"]
