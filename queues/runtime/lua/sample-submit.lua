--[[
  Admits one sample request in one round trip (queues/runtime/queues.ts QueueSet.submitSample): its job is
  stored and queued (a BullMQ standard job, bullmq-job.lua) unless a job of that id exists; the
  future's owner is recorded and the sampling session's lifetime restarted. A job id names one
  request: an existing job with another payload is a replay that is refused (nothing written).

  KEYS[1] job: the job (its hash)          KEYS[2] wait: the queue's wait list
  KEYS[3] owner: the future's owner record
  KEYS[4] session: the sampling session's record (touched when ARGV[9] ~= '')

  ARGV[1] queuePrefix: the queue's key prefix ('<prefix>-bull:<queue>:')   ARGV[2] jobId: job id
  ARGV[3] jobName: job name (op)   ARGV[4] jobData: job data (JSON, stored as given)
  ARGV[5] jobOpts: job opts (JSON)   ARGV[6] timestamp: job timestamp ms
  ARGV[7] maxWaiting: the most jobs that may wait in the queue
  ARGV[8] tenant: owner tenant   ARGV[9] sessionTtlS: the sampling session's ttl s ('' = no session to touch)
  ARGV[10] ownerTtlS: owner ttl s

  Returns 1 queued, 0 a replay of the same request (its job exists with this payload),
  -1 the queue is full (nothing written), -2 the job id was used by another payload (nothing written).
]]
--- @include "bullmq-job"

local function admitted(r)
  redis.call('SET', KEYS[3], ARGV[8], 'EX', tonumber(ARGV[10]), 'NX')
  if ARGV[9] ~= '' then redis.call('EXPIRE', KEYS[4], tonumber(ARGV[9])) end
  return r
end

local stored = redis.call('HGET', KEYS[1], 'data')
if stored then
  if stored ~= ARGV[4] then return -2 end
  return admitted(0)
end
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[7]) then return -1 end
bullStoreJob(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
bullPushJob(ARGV[1], ARGV[2])
return admitted(1)
