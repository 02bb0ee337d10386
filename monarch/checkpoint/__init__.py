"""Checkpoints in torch.distributed.checkpoint (DCP) format, written and read by the workers.

    import monarch.checkpoint as mcp
    sd = mcp.get_state_dict(model, optimizers=opt)             # {"model": ..., "optim": ...}
    mcp.save(sd | {"step": step}, checkpoint_id="ckpt/step100")  # each rank writes its own pieces
    fut = mcp.async_save(sd, checkpoint_id=...)                 # returns at once; fut.get() finishes it
    mcp.load(sd, checkpoint_id="ckpt/step100"); mcp.set_state_dict(model, opt, sd)   # any mesh shape

A checkpoint is a DCP checkpoint: `torch.distributed.checkpoint.load` reads it in a plain process, and
one written by plain DCP (one process, or torchrun with DTensor) loads here, resharded on the fly.
"""
from __future__ import annotations

from monarch.checkpoint.api import SaveFuture, async_save, load, save
from monarch.checkpoint.state import RNGState, get_state_dict, set_state_dict
from monarch.errors import CheckpointError

__all__ = ["CheckpointError", "RNGState", "SaveFuture", "async_save", "get_state_dict", "load", "save",
           "set_state_dict"]
