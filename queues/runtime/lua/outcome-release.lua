--[[
  Gives back a claim that never ran (queues/runtime/outcomes.ts Outcomes.release): a job taken and claimed
  as the agent began to drain or stop goes back to its queue unstarted, and its next taker must be
  able to claim it. Only a running record of that very claim is removed.

  KEYS[1] outcome: the op's outcome record
  ARGV[1] token: the claim token

  Returns 1 when removed, else 0.
]]
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local o = cjson.decode(v)
if o.state ~= 'running' or o.token ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
