'use strict';
/**
 * A remote worker: serve a scheduler-grpc deployment's runs from this Node.js process, over one
 * `scheduler.v1.WorkerService.Connect` stream (issue 23). The protocol is the Python SDK's
 * (`scheduler_client.worker`).
 *
 *   const { Worker } = require('./worker');
 *   const worker = new Worker({ target: 'scheduler:50051', apiKey: process.env.SCHEDULER_WORKER_KEY, slots: 20, queue: 'remote' });
 *   worker.handler('acme.sync', { description: 'sync one account' }, async (ctx, payload) => {
 *     if (payload.busy) ctx.retryAfter(30); // back to the queue, no attempt spent
 *     return { synced: payload.account };
 *   });
 *   await worker.run(); // until worker.stop()
 *
 * What it does for you: it says hello (its handlers, slots, SDK), grants credit as slots come free,
 * acknowledges each assignment on receipt, runs each in its own async task, reports its outcome (the
 * handler's return value; a thrown error as a failure retried by the job's policy, `PermanentError`
 * as one that is not, `RateLimited` / `ctx.retryAfter` as back-pressure), aborts `ctx.signal` on the
 * server's cancel (the job's timeout, a CancelExecution) and answers pings. A lost stream (the
 * server's end, a cut connection, or no message from the server for 2.5 ping intervals) is
 * reconnected with jittered exponential backoff, and the runs still executing (or finished while
 * disconnected) are resumed on the new stream with their claim tokens: the server keeps their leases
 * again and takes their outcomes; the signals of runs it does not resume (their leases expired) are
 * aborted. `stop()` (or the server's drain) takes no new work and lets the running handlers finish.
 *
 * Where a bidirectional stream does not survive (a proxy that buffers or cuts long streams),
 * `new Worker({ ..., transport: 'unary' })` serves the same runs over unary calls instead
 * (`OpenWorkerSession`, `PollWorkerSession` with a bounded wait, `CloseWorkerSession`), with the same
 * handler API and semantics; a poll that reaches a server process not holding its session (NOT_FOUND)
 * opens a new session.
 *
 * JavaScript cannot stop a promise: a handler stops on cancel by watching `ctx.signal` (pass it to
 * fetch, or check `ctx.signal.aborted`). The cancel is reported at once; the handler's slot stays
 * busy (no credit granted for it) until its promise settles, so at most `slots` handlers ever run.
 */

const { EventEmitter } = require('node:events');
const { SchedulerClientError, fromStruct, fromTimestamp, grpc, loadPackage, toValue } = require('./client');
const { version: VERSION } = require('./package.json');

const SDK = 'scheduler-client-node';
// Codes that reconnecting cannot fix: the key, its role or what this worker says is wrong.
const FATAL = new Set([
  grpc.status.UNAUTHENTICATED,
  grpc.status.PERMISSION_DENIED,
  grpc.status.INVALID_ARGUMENT,
  grpc.status.UNIMPLEMENTED,
]);
const TRANSPORTS = new Set(['stream', 'unary']);
const CALL_MARGIN_MS = 10000; // how long a unary call may take beyond its wait
const MIN_POLL_WAIT_MS = 100; // a long poll is never a busy loop
const MAX_RETRY_AFTER_S = 3600;
const MAX_ERROR_CHARS = 65536; // the server keeps 8,192 (its middle cut out); this bounds the message

/** Throw from a handler: "rate limited, retry after `seconds`": the run goes back to the queue
 * without spending an attempt (and its limit keys wait that long). */
class RateLimited extends Error {
  constructor(seconds, reason = 'rate limited') {
    const wait = Math.max(0, Math.min(Number(seconds) || 0, MAX_RETRY_AFTER_S));
    super(`${reason}; retry after ${wait}s`);
    this.name = 'RateLimited';
    this.seconds = wait;
    this.reason = reason;
  }
}

/** Throw from a handler for a failure retries cannot fix: the run is dead-lettered at once. */
class PermanentError extends Error {
  constructor(message) {
    super(message);
    this.name = 'PermanentError';
  }
}

