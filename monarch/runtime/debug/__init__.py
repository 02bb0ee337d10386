"""Debugging a running mesh: the relayed pdb on the workers, the controller's debug console, and the admin
socket through which another process reaches them. Imports control and telemetry, never actors or session.
"""
