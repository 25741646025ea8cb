--[[
  The records of the agents whose liveness key is current, in one round trip
  (queues/registry/agents.ts AgentRegistry.live).

  KEYS[1] the agents' records (hash: agent id -> record)
  ARGV[1] a liveness key's text before the agent id   ARGV[2] its text after the agent id
          (queues/names.ts Names.agentAliveParts)

  Returns the records (JSON) of the live agents.
]]
local all = redis.call('HGETALL', KEYS[1])
local live = {}
for i = 1, #all, 2 do
  if redis.call('EXISTS', ARGV[1] .. all[i] .. ARGV[2]) == 1 then table.insert(live, all[i + 1]) end
end
return live
