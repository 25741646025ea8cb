--[[
  Takes the next job of a training queue for its agent (queues/runtime/train-consumer.ts TrainConsumer.take),
  in one round trip: see queues/runtime/lua/train-take-lib.lua.

  KEYS[1] wait: wait list   KEYS[2] active: active list   KEYS[3] events: event stream   KEYS[4] marker: the wake marker
    (declared for the reader; the library builds them from ARGV[1])
  ARGV[1] queuePrefix: the queue's key prefix (`<prefix>-bull:train-<agent>:`)
  ARGV[2] now: now, ms       ARGV[3] lockToken: the lock token   ARGV[4] lockMs: the lock's duration, ms
  ARGV[5] claim: '1' = claim the outcome, '0' = do not
  ARGV[6] outcomeBefore: the outcome key's text before the job id
  ARGV[7] outcomeAfter: its text after the job id
  ARGV[8] agentId: the agent id
  ARGV[9] tokenPrefix: the claim token's text before the job id
  ARGV[10] nowIso: now, ISO 8601   ARGV[11] outcomeTtlS: the outcome record's TTL, s

  Returns false when the wait list is empty, else
  { job hash (HGETALL; empty when the job's hash is gone), job id, 1 when more jobs wait else 0,
    0 = not claimed | 1 = claimed | 2 = a record was there first, that record or false }.
]]
--- @include "train-take-lib"

local jobId, more, exists, claim, prev = trainTake({
  q = ARGV[1], now = ARGV[2], lockToken = ARGV[3], lockMs = ARGV[4], claim = ARGV[5],
  outcomeBefore = ARGV[6], outcomeAfter = ARGV[7], agentId = ARGV[8], tokenPrefix = ARGV[9],
  nowIso = ARGV[10], outcomeTtlS = ARGV[11],
})
if not jobId then return false end
if not exists then return { {}, jobId, more, 0, false } end
return { redis.call('HGETALL', ARGV[1] .. jobId), jobId, more, claim, prev }
