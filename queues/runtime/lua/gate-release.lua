--[[
  Fails the ops held behind a gap past its deadline and releases whatever is then in order (run for
  models with a timed-out gap, and when a held future is polled). queues/runtime/gate.ts OrderingGate.release.

  KEYS[1] next: gate next   KEYS[2] held: gate held   KEYS[3] heldIndex: gate held-index
  KEYS[4] digests: gate digests   KEYS[5] gaps: gate gaps

  ARGV[1] modelId: model id       ARGV[2] window: seq_ids held ahead   ARGV[3] gapMs: gap timeout ms
  ARGV[4] bullPrefix: BullMQ key prefix                       ARGV[5] failedPrefix: failed-future key prefix
  ARGV[6] failedTtlS: failed-future ttl s                     ARGV[7] gapS: gap timeout s (for messages)
  ARGV[8] trainJobIdPrefix: job id prefix of the model's train jobs

  Returns the number of held ops failed.
]]
--- @include "bullmq-job"
--- @include "gate-lib"

local G = { next = KEYS[1], held = KEYS[2], index = KEYS[3], digests = KEYS[4], gaps = KEYS[5], jobIdPrefix = ARGV[8] }
if not redis.call('GET', G.next) then return 0 end
local failed = gateExpireGap(G, ARGV[1], ARGV[4], ARGV[5], tonumber(ARGV[6]), ARGV[7])
gateDrain(G, ARGV[1], ARGV[4], tonumber(ARGV[2]), tonumber(ARGV[3]))
return failed
