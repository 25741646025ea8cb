import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { createConnection } from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { expect } from 'chai';
import { Queue } from 'bullmq';
import { Redis } from 'ioredis';
import { TINY_MODEL_ALIAS } from '../../scripts/stack.js';
import { processTree } from '../../workers/stats.js';
import { needDependency } from '../helpers/deps.js';
import { freePort, PYTHON } from './server.js';

/**
 * What an operator sees, against one stack started the way a user starts it (`npm start`, with
 * its own Redis started by the launcher): after a real SDK run, /metrics holds the per-op series
 * with the counts and token totals of that run; the CLI's status, agents, models and futures print
 * the same facts; the /admin dashboard loads in headless Chromium behind the API key; the OpenAPI
 * document covers every route; and SIGTERM to the npm process leaves nothing running.
 */
const KEY = 'tml-ops-key';
const CHROMIUM = '/usr/bin/chromium';

function parseProm(text: string): { name: string; labels: Record<string, string>; value: number }[] {
  const out: { name: string; labels: Record<string, string>; value: number }[] = [];
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const m = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$/.exec(line);
    if (!m) throw new Error(`not a Prometheus sample line: ${line}`);
    const labels: Record<string, string> = {};
    for (const l of (m[2] ?? '').matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]!] = l[2]!;
    out.push({ name: m[1]!, labels, value: Number(m[3]) });
  }
  return out;
}

/** Running (a zombie waiting to be reaped counts as gone: it holds no port, memory or GPU). */
const alive = (pid: number) => {
  const r = spawnSync('cat', [`/proc/${pid}/stat`], { encoding: 'utf8' });
  if (r.status !== 0) return false;
  return r.stdout.slice(r.stdout.lastIndexOf(')') + 2, r.stdout.lastIndexOf(')') + 3) !== 'Z';
};

const portOpen = (port: number) =>
  new Promise<boolean>((resolve) => {
    const s = createConnection({ host: '127.0.0.1', port }, () => {
      s.destroy();
      resolve(true);
    });
    s.on('error', () => resolve(false));
  });

