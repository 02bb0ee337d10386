"""The sharding rules: the table and its types (`table`), one module per op family filling it.

Importing this package imports every family once, so whoever reads `RULES` sees the whole table.
"""
from monarch.graph.rules import conv  # noqa: F401
from monarch.graph.rules import linalg  # noqa: F401
from monarch.graph.rules import signal  # noqa: F401
from monarch.graph.rules import factory, index, matmul, nn, pointwise, reduce, view  # noqa: F401
