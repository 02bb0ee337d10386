"""The runtime, one sub-package per concern (ARCHITECTURE §2): `control` (the wire, both ends), `actors`,
`engine` (worker side of tensors), `session` (controller side of tensors) and `telemetry`.

Only `session` imports `monarch.graph`; a worker never loads the compiler.
"""