describe('operations: metrics, CLI, dashboard, OpenAPI and SIGTERM on a stack started with npm start', function () {
  this.timeout(600_000);
  const tmp = mkdtempSync(path.join(os.tmpdir(), 'tb-ops-'));
  let port = 0;
  let redisPort = 0;
  let npm: ChildProcess | null = null;
  let log = '';
  let env: NodeJS.ProcessEnv = {};
  let sdk: { model_id: string; ops: Record<string, number>; trained_tokens: number; sampled_tokens: number };
  const base = () => `http://127.0.0.1:${port}`;
  const cli = (...args: string[]) => spawnSync(process.execPath, ['--import', 'tsx', 'scripts/tinker-broker.ts', ...args], { env, encoding: 'utf8' });

  before(async () => {
    port = await freePort();
    redisPort = await freePort();
    mkdirSync(path.join(tmp, 'redis'));
    env = {
      ...process.env,
      TB_LOG_LEVEL: 'info',
      TB_PORT: String(port),
      TB_PREFIX: 'ops',
      // A Redis URL where nothing answers: the launcher starts its own redis-server there.
      REDIS_URL: `redis://127.0.0.1:${redisPort}`,
      TB_REDIS_DIR: path.join(tmp, 'redis'),
      TB_STORAGE_DIR: path.join(tmp, 'storage'),
      TB_API_KEYS: KEY,
      TB_AGENT_ID: 'ops-agent',
    };
    // detached: its own process group, so that cleanup after a failed test can reach every process.
    npm = spawn('npm', ['start'], { env, stdio: ['ignore', 'pipe', 'pipe'], detached: true });
    npm.stdout!.on('data', (d) => (log += d));
    npm.stderr!.on('data', (d) => (log += d));
    const deadline = Date.now() + 180_000;
    for (;;) {
      if (npm.exitCode !== null) throw new Error(`npm start exited early:\n${log}`);
      const r = await fetch(`${base()}/healthz`).catch(() => null);
      if (r?.status === 200) break;
      if (Date.now() > deadline) throw new Error(`not ready:\n${log}`);
      await new Promise((r) => setTimeout(r, 250));
    }
  });

  after(() => {
    if (npm?.pid && alive(npm.pid)) {
      try {
        process.kill(-npm.pid, 'SIGKILL');
      } catch {
        /* gone */
      }
    }
    rmSync(tmp, { recursive: true, force: true });
  });

  it('runs an SDK session', () => {
    const r = spawnSync(PYTHON, ['test/e2e/sdk_ops.py', TINY_MODEL_ALIAS], {
      env: { ...process.env, TINKER_BASE_URL: base(), TINKER_API_KEY: KEY, HF_HUB_OFFLINE: '1' },
      encoding: 'utf8',
      timeout: 300_000,
    });
    expect(r.status, `${r.stderr}\n--- server ---\n${log.slice(-3000)}`).to.equal(0);
    sdk = JSON.parse(r.stdout.trim().split('\n').pop()!);
    expect(sdk.trained_tokens).to.be.greaterThan(10);
    expect(sdk.sampled_tokens).to.be.within(3, 24);
  });

  it('/metrics has per-op counts, latency histograms by phase, tokens, queues, agents and engine memory', async () => {
    const res = await fetch(`${base()}/metrics`);
    expect(res.status).to.equal(200);
    expect(res.headers.get('content-type')).to.match(/^text\/plain/);
    const samples = parseProm(await res.text());
    const one = (name: string, labels: Record<string, string>) => {
      const found = samples.filter((s) => s.name === name && Object.entries(labels).every(([k, v]) => s.labels[k] === v));
      expect(found, `${name} ${JSON.stringify(labels)}`).to.have.length(1);
      return found[0]!.value;
    };
    for (const [op, n] of Object.entries(sdk.ops)) {
      expect(one('tb_jobs_total', { op, status: 'ok' }), op).to.equal(n);
      const sums: Record<string, number> = {};
      for (const phase of ['queue_wait', 'engine', 'total']) {
        expect(one('tb_job_duration_seconds_count', { op, phase }), `${op} ${phase}`).to.equal(n);
        expect(one('tb_job_duration_seconds_bucket', { op, phase, le: '+Inf' })).to.equal(n);
        // Cumulative buckets never decrease.
        const buckets = samples.filter((s) => s.name === 'tb_job_duration_seconds_bucket' && s.labels.op === op && s.labels.phase === phase).map((s) => s.value);
        for (let i = 1; i < buckets.length; i++) expect(buckets[i]).to.be.at.least(buckets[i - 1]!);
        sums[phase] = one('tb_job_duration_seconds_sum', { op, phase });
      }
      // Each job's total is its wait plus its engine time, to the millisecond, and every op took under two minutes.
      expect(sums.total).to.be.closeTo(sums.queue_wait! + sums.engine!, 0.002 * n);
      expect(sums.total! / n).to.be.within(0, 120);
      expect(sums.engine, op).to.be.greaterThan(0);
    }
    // The engine does real work for a forward_backward: more than 100 µs each.
    expect(one('tb_job_duration_seconds_sum', { op: 'forward_backward', phase: 'engine' }) / 3).to.be.greaterThan(1e-4);
    expect(one('tb_tokens_total', { kind: 'trained' })).to.equal(sdk.trained_tokens);
    expect(one('tb_tokens_total', { kind: 'sampled' })).to.equal(sdk.sampled_tokens);
    expect(one('tb_tokens_per_second', { kind: 'trained' })).to.be.within(0, sdk.trained_tokens);
    expect(one('tb_agents_alive', {})).to.equal(1);
    const rss = one('tb_agent_engine_rss_bytes', { agent: 'ops-agent', engine: 'torch', device: 'cpu' });
    expect(rss).to.be.within(50 * 2 ** 20, 16 * 2 ** 30); // a Python process with torch loaded
    expect(samples.some((s) => s.name === 'tb_agent_gpu_memory_bytes')).to.equal(false);
    expect(one('tb_queue_jobs', { queue: 'train-ops-agent', state: 'completed' })).to.equal(1 + 3 + 3 + 1);
    expect(one('tb_queue_jobs', { queue: 'train-ops-agent', state: 'waiting' })).to.equal(0);
    expect(samples.some((s) => s.name === 'process_resident_memory_bytes')).to.equal(true);
  });

  it('the CLI prints status, agents, models and a future of the running stack', async () => {
    const status = cli('status');
    expect(status.status, status.stderr).to.equal(0);
    expect(status.stdout).to.match(new RegExp(`api +http://127.0.0.1:${port}/api/v1 ready`));
    expect(status.stdout).to.match(/agents +1 alive: ops-agent \(torch, cpu\)/);
    expect(status.stdout).to.match(/models +1 training model, 1 session/);
    expect(status.stdout).to.match(/^train-ops-agent +0 +0 +0 +8 +0$/m);
    expect(status.stdout).to.match(new RegExp(`^tokens +sampled ${sdk.sampled_tokens} \\(.*\\), trained ${sdk.trained_tokens} \\(`, 'm'));
    expect(status.stdout).to.match(/^forward_backward +3 +0 +0 +\d+ ms +\d+ ms +\d+ ms$/m);
    const sj = JSON.parse(cli('status', '--json').stdout);
    const fbStat = sj.ops.find((o: { op: string }) => o.op === 'forward_backward');
    expect(fbStat).to.include({ ok: 3, user_errors: 0, server_errors: 0 });
    expect(fbStat.mean_ms.total).to.be.closeTo(fbStat.mean_ms.queue_wait + fbStat.mean_ms.engine, 1);

    const agents = JSON.parse(cli('agents', '--json').stdout);
    expect(agents).to.have.length(1);
    expect(agents[0]).to.include({ agent_id: 'ops-agent', alive: true, engine: 'torch', device: 'cpu' });
    expect(agents[0].stats.engine_rss_bytes).to.be.greaterThan(50 * 2 ** 20);
    expect(cli('agents').stdout).to.match(/^ops-agent +yes +torch +cpu +tiny-qwen3 +\d+ MiB +- /m);

    const models = cli('models');
    expect(models.status, models.stderr).to.equal(0);
    expect(models.stdout).to.include(sdk.model_id);
    expect(models.stdout).to.match(new RegExp(`${sdk.model_id} +\\S+tiny-qwen3 +4 +ops-agent .* loaded$`, 'm'));

    // The first optim_step of the model, looked up by its request id.
    const redis = new Redis(env.REDIS_URL!);
    const q = new Queue('train-ops-agent', { connection: redis, prefix: 'ops-bull' });
    try {
      const jobs = (await q.getJobs(['completed'])).filter((j) => j.name === 'optim_step').sort((a, b) => a.timestamp - b.timestamp);
      const job = jobs[0]!;
      const f = JSON.parse(cli('futures', `train-ops-agent/${job.id}`, '--json').stdout);
      expect(f).to.include({ state: 'completed', op: 'optim_step', model_id: sdk.model_id, seq_id: job.data.seq_id });
      expect(f.total_ms).to.equal(job.finishedOn! - job.timestamp);
      expect(f.queue_wait_ms + f.engine_ms).to.equal(f.total_ms);
      expect(cli('futures', 'train-ops-agent/t-nope-1').stdout).to.match(/state +unknown/);
      const bad = cli('futures', 'not a request id');
      expect(bad.status).to.equal(2);
      expect(bad.stderr.trim().split('\n')).to.have.length(1);
    } finally {
      await q.close();
      redis.disconnect();
    }
  });

  it('the dashboard at /admin asks for the API key and loads in headless Chromium', async function () {
    expect((await fetch(`${base()}/admin`)).status).to.equal(401);
    const wrong = await fetch(`${base()}/admin`, { headers: { authorization: `Basic ${Buffer.from('x:tml-wrong').toString('base64')}` } });
    expect(wrong.status).to.equal(401);
    needDependency(this, existsSync(CHROMIUM), `${CHROMIUM} (apt-get install chromium)`);
    const { chromium } = await import('playwright-core');
    const profile = mkdtempSync(path.join(tmp, 'chromium-'));
    const browser = await chromium.launchPersistentContext(profile, {
      executablePath: CHROMIUM,
      headless: true,
      args: ['--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync'],
      httpCredentials: { username: 'operator', password: KEY },
      viewport: { width: 1280, height: 800 },
    });
    try {
      const page = await browser.newPage();
      const resp = await page.goto(`${base()}/admin`, { waitUntil: 'networkidle' });
      expect(resp?.status()).to.equal(200);
      await page.getByText('train-ops-agent').first().waitFor({ timeout: 30_000 });
      expect(await page.title()).to.include('tinker-broker');
      const shot = process.env.TB_SCREENSHOT ?? path.join(tmp, 'admin.png');
      await page.screenshot({ path: shot });
      // A queue's page lists its completed jobs.
      await page.goto(`${base()}/admin/queue/train-ops-agent?status=completed`, { waitUntil: 'networkidle' });
      await page.getByText('optim_step').first().waitFor({ timeout: 30_000 });
      if (process.env.TB_SCREENSHOT) await page.screenshot({ path: process.env.TB_SCREENSHOT.replace(/\.png$/, '-queue.png') });
    } finally {
      await browser.close();
    }
  });

  it('serves the OpenAPI document without an API key', async () => {
    const res = await fetch(`${base()}/api/v1/openapi.json`);
    expect(res.status).to.equal(200);
    expect((await res.json()).paths['/asample'].post.requestBody.content['application/json'].schema.properties.num_samples).to.include({ type: 'integer' });
  });

  it('logs carry request ids, and every reply names its request id', async () => {
    const r = await fetch(`${base()}/api/v1/create_model`, {
      method: 'POST',
      headers: { 'x-api-key': KEY, 'content-type': 'application/json', 'x-request-id': 'ops-test-req-1' },
      body: '{}',
    });
    expect(r.status).to.equal(400);
    expect(r.headers.get('x-request-id')).to.equal('ops-test-req-1');
    await new Promise((res) => setTimeout(res, 200));
    expect(log).to.match(/info +http .*requestId=ops-test-req-1 .*path=\/api\/v1\/create_model status=400/);
  });

  it('SIGTERM to the npm start process stops the API, agent, engine and its Redis, leaving nothing running', async () => {
    const pids = await processTree([npm!.pid!]);
    const cmdlines = pids.map((p) => spawnSync('cat', [`/proc/${p}/cmdline`], { encoding: 'utf8' }).stdout.replace(/\0/g, ' '));
    expect(cmdlines.some((c) => c.includes('tinker_engine')), cmdlines.join('\n')).to.equal(true);
    expect(cmdlines.some((c) => c.includes('redis-server')), cmdlines.join('\n')).to.equal(true);
    const exited = new Promise<number | null>((resolve) => npm!.once('exit', (code) => resolve(code)));
    process.kill(npm!.pid!, 'SIGTERM');
    const code = await Promise.race([exited, new Promise<'timeout'>((r) => setTimeout(() => r('timeout'), 60_000))]);
    expect(code, log.slice(-3000)).to.equal(0);
    const deadline = Date.now() + 10_000;
    while (pids.some(alive) && Date.now() < deadline) await new Promise((r) => setTimeout(r, 100));
    expect(pids.filter(alive), 'processes left running').to.deep.equal([]);
    expect(await portOpen(port), 'API port still open').to.equal(false);
    expect(await portOpen(redisPort), 'Redis port still open').to.equal(false);
    expect(log).to.match(/stopping .*signal=SIGTERM/);
  });
});

