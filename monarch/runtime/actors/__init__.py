"""Actors on meshes: endpoints, actor meshes, proc and host meshes, and hosting actors in a worker.
Never imports graph or session; the tensor API is reached through the doorway in `control.client`.
"""
