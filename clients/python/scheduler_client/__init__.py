"""Client of scheduler-grpc: generated stubs in `scheduler_client.v1`."""

__version__ = "0.1.0"
