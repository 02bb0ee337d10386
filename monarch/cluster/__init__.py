"""Running beyond one host: ssh and Slurm launch, attach mode, Kubernetes manifests, workspace sync."""
