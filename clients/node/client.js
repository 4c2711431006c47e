'use strict';
/**
 * Node.js client of scheduler-grpc.
 *
 * The services are loaded at run time from the .proto files of this repository (../../protos, or
 * $SCHEDULER_PROTOS) with @grpc/proto-loader: no code generation, no protoc binary.
 *
 *   const { SchedulerClient } = require('./client');
 *   const client = new SchedulerClient('127.0.0.1:50051');
 *   await client.login('admin', 'admin123');
 *   const { job } = await client.call('JobService', 'CreateJob', { job: { name: 'hi', handler: 'test.echo' } });
 *   for await (const event of client.watchExecutions({ job_ids: [job.id] })) { ... }
 *   client.close();
 *
 * Messages use the proto field names (snake_case); enums are their names
 * ('EXECUTION_STATE_SUCCEEDED'); int64 values are strings; google.protobuf.Struct/Value/Timestamp
 * have helpers below (toStruct, fromStruct, fromValue, toTimestamp, fromTimestamp).
 * Every unary call has a deadline (timeoutMs, default 10 s). Failures reject with SchedulerClientError
 * carrying the gRPC status code (`code`, a number, and `codeName`, e.g. 'NOT_FOUND').
 */

const crypto = require('node:crypto');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const DEFAULT_ADDRESS = '127.0.0.1:50051';
const DEFAULT_TIMEOUT_MS = 10000;
const MAX_TRIGGER_ITEMS = 1000; // items of one BatchTriggerJobs call at most
const PROTO_ROOT = process.env.SCHEDULER_PROTOS || path.resolve(__dirname, '..', '..', 'protos');
const PROTO_FILES = ['auth', 'jobs', 'executions', 'queue', 'cluster', 'users', 'limits', 'workers'].map((name) => `scheduler/v1/${name}.proto`);
const SERVICES = ['AuthService', 'JobService', 'ExecutionService', 'QueueService', 'ClusterService', 'UserService', 'LimitService'];
const RESUMABLE = new Set([grpc.status.UNAVAILABLE, grpc.status.RESOURCE_EXHAUSTED]);
// WatchExecutionsRequest.max_events_per_response of watchExecutions (the server's cap).
const WATCH_BATCH = 1000;

let cachedPackage = null;

/** The scheduler.v1 package (service constructors), loaded once from the .proto files. */
function loadPackage() {
  if (cachedPackage === null) {
    const definition = protoLoader.loadSync(PROTO_FILES, {
      keepCase: true, // field names as in the protos: job_ids, run_time, ...
      longs: String, // int64 as strings: no precision loss
      enums: String, // enum values by name
      defaults: true, // unset fields read as their zero value
      oneofs: true,
      includeDirs: [PROTO_ROOT],
    });
    cachedPackage = grpc.loadPackageDefinition(definition).scheduler.v1;
  }
  return cachedPackage;
}

/** A failed call: the gRPC status code and the server's message. */
class SchedulerClientError extends Error {
  constructor(code, message) {
    super(message || `call failed with status ${grpc.status[code] || code}`);
    this.name = 'SchedulerClientError';
    this.code = code;
    this.codeName = Object.keys(grpc.status).find((key) => grpc.status[key] === code) || 'UNKNOWN';
  }

  static from(error) {
    if (error instanceof SchedulerClientError) return error;
    const code = typeof error.code === 'number' ? error.code : grpc.status.UNKNOWN;
    return new SchedulerClientError(code, error.details || error.message);
  }
}

class SchedulerClient {
  /**
   * @param {string} address host:port of the server
   * @param {object} [options]
   * @param {string} [options.token] session token or API key (`login` sets it)
   * @param {boolean|grpc.ChannelCredentials} [options.tls] false: plaintext; true: TLS with system roots
   * @param {number} [options.timeoutMs] deadline of each unary call
   */
  constructor(address = DEFAULT_ADDRESS, { token = null, tls = false, timeoutMs = DEFAULT_TIMEOUT_MS } = {}) {
    const pkg = loadPackage();
    const credentials =
      tls === true ? grpc.credentials.createSsl() : tls ? tls : grpc.credentials.createInsecure();
    this.address = address;
    this.token = token;
    this.timeoutMs = timeoutMs;
    this.stubs = {};
    let channel = null;
    for (const service of SERVICES) {
      // One channel shared by every service's stub.
      const stub = new pkg[service](address, credentials, channel ? { channelOverride: channel } : {});
      channel = channel || stub.getChannel();
      this.stubs[service] = stub;
    }
  }

  close() {
    for (const stub of Object.values(this.stubs)) stub.close();
  }

