"""What the controller does for its peers, one concern per module: mesh requests (requests.py, with `Jobs`, the
controller as these handlers use it), fault and port routing (supervise.py), ranks paused in pdb
(breakpoints.py), telemetry collection (collect.py). The one table that names these handlers is `HANDLERS` in
control/controller.py.
"""
