"""The controller side of sharded tensors: the session that records and ships programs, lowering to wire
messages, the user-facing tensor API, compiled steps, and the in-process reference mesh (LocalMesh).
"""