  metadata() {
    const metadata = new grpc.Metadata();
    if (this.token) metadata.set('authorization', `Bearer ${this.token}`);
    return metadata;
  }

  /** Any unary RPC: call('JobService', 'GetJob', { id }) resolves with the response message. */
  call(service, method, request = {}, { timeoutMs = this.timeoutMs } = {}) {
    const stub = this.stubs[service];
    if (!stub || typeof stub[method] !== 'function') {
      return Promise.reject(new SchedulerClientError(grpc.status.UNIMPLEMENTED, `no method ${service}.${method}`));
    }
    const deadline = new Date(Date.now() + timeoutMs);
    return new Promise((resolve, reject) => {
      stub[method](request, this.metadata(), { deadline }, (error, response) => {
        if (error) reject(SchedulerClientError.from(error));
        else resolve(response);
      });
    });
  }

  // -- conveniences over `call` --

  async login(username, password) {
    const response = await this.call('AuthService', 'Login', { username, password });
    this.token = response.token;
    return response;
  }

  async createJob(job, requestId = '') {
    return (await this.call('JobService', 'CreateJob', { job, request_id: requestId })).job;
  }

  async getJob(id) {
    return (await this.call('JobService', 'GetJob', { id })).job;
  }

  async deleteJob(id) {
    await this.call('JobService', 'DeleteJob', { id });
  }

  /** Run a job now; `payload` (an object) replaces the job's for this run. */
  async triggerJob(id, requestId = '', payload = null) {
    const request = { id, request_id: requestId };
    if (payload !== null && payload !== undefined) request.payload = toStruct(payload);
    return (await this.call('JobService', 'TriggerJob', request)).execution;
  }

  /**
   * Many runs at once (BatchTriggerJobs, in calls of MAX_TRIGGER_ITEMS): one per item, a job id or
   * `{ id, requestId, payload }` (a request id is generated when missing, so a retry runs nothing
   * twice). Resolves with one result per item, in order: `{ execution }`, or `{ error }` (a
   * SchedulerClientError: e.g. NOT_FOUND for a job that does not exist; the other items ran).
   * Rejects with INVALID_ARGUMENT naming an invalid item by its index (`requests[1042].payload.n`);
   * nothing of that item's call ran (calls before it did).
   */
  async batchTriggerJobs(items, { timeoutMs = this.timeoutMs } = {}) {
    const requests = items.map((item) => {
      const { id, requestId = '', payload = null } = typeof item === 'string' ? { id: item } : item;
      const request = { id, request_id: requestId || crypto.randomUUID() };
      if (payload !== null && payload !== undefined) request.payload = toStruct(payload);
      return request;
    });
    const results = [];
    for (let offset = 0; offset < requests.length; offset += MAX_TRIGGER_ITEMS) {
      let response;
      try {
        response = await this.call('JobService', 'BatchTriggerJobs',
          { requests: requests.slice(offset, offset + MAX_TRIGGER_ITEMS) }, { timeoutMs });
      } catch (error) {
        const found = /^requests\[(\d+)\]/.exec(error.message);
        if (offset === 0 || error.code !== grpc.status.INVALID_ARGUMENT || found === null) throw error;
        const message = `requests[${Number(found[1]) + offset}]${error.message.slice(found[0].length)}`;
        throw new SchedulerClientError(error.code, message);
      }
      for (const result of response.results) {
        results.push(result.code === 0 ? { execution: result.execution } : { error: new SchedulerClientError(result.code, result.message) });
      }
    }
    return results;
  }

  async getExecution(id) {
    return (await this.call('ExecutionService', 'GetExecution', { id })).execution;
  }

  /**
   * A queue's shard counts (default 'default'): { queue, shards (in effect now), served_shards,
   * changes: [{ shards, effective_time }] } (effective_time a Timestamp: `fromTimestamp`).
   */
  async getQueueShards(queue = '') {
    return this.call('QueueService', 'GetQueueShards', { queue });
  }

  /** The queues whose shard count was ever set, by name: every page, as one array. */
  async listQueueShards({ pageSize = 0 } = {}) {
    const queues = [];
    let pageToken = '';
    do {
      const response = await this.call('QueueService', 'ListQueueShards', { page_size: pageSize, page_token: pageToken });
      queues.push(...response.queues);
      pageToken = response.next_page_token;
    } while (pageToken);
    return queues;
  }

  /**
   * Give `queue` `shards` shards (1 to 64) for the runs made from the server's
   * SCHEDULER_QUEUE_SHARD_LEAD after now on (admin). Resolves with the change: { shards,
   * effective_time }. Bad input rejects with INVALID_ARGUMENT naming the field (`shards: ...`).
   */
  async setQueueShards(queue, shards) {
    return (await this.call('QueueService', 'SetQueueShards', { queue, shards })).change;
  }

