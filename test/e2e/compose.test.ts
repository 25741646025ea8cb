import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { expect } from 'chai';
import YAML from 'yaml';
import { deletePrefix, REDIS_URL } from '../helpers/stack.js';
import { E2E_KEY, freePort, PYTHON } from './server.js';

/**
 * docker-compose.yml: `compose config` validates it, and the commands its api and agent services
 * run are started here directly, as separate processes (no Docker engine on this machine), with
 * the CPU preset in place of the GPU one; an unchanged SDK loop then trains through them.
 */
function composeConfig(env: NodeJS.ProcessEnv): { status: number | null; stdout: string; stderr: string } {
  const v2 = spawnSync('docker', ['compose', 'version'], { encoding: 'utf8' });
  const [cmd, args] = v2.status === 0 ? ['docker', ['compose', 'config']] : ['docker-compose', ['config']];
  return spawnSync(cmd, args as string[], { encoding: 'utf8', env: { ...process.env, ...env } });
}

describe('docker-compose.yml', function () {
  this.timeout(300_000);
  const prefix = `compose-${randomUUID().slice(0, 8)}`;
  const storage = mkdtempSync(path.join(os.tmpdir(), 'tb-compose-'));
  const procs: ChildProcess[] = [];
  let log = '';
  after(async () => {
    for (const p of procs) if (p.exitCode === null) p.kill('SIGTERM');
    await Promise.all(procs.map((p) => (p.exitCode === null ? new Promise((r) => p.once('exit', r)) : undefined)));
    await deletePrefix(prefix);
    rmSync(storage, { recursive: true, force: true });
  });

  it('passes compose config: Redis with AOF and noeviction, healthchecks, one GPU per agent service', () => {
    const r = composeConfig({});
    expect(r.status, r.stderr).to.equal(0);
    const cfg = YAML.parse(r.stdout);
    expect(cfg.services.redis.command).to.include.members(['--appendonly', 'yes', '--appendfsync', 'everysec', '--maxmemory-policy', 'noeviction']);
    expect(cfg.services.redis.healthcheck).to.be.an('object');
    expect(cfg.services.api.depends_on.redis.condition).to.equal('service_healthy');
    expect(cfg.services.api.healthcheck).to.be.an('object');
    expect(cfg.services['agent-gpu0'].deploy.resources.reservations.devices[0].device_ids).to.deep.equal(['0']);
    expect(Object.keys(cfg.volumes)).to.include.members(['redis-data', 'storage']);
  });

  it("runs the api and agent services' commands as separate processes, and an SDK loop trains through them", async () => {
    const cfg = YAML.parse(composeConfig({ TB_PRESET: 'presets/cpu/tiny.yaml' }).stdout);
    const port = await freePort();
    const env = { ...process.env, REDIS_URL, TB_PREFIX: prefix, TB_STORAGE_DIR: storage, TB_API_KEYS: E2E_KEY, TB_LOG_LEVEL: 'warn' };
    const run = (service: string, extra: NodeJS.ProcessEnv) => {
      const [cmd, ...args] = cfg.services[service].command as string[];
      // The service's own command, but its GPU-preset agent id is the CPU preset's.
      const fixed = args.map((a) => (a === 'gpu0' ? 'local-0' : a));
      const p = spawn(cmd === 'node' ? process.execPath : cmd!, fixed, { env: { ...env, ...extra }, stdio: ['ignore', 'pipe', 'pipe'] });
      p.stdout!.on('data', (d) => (log += d));
      p.stderr!.on('data', (d) => (log += d));
      procs.push(p);
      return p;
    };
    expect(cfg.services.api.command).to.include('--api-only');
    expect(cfg.services['agent-gpu0'].command).to.include('--agents-only');
    run('api', { TB_HOST: '127.0.0.1', TB_PORT: String(port) });
    run('agent-gpu0', { TB_ENGINE_DEVICE: 'cpu' });
    const base = `http://127.0.0.1:${port}`;
    const deadline = Date.now() + 120_000;
    for (;;) {
      if (procs.some((p) => p.exitCode !== null)) throw new Error(`a service exited:\n${log}`);
      const r = await fetch(`${base}/healthz`).catch(() => null);
      if (r?.status === 200) break;
      if (Date.now() > deadline) throw new Error(`not ready:\n${log}`);
      await new Promise((res) => setTimeout(res, 250));
    }
    const loop = spawnSync(PYTHON, ['test/e2e/sdk_train_loop.py', 'tiny-qwen3', 'pipelined', '10'], {
      env: { ...process.env, TINKER_BASE_URL: base, TINKER_API_KEY: E2E_KEY },
      encoding: 'utf8',
    });
    expect(loop.status, `${loop.stderr}\n${log}`).to.equal(0);
    const out = JSON.parse(loop.stdout.trim().split('\n').pop()!);
    expect(out.nll[9]).to.be.below(out.nll[0]);
  });
});
