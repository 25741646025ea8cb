import { execFile } from 'node:child_process';
import { readdir, readFile } from 'node:fs/promises';
import { promisify } from 'node:util';

/**
 * Memory of an engine, for `/metrics` and `tinker-broker agents`: the resident memory of its
 * process tree (Linux /proc) and, where the engine runs on NVIDIA GPUs, the GPU memory its
 * processes hold (`nvidia-smi --query-compute-apps`). Both are null where they cannot be read.
 */
const run = promisify(execFile);

/** The pids and all their descendants. */
export async function processTree(roots: number[]): Promise<number[]> {
  if (roots.length === 0) return [];
  const children = new Map<number, number[]>();
  for (const d of await readdir('/proc').catch(() => [] as string[])) {
    if (!/^\d+$/.test(d)) continue;
    const stat = await readFile(`/proc/${d}/stat`, 'utf8').catch(() => null);
    if (!stat) continue;
    // pid (comm) state ppid …: comm may contain spaces and parentheses, so split after the last ')'.
    const ppid = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
    const list = children.get(ppid) ?? [];
    list.push(Number(d));
    children.set(ppid, list);
  }
  const out: number[] = [];
  const todo = [...roots];
  while (todo.length) {
    const p = todo.pop()!;
    out.push(p);
    todo.push(...(children.get(p) ?? []));
  }
  return out;
}

async function rssBytes(pid: number): Promise<number | null> {
  const status = await readFile(`/proc/${pid}/status`, 'utf8').catch(() => null);
  const m = status && /^VmRSS:\s+(\d+)\s+kB/m.exec(status);
  return m ? Number(m[1]) * 1024 : null;
}

let noNvidiaSmi = false;

async function gpuBytesByPid(): Promise<Map<number, number> | null> {
  if (noNvidiaSmi) return null;
  try {
    const { stdout } = await run('nvidia-smi', ['--query-compute-apps=pid,used_memory', '--format=csv,noheader,nounits'], { timeout: 5_000 });
    const out = new Map<number, number>();
    for (const line of stdout.trim().split('\n')) {
      const [pid, mib] = line.split(',').map((x) => Number(x.trim()));
      if (Number.isFinite(pid) && Number.isFinite(mib)) out.set(pid!, (out.get(pid!) ?? 0) + mib! * 1024 * 1024);
    }
    return out;
  } catch {
    noNvidiaSmi = true;
    return null;
  }
}

export async function engineMemory(pids: number[], onGpu: boolean): Promise<{ rss: number | null; gpu: number | null }> {
  const tree = await processTree(pids);
  const rss = (await Promise.all(tree.map(rssBytes))).filter((x): x is number => x !== null);
  let gpu: number | null = null;
  if (onGpu) {
    const byPid = await gpuBytesByPid();
    if (byPid) gpu = tree.reduce((s, p) => s + (byPid.get(p) ?? 0), 0);
  }
  return { rss: rss.length ? rss.reduce((a, b) => a + b, 0) : null, gpu };
}
