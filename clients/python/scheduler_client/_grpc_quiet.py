"""Imported by schedctl before anything loads grpc: gRPC's core reads GRPC_VERBOSITY once, at import.

The core writes its own log lines to stderr (a failed TLS handshake is an INFO line, an empty
target two ERROR lines), while schedctl reports every failure as one line of its own. So unless
GRPC_VERBOSITY is set, or SCHEDCTL_DEBUG asks for everything, the core stays quiet. The library
(`SchedulerClient`) never imports this: a program using it keeps gRPC's defaults.
"""

from __future__ import annotations

import os

if not os.environ.get("SCHEDCTL_DEBUG"):
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
