--[[
  Claims a training op for running (queues/runtime/outcomes.ts Outcomes.claim): only when it has no record.

  KEYS[1] outcome: the op's outcome record
  ARGV[1] record: the running record (JSON)   ARGV[2] ttlS: ttl s

  Returns false when claimed, else the record that was there first (the op must not run).
]]
local v = redis.call('GET', KEYS[1])
if v then return v end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return false
