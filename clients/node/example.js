'use strict';
/**
 * Logs in, creates a job, triggers it and watches it finish, printing each step.
 *
 *   SCHEDCTL_SERVER=127.0.0.1:50051 node example.js
 *
 * Environment: SCHEDCTL_SERVER (default 127.0.0.1:50051), SCHEDCTL_USERNAME / SCHEDCTL_PASSWORD
 * (default admin / admin123, the dev admin), EXAMPLE_TIMEOUT_MS (default 30000).
 * Exits 0 once the execution's SUCCEEDED event arrived; 1 on a failure or timeout.
 */

const { SchedulerClient, toStruct, fromValue } = require('./client');

const address = process.env.SCHEDCTL_SERVER || '127.0.0.1:50051';
const username = process.env.SCHEDCTL_USERNAME || 'admin';
const password = process.env.SCHEDCTL_PASSWORD || 'admin123';
const timeoutMs = Number(process.env.EXAMPLE_TIMEOUT_MS || 30000);
const FAILED = new Set(['EVENT_TYPE_FAILED', 'EVENT_TYPE_TIMED_OUT', 'EVENT_TYPE_DEAD', 'EVENT_TYPE_CANCELLED']);

function step(text) {
  console.log(`[${new Date().toISOString()}] ${text}`);
}

/** Resolves after `ms`, or earlier when `emitter` emits `event`. */
function firstOf(emitter, event, ms) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    emitter.once(event, () => {
      clearTimeout(timer);
      resolve();
    });
  });
}

async function main() {
  const client = new SchedulerClient(address);
  let job = null;
  try {
    const login = await client.login(username, password);
    step(`logged in to ${address} as ${username} (${login.role})`);

    job = await client.createJob({
      name: `node-example-${Date.now()}`,
      handler: 'test.echo',
      payload: toStruct({ from: 'the Node.js example' }),
    });
    step(`created job ${job.name} (${job.id})`);

    // Subscribe before triggering, so the execution's events cannot pass unseen.
    let opened = null;
    const events = client.watchExecutions({ job_ids: [job.id] }, { onOpen: (call) => (opened = call) });
    const first = events.next(); // starts the call
    // The server sends its response headers (with the starting cursor) once the subscription is live.
    await firstOf(opened, 'metadata', 5000);
    step('watching the job\'s execution events');

    const execution = await client.triggerJob(job.id, `node-example-${job.id}`);
    step(`triggered: execution ${execution.id} (${execution.state})`);

    const deadline = setTimeout(() => {
      console.error(`example: no SUCCEEDED event for execution ${execution.id} within ${timeoutMs} ms`);
      process.exit(1);
    }, timeoutMs);
    try {
      let next = await first;
      while (!next.done) {
        const event = next.value;
        step(`event ${event.type} execution ${event.execution_id} attempt ${event.attempt}` +
          (event.worker_id ? ` on ${event.worker_id}` : '') + (event.error ? `: ${event.error}` : ''));
        if (event.execution_id === execution.id && event.type === 'EVENT_TYPE_SUCCEEDED') {
          const done = await client.getExecution(execution.id);
          step(`result ${JSON.stringify(fromValue(done.result))}`);
          console.log(`OK: execution ${execution.id} of job ${job.name} SUCCEEDED`);
          return 0;
        }
        if (event.run_id === execution.run_id && FAILED.has(event.type)) {
          console.error(`example: execution ${event.execution_id} ${event.type}: ${event.error}`);
          return 1;
        }
        next = await events.next();
      }
      console.error('example: the event stream ended before the execution finished');
      return 1;
    } finally {
      clearTimeout(deadline);
      await events.return();
    }
  } finally {
    if (job !== null) {
      try {
        await client.deleteJob(job.id);
        step(`deleted job ${job.name}`);
      } catch (error) {
        console.error(`example: could not delete job ${job.name}: ${error.message}`);
      }
    }
    client.close();
  }
}

main().then(
  (code) => process.exit(code),
  (error) => {
    console.error(`example: ${error.codeName ? `${error.codeName}: ` : ''}${error.message}`);
    process.exit(1);
  },
);
