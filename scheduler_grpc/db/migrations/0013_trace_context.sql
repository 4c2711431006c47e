-- OpenTelemetry (scheduler_grpc/tracing.py): the W3C `traceparent` of the span that made the run
-- (its trigger or fire), written with the run's first attempt and copied to every later attempt,
-- so each attempt's spans, on whichever worker, join the run's one trace. NULL when tracing was
-- off. No index reads it (the claim stays a HOT update), and a nullable column without a default
-- is added without rewriting the table.
ALTER TABLE job_executions ADD COLUMN trace_context text;
