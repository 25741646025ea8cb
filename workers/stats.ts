import { execFile } from 'node:child_process';
import { readdirSync, readFileSync } from 'node:fs';
import { readdir, readFile } from 'node:fs/promises';
import { promisify } from 'node:util';

/**
 * Memory of an engine, for `/metrics` and `tinker-broker agents`: the resident memory of its
 * process tree (Linux /proc) and, where the engine runs on NVIDIA GPUs, the GPU memory its
 * processes hold (`nvidia-smi --query-compute-apps`). Both are null where they cannot be read.
 */
const run = promisify(execFile);

/**
 * The pids and all their descendants. Each process's children come from its threads' `children`
 * files (Linux with CONFIG_PROC_CHILDREN): a few small reads for an engine's tree, where a scan of
 * every process's `stat` (`scanTree`, the fallback) reads them all, at every heartbeat, beside the
 * ops being served (its cost: docs/benchmarks-history.md, 2026-12-03 18:20).
 */
export async function processTree(roots: number[]): Promise<number[]> {
  return descendants(roots, childrenOf) ?? scanTree(roots);
}

/** The roots and everything below them, as `kids` tells each process's children; null when `kids` cannot tell. */
function descendants(roots: number[], kids: (pid: number) => number[] | null): number[] | null {
  const out: number[] = [];
  const todo = [...roots];
  while (todo.length) {
    const p = todo.pop()!;
    const k = kids(p);
    if (k === null) return null;
    out.push(p);
    todo.push(...k);
  }
  return out;
}

/** A live process's children, from its threads' `children` files; [] once it is gone, null where the kernel has no such files. */
function childrenOf(pid: number): number[] | null {
  let tasks: string[];
  try {
    tasks = readdirSync(`/proc/${pid}/task`);
  } catch {
    return haveChildrenFiles() ? [] : null;
  }
  const out: number[] = [];
  for (const t of tasks) {
    let text: string;
    try {
      text = readFileSync(`/proc/${pid}/task/${t}/children`, 'utf8');
    } catch {
      // A thread that ended since the listing; no file at all where the kernel lacks CONFIG_PROC_CHILDREN.
      if (!haveChildrenFiles()) return null;
      continue;
    }
    for (const c of text.split(' ')) if (c.trim()) out.push(Number(c));
  }
  return out;
}

/** Whether this kernel has the `children` files (asked once, of this process's own main thread). */
let childrenFiles: boolean | undefined;
function haveChildrenFiles(): boolean {
  if (childrenFiles === undefined) {
    try {
      readFileSync(`/proc/${process.pid}/task/${process.pid}/children`);
      childrenFiles = true;
    } catch {
      childrenFiles = false;
    }
  }
  return childrenFiles;
}

/** The pids and all their descendants, from a scan of every process's parent (`/proc/<pid>/stat`). */
export async function scanTree(roots: number[]): Promise<number[]> {
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
  return descendants(roots, (p) => children.get(p) ?? [])!;
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
