"""torch.distributed.tensor.parallel's names on monarch: tensor-parallel code runs with its import changed to
`from monarch.dtensor.parallel import ...` (README "Tensor-parallel styles").

`parallelize_module(module, device_mesh, parallelize_plan)` takes a mesh of one dim or a view `mesh["tp"]`;
the styles keep DTensor's keywords and defaults. Outputs are global MeshTensors whatever `use_local_output`
says: the controller holds no rank's local piece, and the global value is the one DTensor's view gives.
"""
from __future__ import annotations

from monarch.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput,
                              RowwiseParallel, SequenceParallel, parallelize_module)

__all__ = ["ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleOutput", "RowwiseParallel",
           "SequenceParallel", "parallelize_module"]
