--[[
  One agent heartbeat (queues/runtime/liveness.ts Liveness.beat): refreshes the liveness key and the record.
  The key's value is `<incarnation> <ms>`, the ms read from Redis's own clock (TIME), so its age can be
  told on any host (queues/runtime/lua/agents-live.lua).

  KEYS[1] alive: the agent's liveness key   KEYS[2] reaped: its reaped marker
  KEYS[3] agents: the agents' records (hash)
  ARGV[1] incarnation: this process's incarnation   ARGV[2] ttlMs: the key's ttl ms   ARGV[3] agentId: agent id
  ARGV[4] record: record (JSON)

  Returns 'reaped' (this incarnation was reaped), 'taken' (another incarnation holds the id) or 'ok'.
]]
local r = redis.call('GET', KEYS[2])
if r and string.sub(r, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then return 'reaped' end
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1] + 1) ~= ARGV[1] .. ' ' then return 'taken' end
local t = redis.call('TIME')
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)), 'PX', ARGV[2])
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
return 'ok'
