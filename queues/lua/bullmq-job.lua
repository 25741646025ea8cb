--[[
  A BullMQ 6.7 standard job, written from inside another script (queues/queues.ts QueueSet.add is
  the ordinary way). The layout follows BullMQ's addStandardJob-9.lua with its includes storeJob,
  addJobInTargetList and getOrSetMaxEvents, for a job with a custom id, no parent, no delay, no
  priority, FIFO: a job hash, the 'added' and 'waiting' events, the id on the wait list and the
  marker that wakes a blocked worker. Only queues/ may know this layout; test/gate.test.ts has a
  real BullMQ worker take these jobs.

  `q` is the queue's key prefix, e.g. `<prefix>-bull:train-<agent>:`.
]]

local function bullMaxEvents(q)
  local maxEvents = redis.call('HGET', q .. 'meta', 'opts.maxLenEvents')
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
  local attrs = redis.call('HMGET', q .. 'meta', 'paused', 'concurrency')
  local blocked = attrs[1] and true or false
  if not blocked and attrs[2] then blocked = redis.call('LLEN', q .. 'active') >= tonumber(attrs[2]) end
  if not blocked then redis.call('ZADD', q .. 'marker', 0, '0') end
  redis.call('XADD', q .. 'events', 'MAXLEN', '~', bullMaxEvents(q), '*', 'event', 'waiting', 'jobId', jobId)
end
