"""`python -m scheduler_grpc` is the `scheduler-grpc` console script."""

from scheduler_grpc.cli import main

main()
