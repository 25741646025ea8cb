/**
 * The vLLM engine (sampling only), by concern:
 * - vllm/translate.ts: Tinker jobs ↔ vLLM requests and answers, errors, model files (pure functions);
 * - vllm/client.ts: the HTTP client (keep-alive below the server's, one retry of a reset reused connection);
 * - vllm/loras.ts: one served base model, its sampler versions as LoRA adapters (LRU), sampling;
 * - vllm/server.ts: the `vllm serve` command line and process supervision;
 * - vllm/adapter.ts: the EngineAdapter the agent drives.
 */
export * from './vllm/adapter.js';
export * from './vllm/client.js';
export * from './vllm/loras.js';
export * from './vllm/server.js';
export * from './vllm/translate.js';
