'use strict';
/**
 * A Node.js SDK remote worker (clients/node/worker.js) for tests/test_remote_worker_node.py, in a
 * process of its own. It serves `remote.noop`:
 *
 * - a payload with `hold: true`: prints `held <execution id>` and waits for `ctx.signal` to abort,
 *   then prints `aborted <execution id> <reason>` and throws;
 * - a payload with `gate: true`: prints `gated <execution id>`, waits for SIGUSR2, prints
 *   `finished <execution id>` and returns `{attempt}`;
 * - any other payload: returns `{attempt, ok}` (`ok`: the payload equals $EXPECT_PAYLOAD, JSON).
 *
 * With WORKER_TRANSPORT=unary it serves over the unary transport (polls) instead of a stream.
 * It prints `connected <worker id>` on each welcome, `resumed <execution ids, comma-separated>` when
 * a new stream resumed runs, and on SIGTERM stops (the SDK's `stop()`), then
 * prints `stats <json>` (the SDK's counts and how many distinct executions the handler saw).
 *
 *   node tests/remote_worker_node.js TARGET KEY QUEUE SLOTS
 */

const path = require('node:path');
const { isDeepStrictEqual } = require('node:util');
const { Worker } = require(path.join(__dirname, '..', 'clients', 'node', 'worker'));

const [target, apiKey, queue, slots] = process.argv.slice(2);
const expected = process.env.EXPECT_PAYLOAD ? JSON.parse(process.env.EXPECT_PAYLOAD) : null;
const seen = new Set();
let calls = 0;

const transport = process.env.WORKER_TRANSPORT || 'stream';
const worker = new Worker({ target, apiKey, queue, slots: Number(slots), reconnectMaxMs: 1000, transport });
worker.on('connected', (id) => console.log(`connected ${id}`));
worker.on('resumed', (ids) => console.log(`resumed ${ids.join(',')}`));
worker.on('disconnected', (error) => console.log(`disconnected ${error ? error.codeName : 'OK'}`));
let openGate;
const gate = new Promise((resolve) => {
  openGate = resolve;
});
process.on('SIGUSR2', () => openGate());

worker.handler('remote.noop', { description: 'a no-op, or a hold until cancelled' }, async (ctx, payload) => {
  calls += 1;
  seen.add(ctx.executionId);
  if (payload.gate) {
    console.log(`gated ${ctx.executionId}`);
    await gate;
    console.log(`finished ${ctx.executionId}`);
    return { attempt: ctx.attempt };
  }
  if (payload.hold) {
    console.log(`held ${ctx.executionId}`);
    await new Promise((resolve) => ctx.signal.addEventListener('abort', resolve, { once: true }));
    console.log(`aborted ${ctx.executionId} ${ctx.signal.reason.message}`);
    throw ctx.signal.reason;
  }
  return { attempt: ctx.attempt, ok: expected === null || isDeepStrictEqual(payload, expected) };
});

process.on('SIGTERM', () => worker.stop());

worker.run().then(
  () => {
    console.log(`stats ${JSON.stringify({ ...worker.stats, calls, distinct: seen.size })}`);
    process.exit(0);
  },
  (error) => {
    console.error(`worker failed: ${error.codeName || ''} ${error.message}`);
    process.exit(2);
  },
);
