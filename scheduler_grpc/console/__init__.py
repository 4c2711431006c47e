"""The web console: jobs, executions (live), workers, dead letters and cluster health in a browser.

Served by `scheduler-grpc server` beside the gRPC API, in the same asyncio process, on `aiohttp.web`
(`app.start_console`). It is a client of the same application layer as the servicers: every action
calls `Control` (or the `Authenticator`, `ClusterView`, `EventFanout`) the servicer of its RPC calls,
and is allowed by the same role table (`auth.METHOD_ROLES`, through the RPC it corresponds to).

* `security`: the session cookie (a Login session token, so Logout revokes it), the CSRF token, the
  security headers (a Content-Security-Policy without inline scripts) and the per-route role check.
* `forms`: form fields -> a `JobSpec` (validation errors name the form field).
* `charts`: server-rendered inline SVG charts.
* `views`: the pages and actions; `app`: routes, middlewares and start/stop.
* `bulk`: bulk actions (by selection or filter, after a confirmation saying how many); `search`:
  dead letters and the executions' name/error search, and the charts page; `timecharts`: charts
  with time axes; `depth`: queue depth sampled each minute; `flash`: the message after each
  action; `humane`: one format for durations and relative times.

Pages are rendered on the server (Jinja2 templates, autoescaped); `static/console.js` (no framework,
no build step) adds the live schedule preview, the live executions list (Server-Sent Events fed by
the same fan-out as WatchExecutions, resuming from the last event id) and confirmations.
"""