/** What a handler knows about the run it executes. */
class ExecutionContext {
  constructor(assignment, signal) {
    /** The run (its first attempt's execution id). */
    this.runId = assignment.run_id;
    /**
     * This attempt. Not a once-only key: an assignment whose ack had not reached the server when its
     * stream ended goes back unspent and may be delivered again (same execution id, same attempt), so
     * a handler must be idempotent per execution id.
     */
    this.executionId = assignment.execution_id;
    this.jobId = assignment.job_id;
    this.jobName = assignment.job_name;
    /** 1 for the first attempt, 2 for the first retry, ... */
    this.attempt = assignment.attempt;
    this.handler = assignment.handler;
    /** When the job's timeout cancels it (server clock), a Date or null. */
    this.deadline = fromTimestamp(assignment.deadline);
    /** The slot the run belongs to, a Date or null. */
    this.scheduledFor = fromTimestamp(assignment.scheduled_for);
    /**
     * Aborted when the server cancels the run (its reason says why), or when a new stream could not
     * resume it after its stream was lost (its lease expired meanwhile).
     */
    this.signal = signal;
    Object.defineProperty(this, 'claimToken', { value: assignment.claim_token, enumerable: false });
  }

  /** Hand the run back, unspent, to run again after `seconds` (throws `RateLimited`). */
  retryAfter(seconds, reason = 'rate limited') {
    throw new RateLimited(seconds, reason);
  }
}

/**
 * A remote worker of a scheduler-grpc deployment. Events: 'connected' (worker id), 'disconnected'
 * (the error, or null), 'resumed' (the execution ids a new stream resumed), 'draining' (the server is
 * stopping), 'rejected' (a Rejected message).
 */
class Worker extends EventEmitter {
  /**
   * @param {object} options
   * @param {string} options.target host:port of a server
   * @param {string} options.apiKey an API key of the `worker` role
   * @param {number} [options.slots] runs executed at once (credit never exceeds it), default 10
   * @param {string} [options.queue] the queue to take runs from (default: the server's)
   * @param {object} [options.labels] free-form labels shown with the worker
   * @param {boolean|grpc.ChannelCredentials} [options.tls] false: plaintext; true: TLS with system roots
   * @param {object} [options.channelOptions] extra gRPC channel options
   * @param {number} [options.reconnectMaxMs] the longest wait between two connection attempts
   * @param {object} [options.logger] where warnings go (`warn`), default console
   * @param {string} [options.transport] 'stream' (one Connect stream, the default) or 'unary' (polls,
   *   for networks where a bidirectional stream does not survive)
   * @param {number} [options.pollWaitMs] with transport 'unary': how long a poll waits for work
   *   (default and at most the server's `max_wait`; at least 100 ms)
   */
  constructor({
    target, apiKey, slots = 10, queue = '', labels = {}, tls = false, channelOptions = {},
    reconnectMaxMs = 30000, logger = console, transport = 'stream', pollWaitMs = null,
  } = {}) {
    super();
    if (!target) throw new TypeError('target (host:port) is required');
    if (!Number.isInteger(slots) || slots < 1) throw new RangeError('slots must be an integer of at least 1');
    if (!TRANSPORTS.has(transport)) throw new RangeError(`transport must be 'stream' or 'unary', got '${transport}'`);
    this.transport = transport;
    this.pollWaitMs = pollWaitMs;
    this.target = target;
    this.slots = slots;
    this.queue = queue;
    this.labels = { ...labels };
    this.workerId = '';
    this.connected = false;
    this.stats = {
      assigned: 0, succeeded: 0, failed: 0, cancelled: 0, rejected: 0, connects: 0, resumed: 0, notResumed: 0,
    };
    this._apiKey = apiKey;
    this._credentials =
      tls === true ? grpc.credentials.createSsl() : tls ? tls : grpc.credentials.createInsecure();
    this._channelOptions = {
      'grpc.primary_user_agent': `${SDK}/${VERSION}`,
      // Keep the stream alive through idle proxies (the server allows a ping every 10 s).
      'grpc.keepalive_time_ms': 20000,
      'grpc.keepalive_timeout_ms': 10000,
      'grpc.keepalive_permit_without_calls': 1,
      ...channelOptions,
    };
    this._reconnectMaxMs = reconnectMaxMs;
    this._logger = logger;
    this._handlers = new Map();
    this._stopping = false;
    this._running = false;
    this._wakeUp = null; // ends a reconnect wait early (stop)
    this._stream = null; // the live stream, if any
    this._busy = 0; // handlers whose promise has not settled, of any stream
    this._idle = []; // resolvers waiting for _busy to reach 0
    // By execution id, runs without a reported outcome, across streams: { ctx, abort, stream, outcome }
    // (`stream`: the live one it reports to, null while disconnected; `outcome`: finished meanwhile).
    this._runs = new Map();
    this._pingIntervalMs = 10000; // as the last welcome said (the server's default before)
  }

