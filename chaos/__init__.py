"""The fault suite of scheduler-grpc (`make chaos`): a toolkit, a checker and scenarios.

* `chaos.proxy`: an asyncio TCP fault proxy (latency, blackhole, reset) for one link.
* `chaos.servers`: Valkey and PostgreSQL under fault (kill -9, restart with or without AOF,
  FLUSHALL, fast and immediate stop, SIGSTOP).
* `chaos.cluster`: role processes (scheduler, worker, server) by pid, each reaching Redis and
  PostgreSQL through proxies of its own, and remote workers reaching a server through one.
* `chaos.remote_worker`: a remote worker process (issue 23): the Python SDK, holding or serving
  runs, able to withhold its acknowledgements.
* `chaos.checker`: reads PostgreSQL after healing and counts duplicates, holes, stuck runs and
  writes accepted under a stale leader term.
* `chaos.harness`: one scenario's life (fresh database, roles, jobs, faults, settling, the check).
* `chaos.scenarios`: the scenarios; `chaos.report` and `chaos.__main__`: the table `make chaos`
  prints (`python -m chaos NAME ...` runs some of them; `--keep` keeps the role logs).

Everything runs on loopback with real processes; nothing here is imported by the service.
"""
