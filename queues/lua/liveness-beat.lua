--[[
  One agent heartbeat (queues/liveness.ts Liveness.beat): refreshes the liveness key and the record.

  KEYS[1] the agent's liveness key   KEYS[2] its reaped marker   KEYS[3] the agents' records (hash)
  ARGV[1] incarnation   ARGV[2] now ms   ARGV[3] the key's ttl ms   ARGV[4] agent id   ARGV[5] record (JSON)

  Returns 'reaped' (this incarnation was reaped), 'taken' (another incarnation holds the id) or 'ok'.
]]
local r = redis.call('GET', KEYS[2])
if r and string.sub(r, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then return 'reaped' end
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1] + 1) ~= ARGV[1] .. ' ' then return 'taken' end
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. ARGV[2], 'PX', ARGV[3])
redis.call('HSET', KEYS[3], ARGV[4], ARGV[5])
return 'ok'
