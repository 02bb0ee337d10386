"""Sharded mesh tensors (MeshTensor, placements). Imports torch and monarch.{errors,config} only."""
