/**
 * The worker agent, the entry other code imports (workers/main.ts, scripts/tinker-broker.ts, tests).
 * Its parts live in workers/agent/: agent.ts wires registration.ts, engine.ts, training.ts (with
 * train-ops.ts), samples.ts and drain.ts; ops.ts holds what the pipeline and the sample workers share.
 */
export { Agent } from './agent/agent.js';
export { keepLastPromptLogprobs } from './agent/samples.js';