  /**
   * Register an async handler `fn(ctx, payload) => result` under `name` (a job's `handler`).
   * `handler(name, fn)` also works. Returns the worker.
   */
  handler(name, options, fn) {
    if (typeof options === 'function') [options, fn] = [{}, options];
    const { description = '', payloadSchema = null } = options || {};
    if (typeof fn !== 'function') throw new TypeError('a handler is a function (ctx, payload) => result');
    if (this._handlers.has(name)) throw new Error(`a handler named '${name}' is registered already`);
    this._handlers.set(name, {
      fn, description, schemaJson: payloadSchema === null ? '' : JSON.stringify(payloadSchema),
    });
    return this;
  }

  /** Take no new work; `run` resolves once the running handlers finished and reported. */
  stop() {
    this._stopping = true;
    if (this._stream) this._stream.drain();
    if (this._wakeUp) this._wakeUp();
  }

  /**
   * Serve until `stop()`, reconnecting with jittered exponential backoff.
   * Rejects with a SchedulerClientError on a failure reconnecting cannot fix (the key, its role,
   * a handler name breaking the naming rule).
   */
  async run() {
    if (this._handlers.size === 0) throw new Error('register at least one handler (worker.handler)');
    if (this._running) throw new Error('this worker is running already');
    this._running = true;
    const pkg = loadPackage();
    const stub = new pkg.WorkerService(this.target, this._credentials, this._channelOptions);
    let delay = 100;
    try {
      // Stopping, runs still held (a lost stream) are reported on a new stream first.
      while (!this._stopping || this._runs.size > 0) {
        const stream = this.transport === 'unary' ? new UnarySession(this, stub) : new Stream(this, stub);
        this._stream = stream;
        const error = await stream.serve();
        this._stream = null;
        this.connected = false;
        this.emit('disconnected', error);
        if (error !== null) {
          if (FATAL.has(error.code)) throw error;
          this._logger.warn(`scheduler worker: stream lost (${error.codeName}: ${error.message}); reconnecting`);
        }
        if (stream.welcomed) delay = 100;
        if (this._stopping && this._runs.size === 0) break;
        const wait = Math.random() * delay;
        delay = Math.min(delay * 2, this._reconnectMaxMs);
        await new Promise((resolve) => {
          const timer = setTimeout(resolve, wait);
          this._wakeUp = () => {
            clearTimeout(timer);
            resolve();
          };
        });
        this._wakeUp = null;
      }
      // Handlers still running (their signals aborted) are waited for.
      if (this._busy > 0) await new Promise((resolve) => this._idle.push(resolve));
    } finally {
      for (const run of this._runs.values()) run.abort.abort(new Error('the worker stopped'));
      this._runs.clear();
      stub.close();
      this._running = false;
    }
  }

  _hello() {
    return {
      handlers: [...this._handlers].map(([name, entry]) => ({
        name, description: entry.description, payload_schema_json: entry.schemaJson,
      })),
      labels: this.labels,
      slots: this.slots,
      sdk: SDK,
      sdk_version: VERSION,
      queue: this.queue,
      held_runs: [...this._runs].map(([executionId, run]) => ({
        execution_id: executionId, claim_token: run.ctx.claimToken,
      })),
    };
  }

  /** A run's outcome: sent on its live stream, or kept for the next one (a lost stream). */
  _report(ctx, result) {
    const run = this._runs.get(ctx.executionId);
    if (run === undefined || run.ctx !== ctx) return false; // reported (a cancel), or not resumed
    if (run.stream === null || run.stream.ended) {
      run.outcome = result;
      return true;
    }
    this._runs.delete(ctx.executionId);
    run.stream.send({ outcome: { execution_id: ctx.executionId, claim_token: ctx.claimToken, ...result } });
    run.stream.closeWhenIdle();
    return true;
  }

