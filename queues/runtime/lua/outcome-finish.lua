--[[
  Records a training op's final outcome unless one is already final (queues/runtime/outcomes.ts
  Outcomes.finish), and signals it on the outcomes channel, which every API process listens to (a
  waiting retrieve_future answers at once): the message is '<job id> <record>' when the record is at
  most ARGV[6] bytes (the waiter answers from it, without reading it back), else the job id alone.
  A record already handed over in the caller's process (ARGV[8]) is not sent back to it: no message
  when its subscriptions are the channel's only ones.

  When a waiter in the agent's own process has already answered from this record (an early signal,
  queues/runtime/completions.ts), its read-once expiry is applied here, whichever record stands: KEYS[2..]
  then leave Redis within ARGV[7] ms (PEXPIRE LT, as api/futures.ts does after a read).

  KEYS[1] outcome: the op's outcome record
  KEYS[2..] readOnce: the keys of a read-once expiry (none: no expiry)
  ARGV[1] record: the final record (JSON)   ARGV[2] ttlS: ttl s
  ARGV[3] token: the claim token that may finish; '' = the reaper, which may finish any running or absent record
  ARGV[4] channel: the outcomes channel   ARGV[5] jobId: the job id
  ARGV[6] signalMaxBytes: the largest record sent in the message, in bytes
  ARGV[7] readOnceMs: the read-once expiry, ms (with KEYS[2..])
  ARGV[8] handed: how many subscriptions to the channel were handed the record in the caller's process:
          no message is sent when no other connection subscribes ('0': always sent)
  Optional, sent together or not at all (absent: the job is not ended here):
  ARGV[9] endQueuePrefix: '' or, to end the op's BullMQ job as completed once this (done) record is
          written, its queue's key prefix ('<prefix>-bull:<queue>:'; queues/runtime/lua/bullmq-job.lua bullCompleteJob)
  ARGV[10] lockToken: the job lock's token   ARGV[11] finishedOn: the job's finishedOn, ms

  Returns false when recorded (with ARGV[9]: bullCompleteJob's code: 1 ended, 0 left for BullMQ,
  negative not ended), else the record that stands (the job is not ended).
]]
--- @include "bullmq-job"

local function expireRead()
  for i = 2, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[7], 'LT') end
end
local v = redis.call('GET', KEYS[1])
if v then
  local o = cjson.decode(v)
  if o.state ~= 'running' or (ARGV[3] ~= '' and o.token ~= ARGV[3]) then
    expireRead()
    return v
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
local handed = tonumber(ARGV[8])
if handed == 0 or redis.call('PUBSUB', 'NUMSUB', ARGV[4])[2] > handed then
  if #ARGV[1] <= tonumber(ARGV[6]) then
    redis.call('PUBLISH', ARGV[4], ARGV[5] .. ' ' .. ARGV[1])
  else
    redis.call('PUBLISH', ARGV[4], ARGV[5])
  end
end
expireRead()
if ARGV[9] ~= nil and ARGV[9] ~= '' then return bullCompleteJob(ARGV[9], ARGV[5], ARGV[10], ARGV[11]) end
return false