  /**
   * Execution events as an async iterator. The stream is reopened from the last event's cursor
   * when it breaks with UNAVAILABLE or RESOURCE_EXHAUSTED (after `maxReconnects` failures in a row
   * without an event, the error is thrown). `onOpen(call)` is called with each new call.
   *
   * @param {object} request WatchExecutionsRequest: { job_ids, types, handler, cursor, flow_run_id }
   */
  async *watchExecutions(request = {}, { maxReconnects = 10, reconnectDelayMs = 100, onOpen = null } = {}) {
    // Batched (max_events_per_response): the server sends what is ready in one message; yielded
    // here one event at a time, each with its own cursor.
    const current = { job_ids: [], types: [], handler: '', cursor: '', max_events_per_response: WATCH_BATCH, ...request };
    let failures = 0;
    let delay = reconnectDelayMs;
    for (;;) {
      const call = this.stubs.ExecutionService.WatchExecutions(current, this.metadata());
      if (onOpen) onOpen(call);
      try {
        for await (const response of call) {
          failures = 0;
          delay = reconnectDelayMs;
          // `event`: a server older than batching (it ignores max_events_per_response).
          const events = response.events && response.events.length ? response.events : [response.event];
          for (const event of events) {
            if (event.cursor) current.cursor = event.cursor;
            yield event;
          }
        }
        return; // the server ended the stream
      } catch (error) {
        if (!RESUMABLE.has(error.code) || failures >= maxReconnects) throw SchedulerClientError.from(error);
        failures += 1;
      } finally {
        call.on('error', () => {}); // the cancellation below reports CANCELLED: nobody listens any more
        call.cancel();
      }
      await new Promise((resolve) => setTimeout(resolve, delay));
      delay = Math.min(delay * 2, 2000);
    }
  }
}

// -- well-known types ---------------------------------------------------------------------------

// protobufjs defines the google.protobuf types itself, with camelCase field names (numberValue, ...).

/** A JS value as a google.protobuf.Value. */
function toValue(value) {
  if (value === null || value === undefined) return { nullValue: 'NULL_VALUE' };
  if (typeof value === 'number') return { numberValue: value };
  if (typeof value === 'string') return { stringValue: value };
  if (typeof value === 'boolean') return { boolValue: value };
  if (Array.isArray(value)) return { listValue: { values: value.map(toValue) } };
  if (typeof value === 'object') return { structValue: toStruct(value) };
  throw new TypeError(`not representable as JSON: ${typeof value}`);
}

/** A plain object as a google.protobuf.Struct. */
function toStruct(object) {
  const fields = {};
  for (const [key, value] of Object.entries(object || {})) fields[key] = toValue(value);
  return { fields };
}

/** A google.protobuf.Value (as loaded) as a JS value. */
function fromValue(value) {
  if (!value) return null;
  switch (value.kind) {
    case 'numberValue':
      return value.numberValue;
    case 'stringValue':
      return value.stringValue;
    case 'boolValue':
      return value.boolValue;
    case 'structValue':
      return fromStruct(value.structValue);
    case 'listValue':
      return (value.listValue.values || []).map(fromValue);
    default:
      return null;
  }
}

/** A google.protobuf.Struct (as loaded) as a plain object. */
function fromStruct(struct) {
  const object = {};
  for (const [key, value] of Object.entries((struct && struct.fields) || {})) object[key] = fromValue(value);
  return object;
}

/** A Date as a google.protobuf.Timestamp. */
function toTimestamp(date) {
  const ms = date.getTime();
  return { seconds: String(Math.floor(ms / 1000)), nanos: (((ms % 1000) + 1000) % 1000) * 1e6 };
}

/** A google.protobuf.Timestamp (as loaded) as a Date, or null when unset. */
function fromTimestamp(stamp) {
  if (!stamp) return null;
  const seconds = Number(stamp.seconds || 0);
  const nanos = Number(stamp.nanos || 0);
  if (seconds === 0 && nanos === 0) return null;
  return new Date(seconds * 1000 + Math.floor(nanos / 1e6));
}

module.exports = {
  DEFAULT_ADDRESS,
  DEFAULT_TIMEOUT_MS,
  MAX_TRIGGER_ITEMS,
  SchedulerClient,
  SchedulerClientError,
  loadPackage,
  grpc,
  toStruct,
  toValue,
  fromStruct,
  fromValue,
  toTimestamp,
  fromTimestamp,
};
