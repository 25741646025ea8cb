--[[
  Taking a training queue's next job for its agent (queues/runtime/train-consumer.ts): BullMQ 6.7's
  moveToActive for a FIFO queue without delays, priorities or rate limits (RPOPLPUSH wait -> active,
  the job lock, processedOn, attemptsStarted, the 'active' event), and, when asked (the agent's engine
  is free, so the op starts now), its outcome's claim as queues/runtime/lua/outcome-claim.lua makes it. The
  queue has one consumer, its agent: the marker that wakes a blocked consumer is removed once the wait
  list is empty (BullMQ's moveToActive leaves one behind for other workers, which costs the one
  consumer an empty moveToActive per job). Only queues/ may know this layout; the op's done record
  ends the job (bullmq-job.lua bullCompleteJob), else BullMQ's own moveToFinished.

  Used by queues/runtime/lua/train-take.lua (the agent's take) and queues/runtime/lua/gate-submit.lua (the take a
  submit makes for the agent in the API's own process, which is then handed the job in memory).

  `T` = { q (the queue's key prefix, `<prefix>-bull:train-<agent>:`), now (ms), lockToken, lockMs,
  claim ('1' = claim the outcome), outcomeBefore, outcomeAfter (the outcome key's text around the job
  id), agentId, tokenPrefix (the claim token's text before the job id), nowIso, outcomeTtlS, stored
  (optional: { id, name } of a job the caller has just stored, whose hash need not be read) }.

  Returns nil when the wait list is empty, else
    job id, 1 when more jobs wait else 0, whether the job's hash exists (false: skipped, nothing held),
    0 = not claimed | 1 = claimed | 2 = a record was there first, that record or false, and the job's
    attemptsStarted (ats) once taken.
]]
local function trainTake(T)
  local wait, active, marker = T.q .. 'wait', T.q .. 'active', T.q .. 'marker'
  local jobId = redis.call('RPOPLPUSH', wait, active)
  if not jobId then
    redis.call('DEL', marker)
    return nil
  end
  local more = redis.call('LLEN', wait)
  if more == 0 then redis.call('DEL', marker) end
  more = more > 0 and 1 or 0
  local jobKey = T.q .. jobId
  local stored = T.stored and T.stored.id == jobId
  if not stored and redis.call('EXISTS', jobKey) == 0 then
    redis.call('LREM', active, 1, jobId)
    return jobId, more, false, 0, false
  end
  redis.call('SET', jobKey .. ':lock', T.lockToken, 'PX', T.lockMs)
  redis.call('XADD', T.q .. 'events', '*', 'event', 'active', 'jobId', jobId, 'prev', 'waiting')
  redis.call('HSET', jobKey, 'processedOn', T.now)
  local ats = redis.call('HINCRBY', jobKey, 'ats', 1)
  local claim, prev = 0, false
  if T.claim == '1' then
    local outcomeKey = T.outcomeBefore .. jobId .. T.outcomeAfter
    prev = redis.call('GET', outcomeKey)
    if prev then
      claim = 2
    else
      claim = 1
      -- `state` first: queues/runtime/lua/outcome-read.lua tells a running record by its first bytes.
      local op = stored and T.stored.name or redis.call('HGET', jobKey, 'name')
      local rec = '{"state":"running","op":' .. cjson.encode(op) .. ',"agent_id":' .. cjson.encode(T.agentId) ..
        ',"token":' .. cjson.encode(T.tokenPrefix .. jobId) .. ',"at":' .. cjson.encode(T.nowIso) .. '}'
      redis.call('SET', outcomeKey, rec, 'EX', T.outcomeTtlS)
    end
  end
  return jobId, more, true, claim, prev, ats
end
