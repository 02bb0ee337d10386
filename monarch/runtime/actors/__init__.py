"""Actors on meshes: endpoints, actor meshes, proc and host meshes, and hosting actors in a worker.
Never imports graph, session, cluster or spmd: the tensor API is reached through the doorway in
`control.client`, workspace sync and torchrun-style scripts through proc_mesh's; launchers are given.
"""
