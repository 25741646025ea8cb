--[[
  Everything a training op's future depends on, read in one round trip (api/futures.ts), for the
  tenant that asks: a future issued to another tenant (or to none) reads as unknown and is left as
  it is. A final outcome, once read, leaves Redis soon with the op's job and the owner record,
  unless `keep` (create_model's: its job id makes it idempotent).

  An op whose model was adopted by another agent (workers/agent/adoption.ts) has a moved marker: its
  job is on that agent's queue (or still on the dead one's, `pending`, until one adopts it), and the
  dead agent's reaped marker does not concern it.

  KEYS[1] outcome: the outcome record       KEYS[2] job: the op's BullMQ job
  KEYS[3] owner: the future's owner record  KEYS[4] failed: the failed-future record
  KEYS[5] heldIndex: the gate's held-index  KEYS[6] reaped: the agent's reaped marker
  KEYS[7] moved: the op's moved marker
  ARGV[1] jobId: job id                     ARGV[2] readTtlMs: ms to keep a read outcome
  ARGV[3] keep: '1' = keep for the retention
  ARGV[4] tenant: the asking tenant         ARGV[5] bullPrefix: BullMQ key prefix ('<prefix>-bull:')

  Returns 0 when the future is not the tenant's, else
          { outcome | false, failed-future | false, held model | false, job name (its op) | false,
            job finishedOn | false, job failedReason | false, reaped marker | false }.
]]
local owner = redis.call('GET', KEYS[3])
if not owner or owner == '' or owner ~= ARGV[4] then return 0 end
local moved = redis.call('GET', KEYS[7])
local jobKey = KEYS[2]
if moved and moved ~= 'pending' then jobKey = ARGV[5] .. moved .. ':' .. ARGV[1] end
local o = redis.call('GET', KEYS[1])
if o then
  -- Records are written with `state` first (queues/runtime/outcomes.ts).
  if string.sub(o, 1, 18) ~= '{"state":"running"' then
    if ARGV[3] ~= '1' then
      for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[2], 'LT') end
      if moved then
        redis.call('PEXPIRE', jobKey, ARGV[2], 'LT')
        redis.call('PEXPIRE', KEYS[7], ARGV[2], 'LT')
      end
    end
    return { o, false, false, false, false, false, false }
  end
end
local job = redis.call('HMGET', jobKey, 'name', 'finishedOn', 'failedReason')
return {
  o or false,
  redis.call('GET', KEYS[4]) or false,
  redis.call('HGET', KEYS[5], ARGV[1]) or false,
  job[1] or false,
  job[2] or false,
  job[3] or false,
  (not moved and redis.call('GET', KEYS[6])) or false,
}
