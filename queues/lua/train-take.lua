--[[
  Takes the next job of a training queue for its agent (queues/train-consumer.ts), in one round trip:
  BullMQ 6.7's moveToActive for a FIFO queue without delays, priorities or rate limits (RPOPLPUSH
  wait -> active, the job lock, processedOn, attemptsStarted, the 'active' event), and, when asked
  (the agent's engine is free, so the op starts now), its outcome's claim as
  queues/lua/outcome-claim.lua makes it. The queue has one consumer, its agent: the marker that wakes
  a blocked consumer is removed once the wait list is empty (BullMQ's moveToActive leaves one behind
  for other workers, which costs the one consumer an empty moveToActive per job). Only queues/ may
  know this layout; BullMQ's own moveToFinished ends the job.

  KEYS[1] wait list   KEYS[2] active list   KEYS[3] event stream   KEYS[4] marker
  ARGV[1] the queue's key prefix (`<prefix>-bull:train-<agent>:`)
  ARGV[2] now, ms            ARGV[3] the lock token      ARGV[4] the lock's duration, ms
  ARGV[5] '1' = claim the outcome, '0' = do not
  ARGV[6] the outcome key's text before the job id     ARGV[7] its text after the job id
  ARGV[8] the agent id       ARGV[9] the claim token's text before the job id
  ARGV[10] now, ISO 8601     ARGV[11] the outcome record's TTL, s

  Returns false when the wait list is empty, else
  { job hash (HGETALL; empty when the job's hash is gone), job id, 1 when more jobs wait else 0,
    0 = not claimed | 1 = claimed | 2 = a record was there first, that record or false }.
]]
local jobId = redis.call('RPOPLPUSH', KEYS[1], KEYS[2])
if not jobId then
  redis.call('DEL', KEYS[4])
  return false
end
local more = redis.call('LLEN', KEYS[1])
if more == 0 then redis.call('DEL', KEYS[4]) end
local jobKey = ARGV[1] .. jobId
if redis.call('EXISTS', jobKey) == 0 then
  redis.call('LREM', KEYS[2], 1, jobId)
  return { {}, jobId, more > 0 and 1 or 0, 0, false }
end
redis.call('SET', jobKey .. ':lock', ARGV[3], 'PX', ARGV[4])
redis.call('XADD', KEYS[3], '*', 'event', 'active', 'jobId', jobId, 'prev', 'waiting')
redis.call('HSET', jobKey, 'processedOn', ARGV[2])
redis.call('HINCRBY', jobKey, 'ats', 1)
local claim, prev = 0, false
if ARGV[5] == '1' then
  local outcomeKey = ARGV[6] .. jobId .. ARGV[7]
  prev = redis.call('GET', outcomeKey)
  if prev then
    claim = 2
  else
    claim = 1
    -- `state` first: queues/lua/outcome-read.lua tells a running record by its first bytes.
    local op = redis.call('HGET', jobKey, 'name')
    local rec = '{"state":"running","op":' .. cjson.encode(op) .. ',"agent_id":' .. cjson.encode(ARGV[8]) ..
      ',"token":' .. cjson.encode(ARGV[9] .. jobId) .. ',"at":' .. cjson.encode(ARGV[10]) .. '}'
    redis.call('SET', outcomeKey, rec, 'EX', ARGV[11])
  end
end
return { redis.call('HGETALL', jobKey), jobId, more > 0 and 1 or 0, claim, prev }
