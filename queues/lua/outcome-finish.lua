--[[
  Records a training op's final outcome unless one is already final (queues/outcomes.ts
  Outcomes.finish), and signals it: the job id is published on the outcomes channel, which every
  API process listens to (a waiting retrieve_future answers at once).

  KEYS[1] the op's outcome record
  ARGV[1] the final record (JSON)   ARGV[2] ttl s
  ARGV[3] the claim token that may finish; '' = the reaper, which may finish any running or absent record
  ARGV[4] the outcomes channel      ARGV[5] the job id

  Returns false when recorded, else the record that stands.
]]
local v = redis.call('GET', KEYS[1])
if v then
  local o = cjson.decode(v)
  if o.state ~= 'running' then return v end
  if ARGV[3] ~= '' and o.token ~= ARGV[3] then return v end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('PUBLISH', ARGV[4], ARGV[5])
return false
