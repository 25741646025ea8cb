--[[
  A BullMQ 6.7 standard job, written from inside another script (queues/runtime/queues.ts QueueSet.add is
  the ordinary way). The layout follows BullMQ's addStandardJob-9.lua with its includes storeJob,
  addJobInTargetList and getOrSetMaxEvents, for a job with a custom id, no parent, no delay, no
  priority, FIFO: a job hash, the 'added' and 'waiting' events, the id on the wait list and the
  marker that wakes a blocked worker. Only queues/ may know this layout; test/gate.test.ts has a
  real BullMQ worker take these jobs.

  `q` is the queue's key prefix, e.g. `<prefix>-bull:train-<agent>:`.
]]

local function bullMaxEvents(q, known)
  local maxEvents = known or redis.call('HGET', q .. 'meta', 'opts.maxLenEvents')
  if not maxEvents then
    maxEvents = 10000
    redis.call('HSET', q .. 'meta', 'opts.maxLenEvents', maxEvents)
  end
  return maxEvents
end

-- Stores the job (its payload, once) without queueing it.
local function bullStoreJob(q, jobId, name, data, opts, timestamp)
  redis.call('HSET', q .. jobId, 'name', name, 'data', data, 'opts', opts, 'timestamp', timestamp, 'delay', 0, 'priority', 0)
  redis.call('XADD', q .. 'events', '*', 'event', 'added', 'jobId', jobId, 'name', name)
end

-- Puts a stored job on the wait list (FIFO) and wakes a worker unless the queue is paused or maxed.
local function bullPushJob(q, jobId)
  redis.call('LPUSH', q .. 'wait', jobId)
  local attrs = redis.call('HMGET', q .. 'meta', 'paused', 'concurrency', 'opts.maxLenEvents')
  local blocked = attrs[1] and true or false
  if not blocked and attrs[2] then blocked = redis.call('LLEN', q .. 'active') >= tonumber(attrs[2]) end
  if not blocked then redis.call('ZADD', q .. 'marker', 0, '0') end
  redis.call('XADD', q .. 'events', 'MAXLEN', '~', bullMaxEvents(q, attrs[3]), '*', 'event', 'waiting', 'jobId', jobId)
end

--[[
  Ends an active job as completed with a null return value, as BullMQ 6.7's moveToFinished does for
  Job.moveToCompleted(null, token, false) on a job with no parent, no deduplication id and
  removeOnComplete { age } (the training jobs, queues/runtime/queues.ts jobOptions): the lock released, the
  job off the active list, attemptsMade counted, the job on the completed set with its finishedOn and
  returnvalue, completed jobs past the age removed, the 'completed' event (and 'drained' once nothing
  waits or runs). A job of any other shape is left for BullMQ (returns 0). Returns 1 ended, 0 left for
  BullMQ, or BullMQ's codes: -1 no job, -2 no lock, -6 the lock is another's, -3 not active.
]]
local function bullCompleteJob(q, jobId, token, timestamp)
  local jobKey = q .. jobId
  local f = redis.call('HMGET', jobKey, 'opts', 'parentKey', 'parent', 'deid')
  if not f[1] then return -1 end
  if f[2] or f[3] or f[4] then return 0 end
  local keep = cjson.decode(f[1]).removeOnComplete
  if type(keep) ~= 'table' or type(keep.age) ~= 'number' or keep.count ~= nil then return 0 end
  local lock = redis.call('GET', jobKey .. ':lock')
  if lock ~= token then return lock and -6 or -2 end
  redis.call('DEL', jobKey .. ':lock')
  redis.call('SREM', q .. 'stalled', jobId)
  if redis.call('LREM', q .. 'active', -1, jobId) < 1 then return -3 end
  local events = q .. 'events'
  redis.call('XTRIM', events, 'MAXLEN', '~', bullMaxEvents(q))
  redis.call('HINCRBY', jobKey, 'atm', 1)
  local completed = q .. 'completed'
  redis.call('ZADD', completed, timestamp, jobId)
  redis.call('HSET', jobKey, 'returnvalue', 'null', 'finishedOn', timestamp)
  local limit = keep.limit or 1000
  local before = tonumber(timestamp) - keep.age * 1000
  local old = redis.call('ZREVRANGEBYSCORE', completed, before, '-inf', 'LIMIT', 0, limit)
  for _, id in ipairs(old) do
    local k = q .. id
    redis.call('DEL', k, k .. ':logs', k .. ':dependencies', k .. ':processed', k .. ':failed', k .. ':unsuccessful')
  end
  if #old > 0 then
    if #old < limit then
      redis.call('ZREMRANGEBYSCORE', completed, '-inf', before)
    else
      redis.call('ZREM', completed, unpack(old))
    end
  end
  redis.call('XADD', events, '*', 'event', 'completed', 'jobId', jobId, 'returnvalue', 'null', 'prev', 'active')
  if redis.call('LLEN', q .. 'wait') == 0 and redis.call('LLEN', q .. 'active') == 0 and redis.call('ZCARD', q .. 'prioritized') == 0 then
    redis.call('XADD', events, '*', 'event', 'drained')
  end
  return 1
end
