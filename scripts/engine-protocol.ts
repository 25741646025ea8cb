import { writeFileSync } from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { protocolJsonSchema } from '../workers/engine-protocol.js';

/**
 * Writes the engine protocol's JSON Schema (from workers/engine-protocol.ts) where the Python
 * engines read it. Run after changing an operation's schema: `npm run engine-protocol`.
 */
export const PROTOCOL_JSON = path.join(path.dirname(fileURLToPath(import.meta.url)), '..', 'workers', 'python', 'tinker_engine', 'protocol.json');

export function protocolJsonText(): string {
  return `${JSON.stringify(protocolJsonSchema(), null, 1)}\n`;
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  writeFileSync(PROTOCOL_JSON, protocolJsonText());
  console.log(`wrote ${path.relative(process.cwd(), PROTOCOL_JSON)}`);
}
