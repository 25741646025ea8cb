import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { E2E_KEY, freePort } from '../test/e2e/server.js';
import { deletePrefix, REDIS_URL } from '../test/helpers/stack.js';

/**
 * A/B of the SDK's optim_step round trip alone (bench/sdk_optim_step.py), quicker than
 * bench/overhead-ab.ts for a change on that path: both checkouts' servers (`tinker-broker start`, the
 * tiny model) run at once, each on its own port, prefix and storage, and the script runs against
 * them in turn, A B B A …, so the machine's spells weigh on both alike. Prints each round and the
 * medians: SDK p50, two 404s, and their ratio.
 *
 *   node --import tsx bench/sdk-ab.ts <dirA> <dirB> [rounds=8] [steps=150]
 */
type Stack = { child: ChildProcess; url: string; prefix: string; storage: string };

async function start(dir: string, tag: string): Promise<Stack> {
  const port = await freePort();
  const prefix = `sdk-ab-${tag}-${process.pid}`;
  const storage = mkdtempSync(path.join(os.tmpdir(), 'tb-sdk-ab-'));
  const child = spawn(process.execPath, ['--import', 'tsx', 'scripts/tinker-broker.ts', 'start'], {
    cwd: dir,
    stdio: 'ignore',
    env: { ...process.env, TB_LOG_LEVEL: 'warn', TB_PORT: String(port), TB_PREFIX: prefix, TB_STORAGE_DIR: storage, TB_API_KEYS: E2E_KEY, TB_AGENT_ID: `agent-${prefix}`, REDIS_URL },
  });
  const url = `http://127.0.0.1:${port}`;
  for (const deadline = Date.now() + 170_000; ; ) {
    if (child.exitCode !== null) throw new Error(`${dir}: the start command exited (${child.exitCode})`);
    try {
      const r = await fetch(`${url}/api/v1/healthz`);
      if (r.status === 200 && ((await r.json()) as { status: string }).status === 'ready') return { child, url, prefix, storage };
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) throw new Error(`${dir}: server not ready`);
    await new Promise((r) => setTimeout(r, 250));
  }
}

async function main(): Promise<void> {
  const [dirA, dirB, roundsArg, steps = '150'] = process.argv.slice(2);
  if (!dirA || !dirB) throw new Error('usage: sdk-ab.ts <dirA> <dirB> [rounds] [steps]');
  const rounds = Number(roundsArg ?? 8);
  const stacks: Record<'A' | 'B', Stack> = { A: await start(path.resolve(dirA), 'a'), B: await start(path.resolve(dirB), 'b') };
  const runs: Record<'A' | 'B', { sdk: number; nf: number; ratio: number }[]> = { A: [], B: [] };
  try {
    for (let r = 0; r < rounds; r++) {
      for (const w of (r % 2 === 0 ? ['A', 'B'] : ['B', 'A']) as ('A' | 'B')[]) {
        const p = spawnSync(path.resolve('.venv/bin/python'), [path.resolve('bench/sdk_optim_step.py'), TINY_MODEL_ALIAS, steps], {
          env: { ...process.env, TINKER_BASE_URL: stacks[w].url, TINKER_API_KEY: E2E_KEY, HF_HUB_OFFLINE: '1' },
          encoding: 'utf8',
        });
        if (p.status !== 0) throw new Error(`sdk_optim_step.py against ${w} failed:\n${p.stderr}`);
        const o = JSON.parse(p.stdout.trim().split('\n').pop()!) as { sdk_p50_ms: number; plain_404_p50_ms: number; ratio_404: number };
        runs[w].push({ sdk: o.sdk_p50_ms, nf: o.plain_404_p50_ms, ratio: o.ratio_404 });
        console.log(`round ${r + 1} ${w}: SDK optim_step ${o.sdk_p50_ms.toFixed(2)} ms, two 404s ${o.plain_404_p50_ms.toFixed(2)} ms, ${o.ratio_404.toFixed(2)}x`);
      }
    }
  } finally {
    for (const s of Object.values(stacks)) {
      const exited = new Promise((r) => s.child.once('exit', r));
      s.child.kill('SIGTERM');
      await exited;
      await deletePrefix(s.prefix);
      rmSync(s.storage, { recursive: true, force: true });
    }
  }
  const med = (xs: number[]) => [...xs].sort((a, b) => a - b)[xs.length >> 1]!;
  console.log(`\nmedians of ${rounds} rounds (A = ${dirA}, B = ${dirB})`);
  for (const [label, f] of [['SDK optim_step p50 (ms)', 'sdk'], ['two 404s p50 (ms)', 'nf'], ['SDK / two 404s', 'ratio']] as const) {
    const a = med(runs.A.map((x) => x[f]));
    const b = med(runs.B.map((x) => x[f]));
    console.log(`${label.padEnd(26)} A ${a.toFixed(2).padStart(6)}  B ${b.toFixed(2).padStart(6)}  B/A ${(b / a).toFixed(2)}`);
  }
  console.log(`B's rounds: ${runs.B.map((x) => x.ratio.toFixed(2)).join(' ')}; A's: ${runs.A.map((x) => x.ratio.toFixed(2)).join(' ')}`);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
