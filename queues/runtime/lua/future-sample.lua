--[[
  A sample's future, read in one round trip for the tenant that asks (queues/runtime/queues.ts
  QueueSet.sampleFuture): a future issued to another tenant (or to none) reads as unknown and is
  left as it is. A finished job, once read, leaves Redis soon with the owner record.

  KEYS[1] owner: the future's owner record   KEYS[2] job: the sample's BullMQ job
  KEYS[3] failed: the failed-future record
  ARGV[1] tenant: the asking tenant          ARGV[2] readTtlMs: ms to keep a finished job once read

  Returns 0 when the future is not the tenant's, else
          { job name (its op) | false, finishedOn | false, failedReason | false, returnvalue | false,
            failed-future record (read only when there is no job) | false }.
]]
local owner = redis.call('GET', KEYS[1])
if not owner or owner == '' or owner ~= ARGV[1] then return 0 end
local job = redis.call('HMGET', KEYS[2], 'name', 'finishedOn', 'failedReason', 'returnvalue')
if not job[1] then return { false, false, false, false, redis.call('GET', KEYS[3]) or false } end
if job[2] then
  for i = 1, 2 do redis.call('PEXPIRE', KEYS[i], ARGV[2], 'LT') end
end
return { job[1], job[2] or false, job[3] or false, job[4] or false, false }
