/**
 * The built-in engines: importing this module loads each adapter, which registers its engine
 * (workers/adapters/registry.ts). A new engine is its adapter file and one line here.
 */
import './torch.js';
import './vllm.js';
import './verl.js';

export * from './registry.js';
