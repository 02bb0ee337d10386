"""Data-plane transports: how the pieces of a collective move between ranks (MPI)."""
