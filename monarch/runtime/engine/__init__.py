"""The worker side of sharded tensors: the engine that interprets rank programs, the monarch:: kernels,
the service that runs programs for one rank, and the data-plane transports. Never imports graph or session.
"""
