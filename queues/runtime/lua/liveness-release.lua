--[[
  An agent stopping (queues/runtime/liveness.ts Liveness.release): deletes its liveness key while it is still
  this incarnation's. The record stays (the reaper fails what is left on a stopped agent).

  KEYS[1] alive: the agent's liveness key   KEYS[2] agents: the agents' records (unused; declared for the caller)
  ARGV[1] incarnation: this process's incarnation   ARGV[2] agentId: agent id

  Returns 1 when deleted, else 0.
]]
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