  _settled() {
    this._busy -= 1;
    if (this._stream) this._stream.grant(1);
    if (this._busy === 0) for (const resolve of this._idle.splice(0)) resolve();
  }
}

/** One connection: its call, its credit; the runs it reports are the worker's (`run.stream`). */
class Stream {
  constructor(worker, stub) {
    this.worker = worker;
    this.stub = stub;
    this.call = null;
    this.welcomed = false;
    this.ended = false;
    this.draining = worker._stopping;
    this.offered = []; // the execution ids its hello asked to resume
    this.heard = Date.now(); // when the server last said anything
    this.pendingGrant = 0;
    this.flushScheduled = false;
    this.halfClosed = false;
  }

  /** Resolves with null when the stream ended cleanly, else with the SchedulerClientError. */
  serve() {
    const worker = this.worker;
    const metadata = new grpc.Metadata();
    if (worker._apiKey) metadata.set('authorization', `Bearer ${worker._apiKey}`);
    return new Promise((resolve) => {
      const call = this.stub.Connect(metadata);
      this.call = call;
      // A cut the connection does not notice (a proxy holding it open, a blackholed link): the
      // server pings every interval, so 2.5 intervals of silence end the stream.
      const watchdog = setInterval(() => {
        if (Date.now() - this.heard >= 2.5 * worker._pingIntervalMs) {
          worker._logger.warn('scheduler worker: no message from the server for 2.5 ping intervals; reconnecting');
          call.cancel();
        }
      }, Math.min(Math.max(worker._pingIntervalMs / 4, 25), 1000));
      call.on('data', (response) => {
        this.heard = Date.now();
        this.on(response);
      });
      call.on('error', () => {}); // reported by 'status' below
      call.on('status', (status) => {
        clearInterval(watchdog);
        this.ended = true;
        // Runs still going are kept: the next stream resumes them (their outcomes wait).
        for (const run of worker._runs.values()) if (run.stream === this) run.stream = null;
        resolve(status.code === grpc.status.OK ? null : new SchedulerClientError(status.code, status.details));
      });
      const hello = worker._hello();
      this.offered = hello.held_runs.map((held) => held.execution_id);
      this.send({ hello });
    });
  }

  send(request) {
    if (!this.ended && !this.halfClosed) this.call.write(request);
  }

  /** Credit for `count` more runs, sent together with others freed in the same turn. */
  grant(count) {
    if (count <= 0 || !this.welcomed || this.draining || this.ended) return;
    this.pendingGrant += count;
    if (!this.flushScheduled) {
      this.flushScheduled = true;
      setImmediate(() => {
        this.flushScheduled = false;
        const grant = this.pendingGrant;
        this.pendingGrant = 0;
        if (grant > 0 && !this.draining) this.send({ credit: { grant } });
      });
    }
  }

  /** Take no new work; end the stream once every open run reported. */
  drain() {
    this.draining = true;
    this.pendingGrant = 0;
    this.closeWhenIdle();
  }

  closeWhenIdle() {
    const idle = this.worker._runs.size === 0;
    if (this.draining && this.welcomed && idle && !this.ended && !this.halfClosed && this.call) {
      this.halfClosed = true;
      this.call.end(); // the server ends the stream
    }
  }

