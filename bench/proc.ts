import { readFileSync } from 'node:fs';

/** The benchmarks' reads of Linux /proc: what a process and its children have cost the machine. */

/** CPU ms a process has used (utime + stime, clock ticks of 10 ms: USER_HZ is 100 on Linux); null when /proc cannot tell. */
export function cpuMs(pid: number): number | null {
  try {
    // pid (comm) state …: comm may hold spaces and parentheses, so split after the last ')'.
    const st = readFileSync(`/proc/${pid}/stat`, 'utf8');
    const f = st.slice(st.lastIndexOf(')') + 2).split(' ');
    return (Number(f[11]) + Number(f[12])) * 10;
  } catch {
    return null;
  }
}

/** A process's children (none when /proc cannot tell). */
export function children(pid: number): number[] {
  try {
    return readFileSync(`/proc/${pid}/task/${pid}/children`, 'utf8').trim().split(/\s+/).filter(Boolean).map(Number);
  } catch {
    return [];
  }
}

/** CPU ms of a process and all its living descendants (each read as cpuMs; a process that is gone counts 0). */
export function treeCpuMs(pid: number): number {
  return (cpuMs(pid) ?? 0) + children(pid).reduce((sum, c) => sum + treeCpuMs(c), 0);
}

/** A process's command line, its arguments joined by spaces ('' when gone). */
export function cmdline(pid: number): string {
  try {
    return readFileSync(`/proc/${pid}/cmdline`, 'utf8').replaceAll('\0', ' ');
  } catch {
    return '';
  }
}
