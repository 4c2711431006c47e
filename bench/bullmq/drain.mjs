// BullMQ's side of bench/bullmq_bench.py: queue `--runs` no-op jobs, then drain them with one Worker
// of `--concurrency` in this process; print one JSON line.
//
//   node bench/bullmq/drain.mjs --redis-url redis://127.0.0.1:6379/0 --runs 20000 --concurrency 200 [--valkey-pid N]
//
// executions/s: runs / (last finishedOn - first processedOn), BullMQ's own timestamps (ms), as ours
// are read from PostgreSQL's started_at / finished_at. CPU per execution: this process (the worker)
// and, with --valkey-pid, the Valkey server (/proc), from the worker's start to the last completion.
// Jobs are BullMQ's defaults (completed jobs kept in Redis), added 1,000 per addBulk before the
// worker starts, on a queue emptied first.
import { readFileSync } from "node:fs";
import { Queue, Worker } from "bullmq";
import IORedis from "ioredis";

function option(name, fallback) {
  const at = process.argv.indexOf(`--${name}`);
  return at >= 0 ? process.argv[at + 1] : fallback;
}

const url = option("redis-url", "redis://127.0.0.1:6379/0");
const runs = Number(option("runs", "20000"));
const concurrency = Number(option("concurrency", "200"));
const valkeyPid = option("valkey-pid", "");
const name = option("queue", "bench-bullmq");
const TICKS = 100; // USER_HZ: /proc/<pid>/stat counts CPU in 1/100 s on Linux

function valkeySeconds() {
  if (!valkeyPid) return null;
  const fields = readFileSync(`/proc/${valkeyPid}/stat`, "utf8").split(")").pop().trim().split(/\s+/);
  return (Number(fields[11]) + Number(fields[12])) / TICKS;
}

const connection = new IORedis(url, { maxRetriesPerRequest: null });
const queue = new Queue(name, { connection });
await queue.obliterate({ force: true });
for (let start = 0; start < runs; start += 1000) {
  const size = Math.min(1000, runs - start);
  await queue.addBulk(Array.from({ length: size }, (_, i) => ({ name: "noop", data: { n: start + i } })));
}

let completed = 0;
let firstStart = Infinity;
let lastFinish = 0;
let done;
const drained = new Promise((resolve) => {
  done = resolve;
});
const worker = new Worker(name, async () => {}, { connection, concurrency, autorun: false });
worker.on("completed", (job) => {
  completed += 1;
  firstStart = Math.min(firstStart, job.processedOn);
  lastFinish = Math.max(lastFinish, job.finishedOn);
  if (completed === runs) done();
});
worker.on("failed", (job, error) => {
  console.error(`job ${job?.id} failed: ${error}`);
  process.exit(1);
});
const cpu0 = process.cpuUsage();
const valkey0 = valkeySeconds();
worker.run();
await drained;
const cpu = process.cpuUsage(cpu0);
const valkey1 = valkeySeconds();
await worker.close();
await queue.close();
await connection.quit();
const seconds = (lastFinish - firstStart) / 1000;
console.log(
  JSON.stringify({
    runs,
    concurrency,
    bullmq: JSON.parse(readFileSync(new URL("./node_modules/bullmq/package.json", import.meta.url))).version,
    seconds,
    executions_per_s: runs / seconds,
    worker_cpu_us: ((cpu.user + cpu.system) / runs),
    valkey_cpu_us: valkey0 === null ? null : ((valkey1 - valkey0) * 1e6) / runs,
  }),
);
