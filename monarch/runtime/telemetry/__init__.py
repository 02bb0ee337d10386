"""Observability: recorded events, the controller's DuckDB store, OpenTelemetry export, the admin endpoint
and `monarch top`. Never imports actors or session modules.
"""