  on(response) {
    const worker = this.worker;
    switch (response.message) {
      case 'assignment':
        this.assigned(response.assignment);
        break;
      case 'assignments': // several at once: the server sends what it has ready in one write
        for (const assignment of response.assignments.assignments) this.assigned(assignment);
        break;
      case 'ping':
        this.send({ pong: { nonce: response.ping.nonce } });
        break;
      case 'cancel': {
        const run = worker._runs.get(response.cancel.execution_id);
        if (run !== undefined && run.stream === this) {
          run.abort.abort(new Error(response.cancel.reason || 'cancelled'));
          worker.stats.cancelled += 1;
          worker._report(run.ctx, { error: { message: `cancelled: ${response.cancel.reason || 'cancelled'}` } });
        }
        break;
      }
      case 'welcome':
        this.welcomed = true;
        const resumed = this.resume(response.welcome);
        worker.workerId = response.welcome.worker_id;
        worker.connected = true;
        worker.stats.connects += 1;
        worker.emit('connected', worker.workerId);
        if (resumed.length > 0) worker.emit('resumed', resumed);
        this.grant(worker.slots - worker._busy);
        this.closeWhenIdle(); // stopped before the welcome (or while disconnected)
        break;
      case 'drain':
        worker.emit('draining');
        this.drain();
        break;
      case 'rejected': {
        const rejected = response.rejected;
        worker.stats.rejected += 1;
        worker.emit('rejected', rejected);
        worker._logger.warn(`scheduler worker: the server refused a message: ${rejected.code} ${rejected.field}: ${rejected.message}`);
        break;
      }
      default:
        break;
    }
  }

  /** The welcome says which of the hello's held runs this stream resumed: they report here (those
   * finished meanwhile at once); the others' leases are gone, so their signals are aborted.
   * Returns the execution ids resumed. */
  resume(welcome) {
    const worker = this.worker;
    const interval = welcome.ping_interval;
    if (interval) worker._pingIntervalMs = Math.max(Number(interval.seconds) * 1000 + interval.nanos / 1e6, 100);
    const resumed = new Set(welcome.resumed_execution_ids);
    for (const executionId of this.offered) {
      const run = worker._runs.get(executionId);
      if (run === undefined) continue;
      if (!resumed.has(executionId)) {
        worker._runs.delete(executionId);
        worker.stats.notResumed += 1;
        run.abort.abort(new Error('not resumed: its lease expired while the stream was lost'));
        continue;
      }
      worker.stats.resumed += 1;
      run.stream = this;
      if (run.outcome !== null) {
        worker._runs.delete(executionId);
        this.send({ outcome: { execution_id: executionId, claim_token: run.ctx.claimToken, ...run.outcome } });
      }
    }
    for (const refusal of welcome.resume_refusals) {
      worker._logger.warn(`scheduler worker: run ${refusal.execution_id} not resumed: ${refusal.message}`);
    }
    return [...resumed];
  }

  assigned(assignment) {
    const worker = this.worker;
    worker.stats.assigned += 1;
    this.send({ ack: { execution_id: assignment.execution_id, claim_token: assignment.claim_token } });
    const abort = new AbortController();
    const ctx = new ExecutionContext(assignment, abort.signal);
    worker._runs.set(ctx.executionId, { ctx, abort, stream: this, outcome: null });
    worker._busy += 1;
    const registered = worker._handlers.get(ctx.handler);
    const payload = fromStruct(assignment.payload);
    Promise.resolve()
      .then(() => {
        if (registered === undefined) throw new PermanentError(`handler '${ctx.handler}' is not served by this worker`);
        return registered.fn(ctx, payload);
      })
      .then(
        (result) => {
          let value;
          try {
            value = toValue(asJson(result));
          } catch (error) {
            return this.failed(ctx, error);
          }
          if (worker._report(ctx, { value })) worker.stats.succeeded += 1;
          return undefined;
        },
        (error) => this.failed(ctx, error),
      )
      .finally(() => worker._settled());
  }

  failed(ctx, error) {
    const worker = this.worker;
    if (error instanceof RateLimited) {
      worker._report(ctx, { rate_limited: { retry_after: duration(error.seconds), reason: error.reason } });
      return;
    }
    const permanent = error instanceof PermanentError;
    const message = permanent
      ? (error.message || error.name)
      : error instanceof Error ? `${error.name}: ${error.message}` : `thrown: ${String(error)}`;
    const outcome = { message: message.slice(0, MAX_ERROR_CHARS), permanent };
    if (worker._report(ctx, { error: outcome })) worker.stats.failed += 1;
  }
}

/**
 * One unary session: the stream's requests and answers, carried by calls. A long poll waits for
 * work; the acks, outcomes and credit ready are reported by a second call at once (one at a time,
 * what comes meanwhile in the next). Everything else (assignments, cancels, drain) is the stream's.
 */
