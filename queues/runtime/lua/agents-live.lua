--[[
  The records of the agents whose liveness key is current, in one round trip
  (queues/registry/agents.ts AgentRegistry.live), each with the age of its last heartbeat.

  KEYS[1] agents: the agents' records (hash: agent id -> record)
  ARGV[1] aliveBefore: a liveness key's text before the agent id
  ARGV[2] aliveAfter: its text after the agent id (queues/contract/names.ts Names.agentAliveParts)

  Returns { record (JSON), ms since its last heartbeat (Redis's clock; -1 when the key's value has
  no time), ... } for each live agent.
]]
local all = redis.call('HGETALL', KEYS[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = {}
for i = 1, #all, 2 do
  local v = redis.call('GET', ARGV[1] .. all[i] .. ARGV[2])
  if v then
    local at = tonumber(string.match(v, ' (%d+)$') or '')
    table.insert(live, all[i + 1])
    table.insert(live, at and (now - at) or -1)
  end
end
return live
