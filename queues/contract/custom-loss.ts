import { readFileSync } from 'node:fs';
import { z } from 'zod';
import { invalid } from './errors.js';

/**
 * Server-side custom losses (SDK 0.38 `create_custom_loss`): the traced torch.fx graph as plain
 * data, its schema, and the API's checks of it. The allowlist and the bounds are one file,
 * queues/contract/custom-loss.json, which the torch engine reads too
 * (workers/python/tinker_engine/custom_loss.py): there the graph is rebuilt node by node from that
 * list, authoritatively, with the run-time bounds on what each node makes. Here a graph is checked
 * before it is stored, so a refused one is a 400 at create_custom_loss naming the node.
 */

const Ops = z
  .object({
    loss_fn: z.string(),
    max_nodes: z.number().int(),
    max_inputs: z.number().int(),
    max_scalar_inputs: z.number().int(),
    max_name_chars: z.number().int(),
    max_string_chars: z.number().int(),
    max_list_items: z.number().int(),
    max_arg_depth: z.number().int(),
    max_args_per_node: z.number().int(),
    max_int_abs: z.number().int(),
    max_int_result_abs: z.number(),
    max_pow_exponent_abs: z.number().int(),
    max_elements: z.number().int(),
    max_losses_per_session: z.number().int(),
    attributes: z.array(z.string()),
    dtypes: z.array(z.string()),
    layouts: z.array(z.string()),
    memory_formats: z.array(z.string()),
    refused_kwargs: z.array(z.string()),
    functions: z.array(z.string()),
    methods: z.array(z.string()),
    creators: z.record(z.string(), z.enum(['size_args', 'size_first', 'range', 'steps', 'data', 'times_self'])),
  })
  .passthrough();

/** The allowlist and bounds (queues/contract/custom-loss.json). */
export const CUSTOM_LOSS_OPS = Ops.parse(JSON.parse(readFileSync(new URL('./custom-loss.json', import.meta.url), 'utf8')));
const O = CUSTOM_LOSS_OPS;
/** The `loss_fn` of a forward_backward that runs a stored custom loss (`loss_fn_config.loss_id`). */
export const CUSTOM_LOSS_FN = O.loss_fn;

const FUNCTIONS = new Set(O.functions);
const METHODS = new Set(O.methods);
const ATTRIBUTES = new Set(O.attributes);
const NODE_OPS = ['placeholder', 'get_attr', 'call_function', 'call_method', 'call_module', 'output'] as const;
const IDENT = /^[A-Za-z_][A-Za-z0-9_]*$/;
const INPUT_NAME = /^[a-z_][a-z0-9_]{0,63}$/;
const METRIC_KEY = /^custom\/[a-z0-9_./-]{1,64}:(sum|mean)$/;

export const CustomLossInput = z.object({ name: z.string().regex(INPUT_NAME, 'lowercase letters, digits and underscores'), rank: z.union([z.literal(0), z.literal(1), z.literal(2)]) });
export type CustomLossInput = z.infer<typeof CustomLossInput>;

/** One node as the SDK encodes it (`CustomLossNode`); args and kwargs are checked by `checkCustomLoss`. */
export const CustomLossNode = z.object({
  op: z.enum(NODE_OPS),
  name: z.string().max(O.max_name_chars),
  target: z.string().max(128),
  args: z.array(z.unknown()).max(O.max_args_per_node).default([]),
  kwargs: z.record(z.string(), z.unknown()).default({}),
});
export const CustomLossGraph = z.object({ format: z.literal(1).default(1), nodes: z.array(CustomLossNode).min(1).max(O.max_nodes) });

/** A custom loss as it is stored and as it travels in a forward_backward job to the engine. */
export const CustomLossSpec = z.object({
  name: z.string().min(1).max(O.max_name_chars),
  inputs: z.array(CustomLossInput).min(1).max(O.max_inputs),
  graph: CustomLossGraph,
});
export type CustomLossSpec = z.infer<typeof CustomLossSpec>;

