--[[
  Fails the ops held behind a gap past its deadline and releases whatever is then in order (run for
  models with a timed-out gap, and when a held future is polled). queues/runtime/gate.ts OrderingGate.release.

  KEYS[1] gate next   KEYS[2] gate held   KEYS[3] gate held-index   KEYS[4] gate digests   KEYS[5] gate gaps

  ARGV[1] model id    ARGV[2] window      ARGV[3] gap timeout ms    ARGV[4] BullMQ key prefix
  ARGV[5] failed-future key prefix        ARGV[6] failed-future ttl s
  ARGV[7] gap timeout s (for messages)    ARGV[8] job id prefix of the model's train jobs

  Returns the number of held ops failed.
]]
--- @include "bullmq-job"
--- @include "gate-lib"

local G = { next = KEYS[1], held = KEYS[2], index = KEYS[3], digests = KEYS[4], gaps = KEYS[5], jobIdPrefix = ARGV[8] }
if not redis.call('GET', G.next) then return 0 end
local failed = gateExpireGap(G, ARGV[1], ARGV[4], ARGV[5], tonumber(ARGV[6]), ARGV[7])
gateDrain(G, ARGV[1], ARGV[4], tonumber(ARGV[2]), tonumber(ARGV[3]))
return failed