describe('npx tinker-broker start stops on SIGTERM to npx', function () {
  this.timeout(180_000);
  it('leaves no process running (npm forwards the signal to a shell that does not pass it on; start watches its parent)', async () => {
    const tmp = mkdtempSync(path.join(os.tmpdir(), 'tb-npx-'));
    const port = await freePort();
    const redisPort = await freePort();
    mkdirSync(path.join(tmp, 'redis'));
    const env = {
      ...process.env,
      TB_LOG_LEVEL: 'info',
      TB_PORT: String(port),
      TB_PREFIX: 'npx',
      REDIS_URL: `redis://127.0.0.1:${redisPort}`,
      TB_REDIS_DIR: path.join(tmp, 'redis'),
      TB_STORAGE_DIR: path.join(tmp, 'storage'),
      TB_API_KEYS: KEY,
    };
    const npx = spawn('npx', ['tinker-broker', 'start', '--api-only'], { env, stdio: ['ignore', 'pipe', 'pipe'], detached: true });
    let log = '';
    npx.stdout!.on('data', (d) => (log += d));
    npx.stderr!.on('data', (d) => (log += d));
    try {
      const deadline = Date.now() + 120_000;
      while (!(await portOpen(port))) {
        if (npx.exitCode !== null || Date.now() > deadline) throw new Error(`not listening:\n${log}`);
        await new Promise((r) => setTimeout(r, 250));
      }
      const pids = await processTree([npx.pid!]);
      const exited = new Promise((resolve) => npx.once('exit', resolve));
      process.kill(npx.pid!, 'SIGTERM');
      await exited;
      const until = Date.now() + 30_000;
      while (pids.some(alive) && Date.now() < until) await new Promise((r) => setTimeout(r, 100));
      expect(pids.filter(alive), `left running:\n${log}`).to.deep.equal([]);
      expect(await portOpen(port)).to.equal(false);
      expect(await portOpen(redisPort)).to.equal(false);
    } finally {
      try {
        process.kill(-npx.pid!, 'SIGKILL');
      } catch {
        /* gone */
      }
      rmSync(tmp, { recursive: true, force: true });
    }
  });
});