class UnarySession extends Stream {
  constructor(worker, stub) {
    super(worker, stub);
    this.sessionId = '';
    this.batch = { acks: [], outcomes: [], credit: 0 };
    this.reporting = false;
    this.closing = false; // the session is being closed: a poll's NOT_FOUND is expected
    this.finish = null;
  }

  serve() {
    const worker = this.worker;
    this.metadata = new grpc.Metadata();
    if (worker._apiKey) this.metadata.set('authorization', `Bearer ${worker._apiKey}`);
    return new Promise((resolve) => {
      this.finish = (error) => {
        if (this.ended) return;
        this.ended = true;
        // Runs still going are kept: the next session resumes them (their outcomes wait).
        for (const run of worker._runs.values()) if (run.stream === this) run.stream = null;
        resolve(error);
      };
      const hello = worker._hello();
      this.offered = hello.held_runs.map((held) => held.execution_id);
      this.unary('OpenWorkerSession', { hello }, CALL_MARGIN_MS).then(
        (opened) => {
          this.sessionId = opened.session_id;
          const most = Number(opened.max_wait.seconds) * 1000 + Math.floor(opened.max_wait.nanos / 1e6);
          const waitMs = worker.pollWaitMs === null ? most : Math.max(MIN_POLL_WAIT_MS, Math.min(worker.pollWaitMs, most));
          this.on({ message: 'welcome', welcome: opened.welcome });
          this.longPolls(waitMs);
        },
        (error) => this.finish(error),
      );
    });
  }

  /** A unary call of WorkerService, as a promise (a SchedulerClientError when it fails). */
  unary(method, request, timeoutMs) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, this.metadata, { deadline: Date.now() + timeoutMs }, (error, response) => {
        if (error) reject(new SchedulerClientError(error.code, error.details));
        else resolve(response);
      });
    });
  }

  async poll(batch, waitMs) {
    const request = { session_id: this.sessionId, batch };
    if (waitMs > 0) request.wait = duration(waitMs / 1000);
    const answer = await this.unary('PollWorkerSession', request, waitMs + CALL_MARGIN_MS);
    if (!this.ended) for (const response of answer.messages) this.on(response);
  }

  async longPolls(waitMs) {
    while (!this.ended) {
      try {
        await this.poll(null, waitMs);
      } catch (error) {
        if (!this.closing) this.finish(error);
        return;
      }
    }
  }

  send(request) {
    if (this.ended || this.closing) return;
    if (request.ack) this.batch.acks.push(request.ack);
    else if (request.outcome) this.batch.outcomes.push(request.outcome);
    else if (request.credit) this.batch.credit += request.credit.grant;
    else return; // a stream's pong: a unary session has no pings
    this.flush();
  }

  /** Report what is ready in one call, unless one is in flight (then in the next). */
  flush() {
    if (this.reporting || this.ended) return;
    const batch = this.batch;
    if (batch.acks.length === 0 && batch.outcomes.length === 0 && batch.credit === 0) {
      if (this.halfClosed && !this.closing) this.close();
      return;
    }
    this.batch = { acks: [], outcomes: [], credit: 0 };
    this.reporting = true;
    this.poll(batch, 0).then(
      () => {
        this.reporting = false;
        this.flush();
      },
      (error) => {
        this.reporting = false;
        this.finish(error);
      },
    );
  }

  closeWhenIdle() {
    if (this.draining && this.worker._runs.size === 0 && !this.ended && !this.halfClosed && this.sessionId) {
      this.halfClosed = true; // the last outcomes are reported, then the session is closed
      this.flush();
    }
  }

  close() {
    this.closing = true;
    this.unary('CloseWorkerSession', { session_id: this.sessionId }, CALL_MARGIN_MS).then(
      () => this.finish(null),
      (error) => this.finish(error),
    );
  }
}

/** A handler's result as JSON (what JSON.stringify makes of it; undefined is null). */
function asJson(result) {
  if (result === undefined) return null;
  const text = JSON.stringify(result);
  return text === undefined ? null : JSON.parse(text);
}

/** Seconds as a google.protobuf.Duration. */
function duration(seconds) {
  const whole = Math.floor(seconds);
  return { seconds: String(whole), nanos: Math.min(Math.round((seconds - whole) * 1e9), 999999999) };
}

module.exports = { ExecutionContext, PermanentError, RateLimited, SDK, Worker };
