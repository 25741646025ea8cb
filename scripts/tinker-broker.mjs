#!/usr/bin/env node
// `npx tinker-broker …`: runs the TypeScript command line (scripts/tinker-broker.ts) in this
// process through tsx's loader, so signals (SIGTERM, Ctrl-C) reach its shutdown handler directly.
import { register } from 'tsx/esm/api';

register();
const { cli } = await import('./tinker-broker.ts');
cli(process.argv.slice(2));
