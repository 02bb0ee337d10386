"""The data plane: moving shards between workers (MPI by default)."""
