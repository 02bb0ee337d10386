"""The control plane, both ends: messages and their encoding, the controller (connections, routing,
supervision, heartbeats), launching workers, and the worker process loop. Never imports graph or session.
"""
