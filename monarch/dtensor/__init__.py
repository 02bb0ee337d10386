"""DTensor's names over monarch's objects: code written for torch.distributed.tensor and
torch.distributed.device_mesh runs with its imports changed to monarch.dtensor (README "DTensor names").

`DTensor` is `monarch.MeshTensor`, a `DeviceMesh` is a ProcMesh or LocalMesh (or a submesh `mesh["tp"]`);
`monarch.dtensor.device_mesh`, `monarch.dtensor.debug` and `monarch.dtensor.experimental` (local_map) mirror
torch's modules; `DTensor.from_local`, `to_local` and `full_tensor(grad_placements=)` cross the local/global
boundary in a single controller's meaning.
"""
from __future__ import annotations

from monarch.dtensor._api import distribute_tensor, empty, full, ones, rand, randn, zeros
from monarch.dtensor.device_mesh import DeviceMesh, init_device_mesh
from monarch.parallel import distribute_module
from monarch.tensor.meshtensor import MeshTensor as DTensor
from monarch.tensor.placement import Partial, Placement, Replicate, Shard

__all__ = ["DTensor", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "distribute_module",
           "distribute_tensor", "empty", "full", "init_device_mesh", "ones", "rand", "randn", "zeros"]
