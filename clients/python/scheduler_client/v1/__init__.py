"""Generated from protos/scheduler/v1 by clients/python/gen_protos.py; do not edit."""
