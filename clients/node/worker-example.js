'use strict';
/**
 * A remote worker serving `acme.sync` runs from the `remote` queue until Ctrl-C (or SIGTERM), when it
 * finishes what runs and exits.
 *
 *   SCHEDULER_WORKER_KEY=sk_... SCHEDCTL_SERVER=127.0.0.1:50051 node worker-example.js
 *
 * The key is an API key of the `worker` role (the console's API keys page, or
 * AuthService.CreateApiKey). Jobs of `acme.sync` go on the `remote` queue ($WORKER_QUEUE).
 */

const { setTimeout: sleep } = require('node:timers/promises');
const { Worker, PermanentError } = require('./worker');

const worker = new Worker({
  target: process.env.SCHEDCTL_SERVER || '127.0.0.1:50051',
  apiKey: process.env.SCHEDULER_WORKER_KEY,
  slots: 20,
  queue: process.env.WORKER_QUEUE || 'remote',
});

worker.handler('acme.sync', { description: 'sync one account' }, async (ctx, payload) => {
  if (!payload.account) throw new PermanentError('payload.account is required'); // no retry
  if (payload.busy) ctx.retryAfter(30); // back to the queue, no attempt spent
  await sleep(payload.ms || 10, null, { signal: ctx.signal }); // the work; a cancel aborts it
  return { synced: payload.account, attempt: ctx.attempt };
});

worker.on('connected', (id) => console.log(`serving acme.sync as ${id}`));
for (const name of ['SIGINT', 'SIGTERM']) process.on(name, () => worker.stop());
worker.run().then(
  () => console.log('stopped'),
  (error) => {
    console.error(`worker: ${error.codeName || ''} ${error.message}`);
    process.exit(1);
  },
);
