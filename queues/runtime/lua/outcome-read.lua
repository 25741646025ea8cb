--[[
  Reads a training op's outcome for its future (api/futures.ts). A final outcome, once read, leaves
  Redis soon, with the op's job (its payload) and its owner record, unless it must stay (`keep`:
  create_model's, whose job id makes it idempotent).

  KEYS[1] outcome: the outcome record   KEYS[2] job: the op's job   KEYS[3] owner: the future's owner record
  ARGV[1] readTtlMs: ms to keep them once read   ARGV[2] keep: '1' = keep for the retention

  Returns the record, or false.
]]
local v = redis.call('GET', KEYS[1])
if not v then return false end
-- Records are written with `state` first (queues/runtime/outcomes.ts).
if ARGV[2] ~= '1' and string.sub(v, 1, 18) ~= '{"state":"running"' then
  for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[1], 'LT') end
end
return v
