"""The compiler: trace, propagate shardings, partition. May import monarch.tensor, never monarch.runtime."""
