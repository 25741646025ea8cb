import { parseArgs } from 'node:util';

/**
 * The command-line framework of `tinker-broker`: a table of commands, each declaring its options
 * (with help text, default and the environment variable that overrides it), from which both the
 * parser and `--help` are derived. A command is added by adding one entry to the table in
 * scripts/tinker-broker.ts.
 */

/** A mistake of the operator (bad option, busy port, missing model): one plain line, exit code 2. */
export class UsageError extends Error {
  override readonly name = 'UsageError';
}

export type OptionSpec = {
  type: 'string' | 'boolean';
  /** One line of help. */
  help: string;
  multiple?: boolean;
  short?: string;
  /** Shown in --help; the parser fills it in for string options. */
  default?: string;
  /** The environment variable that overrides the option (or the preset value it stands for). */
  env?: string;
  /** Placeholder of the value in --help, e.g. FILE. */
  arg?: string;
};

export type Parsed = { values: Record<string, string | boolean | string[] | undefined>; positionals: string[] };

export type Command = {
  /** One line for the command list. */
  summary: string;
  /** Positional arguments, e.g. `FILE...`, shown in the usage line. */
  args?: string;
  /** More help after the option list (environment variables, examples). */
  details?: string;
  options: Record<string, OptionSpec>;
  /** Least and most positionals. @defaultValue 0 and 0 */
  minArgs?: number;
  maxArgs?: number;
  run: (p: Parsed) => Promise<void>;
};

export type CommandTable = Record<string, Command>;

export function commandUsage(prog: string, name: string, cmd: Command): string {
  const lines = [`usage: ${prog} ${name}${Object.keys(cmd.options).length ? ' [options]' : ''}${cmd.args ? ` ${cmd.args}` : ''}`, '', cmd.summary];
  const opts = Object.entries(cmd.options);
  if (opts.length) {
    lines.push('', 'options:');
    const heads = opts.map(([n, o]) => `  ${o.short ? `-${o.short}, ` : ''}--${n}${o.type === 'string' ? ` ${o.arg ?? 'VALUE'}` : ''}${o.multiple ? ' (repeatable)' : ''}`);
    const width = Math.min(Math.max(...heads.map((h) => h.length)) + 2, 40);
    opts.forEach(([, o], i) => {
      const extra = [o.default !== undefined ? `default: ${o.default}` : '', o.env ? `env: ${o.env}` : ''].filter(Boolean).join('; ');
      const head = heads[i]!;
      const text = `${o.help}${extra ? ` (${extra})` : ''}`;
      lines.push(head.length + 2 > width ? `${head}\n${' '.repeat(width)}${text}` : `${head.padEnd(width)}${text}`);
    });
    lines.push(`  -h, --help${' '.repeat(Math.max(width - 12, 1))}show this help`);
  }
  if (cmd.details) lines.push('', cmd.details.trim());
  return lines.join('\n');
}

export function programUsage(prog: string, intro: string, table: CommandTable): string {
  const width = Math.max(...Object.keys(table).map((n) => n.length)) + 4;
  return [
    `usage: ${prog} <command> [options]`,
    '',
    intro.trim(),
    '',
    'commands:',
    ...Object.entries(table).map(([n, c]) => `  ${n.padEnd(width)}${c.summary}`),
    '',
    `Run '${prog} <command> --help' for a command's options.`,
  ].join('\n');
}

/** Parses one command's arguments; a mistake is a UsageError naming the fix. */
export function parseCommand(prog: string, name: string, cmd: Command, argv: string[]): Parsed | 'help' {
  if (argv.includes('--help') || argv.includes('-h')) return 'help';
  const options: Record<string, { type: 'string' | 'boolean'; multiple?: boolean; short?: string }> = {};
  for (const [n, o] of Object.entries(cmd.options)) options[n] = { type: o.type, ...(o.multiple ? { multiple: true } : {}), ...(o.short ? { short: o.short } : {}) };
  let parsed: ReturnType<typeof parseArgs>;
  try {
    parsed = parseArgs({ args: argv, options, allowPositionals: true, strict: true });
  } catch (e) {
    const msg = (e as Error).message.split('\n')[0]!.replace(/\. To specify a positional argument.*$/, '');
    throw new UsageError(`${prog} ${name}: ${msg.replace(/^Unknown option/, 'unknown option')}; see '${prog} ${name} --help'`);
  }
  const values = { ...parsed.values } as Parsed['values'];
  for (const [n, o] of Object.entries(cmd.options)) if (values[n] === undefined && o.type === 'string' && o.default !== undefined && !o.multiple) values[n] = o.default;
  const min = cmd.minArgs ?? 0;
  const max = cmd.maxArgs ?? 0;
  if (parsed.positionals.length < min)
    throw new UsageError(`${prog} ${name}: expected ${cmd.args ?? 'an argument'}; see '${prog} ${name} --help'`);
  if (parsed.positionals.length > max)
    throw new UsageError(`${prog} ${name}: unexpected argument '${parsed.positionals[max]}'; see '${prog} ${name} --help'`);
  return { values, positionals: parsed.positionals };
}

/** Renders rows as an aligned plain-text table. */
export function table(headers: string[], rows: (string | number)[][]): string {
  const cells = [headers, ...rows.map((r) => r.map(String))];
  const widths = headers.map((_, i) => Math.max(...cells.map((r) => (r[i] ?? '').length)));
  return cells.map((r) => r.map((c, i) => (i === r.length - 1 ? c : c.padEnd(widths[i]!))).join('  ').trimEnd()).join('\n');
}