/** Refuses `spec` (a 400 naming the node) unless its graph keeps to the allowlist and the bounds. */
export function checkCustomLoss(spec: CustomLossSpec): void {
  const loss = spec.name;
  const refuse = (node: string, why: string) => invalid(`custom loss '${loss}': node '${node.slice(0, 64)}' ${why}`);
  const [first] = spec.inputs;
  if (first!.name !== 'logprobs' || first!.rank === 0) throw invalid(`custom loss '${loss}': the first input must be logprobs, of rank 1 or 2`);
  if (new Set(spec.inputs.map((i) => i.name)).size !== spec.inputs.length) throw invalid(`custom loss '${loss}': input names must be distinct`);
  if (spec.inputs.some((i) => i.name === 'target_tokens')) throw invalid(`custom loss '${loss}': target_tokens is not a loss input (logprobs are its logprobs)`);
  const defined = new Set<string>();
  let placeholders = 0;
  let output: unknown;
  for (const node of spec.graph.nodes) {
    const { name, op, target } = node;
    if (!IDENT.test(name)) throw invalid(`custom loss '${loss}': node name '${name.slice(0, 64)}' must be an identifier`);
    if (defined.has(name)) throw refuse(name, 'is defined twice');
    if (output !== undefined) throw refuse(name, 'comes after the output node');
    if (Object.keys(node.args).length + Object.keys(node.kwargs).length > O.max_args_per_node) throw refuse(name, `has more than ${O.max_args_per_node} arguments`);
    const counter = { leaves: 0 };
    const args = (v: unknown) => checkArg(v, defined, counter, 0, (why) => refuse(name, why));
    if (op === 'placeholder') {
      if (placeholders >= spec.inputs.length || defined.size !== placeholders)
        throw refuse(name, 'is a placeholder the declared inputs do not have (placeholders come first, one per input)');
      if (target !== spec.inputs[placeholders]!.name) throw refuse(name, `is the placeholder of '${target.slice(0, 64)}', but input ${placeholders} is '${spec.inputs[placeholders]!.name}'`);
      placeholders++;
      defined.add(name);
      continue;
    }
    if (op === 'get_attr') throw refuse(name, `reads the attribute '${target.slice(0, 64)}' of the traced module (get_attr); a custom loss may only read logprobs and its declared inputs`);
    if (op === 'call_module') throw refuse(name, `calls the module '${target.slice(0, 64)}' (call_module); torch.nn modules are not allowed`);
    if (placeholders !== spec.inputs.length) throw invalid(`custom loss '${loss}': the graph has ${placeholders} placeholders but ${spec.inputs.length} declared inputs`);
    if (op === 'output') {
      if (node.args.length !== 1) throw refuse(name, '(output) must have one argument, (loss, metrics)');
      args(node.args[0]);
      output = node.args[0];
      continue;
    }
    if (target.split('.').some((p) => p.startsWith('_')))
      throw refuse(name, `names '${target.slice(0, 64)}'; names starting with an underscore (dunders, private attributes) are not allowed`);
    for (const [k, v] of Object.entries(node.kwargs)) {
      if (!IDENT.test(k) || k.startsWith('_')) throw refuse(name, `has the keyword argument '${k.slice(0, 64)}'`);
      if (O.refused_kwargs.includes(k)) throw refuse(name, `passes ${k}=, which would write into a tensor`);
      if (k === 'inplace' && v !== false) throw refuse(name, 'passes inplace=True; custom losses may not modify tensors in place');
    }
    node.args.forEach(args);
    Object.values(node.kwargs).forEach(args);
    if (op === 'call_function') {
      if (!FUNCTIONS.has(target))
        throw refuse(name, `calls '${target.slice(0, 64)}', which is not an allowed operation (torch tensor math, math and operator functions listed in queues/contract/custom-loss.json)`);
      if (target === 'getattr') {
        const [of, attr, ...rest] = node.args;
        if (rest.length || Object.keys(node.kwargs).length || !isRef(of) || typeof attr !== 'string') throw refuse(name, "(getattr) must read one attribute of a node: getattr(node, 'name')");
        if (!ATTRIBUTES.has(attr)) throw refuse(name, `reads the attribute '${attr.slice(0, 64)}'; allowed: ${[...ATTRIBUTES].sort().join(', ')}`);
      }
    } else {
      if (!METHODS.has(target)) throw refuse(name, `calls the method '${target.slice(0, 64)}', which is not an allowed operation`);
      if (!isRef(node.args[0])) throw refuse(name, `calls the method '${target}' on something that is not a node`);
      if (target === 'to' && (node.args.slice(1).some((a) => !isKind(a, 'dtype')) || Object.keys(node.kwargs).some((k) => k !== 'dtype')))
        throw refuse(name, 'calls to() with something other than a dtype');
    }
    defined.add(name);
  }
  if (output === undefined) throw invalid(`custom loss '${loss}': the graph has no output node`);
  const pair = isKind(output, 'tuple') ? (output as { tuple: unknown[] }).tuple : output;
  if (!Array.isArray(pair) || pair.length !== 2) throw invalid(`custom loss '${loss}': the output must be (loss, metrics)`);
  if (!isRef(pair[0])) throw invalid(`custom loss '${loss}': the loss must be a node's value`);
  if (!isKind(pair[1], 'dict')) throw invalid(`custom loss '${loss}': the metrics must be a dict`);
  for (const [key, m] of Object.entries((pair[1] as { dict: Record<string, unknown> }).dict)) {
    if (!METRIC_KEY.test(key)) throw invalid(`custom loss '${loss}': metric '${key.slice(0, 80)}' must be named custom/<name>:sum or custom/<name>:mean`);
    if (!isRef(m)) throw invalid(`custom loss '${loss}': metric '${key}' must be a node's value`);
  }
}

const isObj = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v);
const isKind = (v: unknown, kind: string) => isObj(v) && Object.keys(v).length === 1 && kind in v;
const isRef = (v: unknown) => isKind(v, 'ref') && typeof (v as { ref: unknown }).ref === 'string';

