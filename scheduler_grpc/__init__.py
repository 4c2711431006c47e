"""scheduler-grpc: a distributed, cron-capable job scheduler with a gRPC control plane."""

__version__ = "0.1.0"