/** One encoded argument (the SDK's `_encode_arg` forms) within the bounds, its references to nodes defined before. */
function checkArg(v: unknown, defined: Set<string>, counter: { leaves: number }, depth: number, refuse: (why: string) => Error): void {
  if (depth > O.max_arg_depth) throw refuse(`nests its arguments deeper than ${O.max_arg_depth}`);
  if (++counter.leaves > O.max_list_items * 4) throw refuse(`has more than ${O.max_list_items * 4} constants and references`);
  if (v === null || typeof v === 'boolean') return;
  if (typeof v === 'number') {
    if (!Number.isFinite(v)) throw refuse('has a non-finite number');
    if (Number.isInteger(v) && Math.abs(v) > O.max_int_abs) throw refuse(`has the integer constant ${v}, past the bound ${O.max_int_abs}`);
    return;
  }
  if (typeof v === 'string') {
    if (v.length > O.max_string_chars) throw refuse(`has a string constant longer than ${O.max_string_chars} characters`);
    return;
  }
  const list = (items: unknown) => {
    if (!Array.isArray(items)) throw refuse('has a malformed list argument');
    if (items.length > O.max_list_items) throw refuse(`has a list of ${items.length} items; at most ${O.max_list_items}`);
    for (const x of items) checkArg(x, defined, counter, depth + 1, refuse);
  };
  if (Array.isArray(v)) return list(v);
  if (!isObj(v) || Object.keys(v).length !== 1) throw refuse('has an argument of an unknown form');
  const [[kind, body]] = Object.entries(v) as [[string, unknown]];
  switch (kind) {
    case 'ref':
      if (typeof body !== 'string' || !defined.has(body)) throw refuse(`refers to '${String(body).slice(0, 64)}', which is not a node defined before it`);
      return;
    case 'tuple':
      return list(body);
    case 'slice':
      if (!Array.isArray(body) || body.length !== 3) throw refuse('has a slice that is not [start, stop, step]');
      return list(body);
    case 'dict':
      if (!isObj(body) || Object.keys(body).length > O.max_list_items) throw refuse(`has a dict argument that is not an object of at most ${O.max_list_items} keys`);
      for (const [k, x] of Object.entries(body)) {
        if (k.length > O.max_string_chars) throw refuse(`has a dict key longer than ${O.max_string_chars} characters`);
        checkArg(x, defined, counter, depth + 1, refuse);
      }
      return;
    case 'ellipsis':
      return;
    case 'float':
      if (body !== 'inf' && body !== '-inf' && body !== 'nan') throw refuse(`has the float '${String(body).slice(0, 16)}'; only inf, -inf and nan are written as text`);
      return;
    case 'dtype':
    case 'layout':
    case 'memory_format': {
      const allowed = kind === 'dtype' ? O.dtypes : kind === 'layout' ? O.layouts : O.memory_formats;
      if (typeof body !== 'string' || !allowed.includes(body)) throw refuse(`names ${kind.replace('_', ' ')} '${String(body).slice(0, 32)}'; allowed: ${allowed.join(', ')}`);
      return;
    }
    case 'device':
      if (typeof body !== 'string' || !/^(cpu|cuda(:[0-9]{1,2})?)$/.test(body)) throw refuse(`names device '${String(body).slice(0, 32)}'`);
      return;
    default:
      throw refuse(`has an argument of unknown kind '${kind.slice(0, 32)}'`);
  }
}

/**
 * The datums of a forward_backward against a custom loss's declared inputs: each has target_tokens
 * of logprobs' rank and every declared input at its rank; the inputs the loss does not read are
 * dropped (the SDK sends a datum's loss_fn_inputs unchanged). Returns the inputs the datum keeps.
 *
 * A rank-0 input arrives without a shape (protobuf cannot send an empty one), which the decoder
 * (api/wire/proto.ts) reads as a scalar, except in a one-token datum, where one element reads as
 * (1,): a declared rank-0 input takes that one element as the scalar it is.
 */
export function customLossInputs<T extends { shape: number[] }>(spec: CustomLossSpec, inputs: Record<string, T>, where: string): Record<string, T> {
  const [logprobs, ...rest] = spec.inputs;
  const target = inputs.target_tokens;
  if (!target) throw invalid(`${where}: loss_fn_inputs.target_tokens is required`);
  if (target.shape.length !== logprobs!.rank)
    throw invalid(`${where}: target_tokens has rank ${target.shape.length}, but custom loss '${spec.name}' declared logprobs with rank ${logprobs!.rank}`);
  const kept: Record<string, T> = { target_tokens: target };
  for (const i of rest) {
    const t = inputs[i.name];
    if (!t) throw invalid(`${where}: custom loss '${spec.name}' reads loss_fn_inputs.${i.name}, which the datum lacks`);
    if (i.rank === 0 && t.shape.length === 1 && t.shape[0] === 1) {
      kept[i.name] = { ...t, shape: [] };
      continue;
    }
    if (t.shape.length !== i.rank) throw invalid(`${where}: loss_fn_inputs.${i.name} has rank ${t.shape.length}, but custom loss '${spec.name}' declared it with rank ${i.rank}`);
    kept[i.name] = t;
  }
  return kept;
}
