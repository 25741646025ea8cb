--[[
  Moves an adopted model to its new agent (workers/agent/adoption.ts), in one step, so that no op of
  the model can be queued for the dead agent after it: the model's jobs that never started leave the
  dead agent's queue for the new one's, in the order they were to run; its ops held behind a gap
  will be released there; every moved job gets a moved marker (its future's request id still names
  the old queue, api/futures.ts follows the marker); the record names the new agent and queue; the
  model leaves the orphans. A job with an outcome record (the op that was running when the agent
  died, failed by the reaper; or one that finished) stays where it is.

  KEYS[1] model: the model's record   KEYS[2] orphans: the orphans (zset)
  KEYS[3] held: the model's gate held ops (seq_id -> '<queue> <job id>')
  ARGV[1] modelId: model id
  ARGV[2] expected: the record as the adopter read it (the move is refused if it changed since)
  ARGV[3] record: the new record (JSON)
  ARGV[4] bullPrefix: BullMQ key prefix ('<prefix>-bull:')
  ARGV[5] fromQueue: the dead agent's queue   ARGV[6] toQueue: the adopter's queue
  ARGV[7] trainJobIdPrefix: job id prefix of the model's ordered ops ('t-<hash>-')
  ARGV[8] otherJobIds: the model's other job ids, space separated: its create and its load at create
          (they run before its ordered ops), then its unload (after them)
  ARGV[9] movedBefore: a moved marker's key text before the job id   ARGV[10] movedAfter: after it
  ARGV[11] movedTtlS: the markers' TTL, s
  ARGV[12] outcomeBefore: the outcome key's text before the job id    ARGV[13] outcomeAfter: after it

  Returns -1 when the record changed since the adopter read it (nothing done), else how many jobs moved.
]]
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return -1 end
local from = ARGV[4] .. ARGV[5] .. ':'
local to = ARGV[4] .. ARGV[6] .. ':'
local prefix = ARGV[7]
-- Each moved job's place in the run order: create, load at create, the ordered ops by seq_id, unload.
local place = {}
local i = 0
for id in string.gmatch(ARGV[8], '%S+') do
  i = i + 1
  place[id] = (i == 3) and math.huge or (i - 1000000000)
end
local function mark(id, where)
  redis.call('SET', ARGV[9] .. id .. ARGV[10], where, 'EX', tonumber(ARGV[11]))
end

local moved = 0
if from ~= to then
  local ids = {}
  for _, list in ipairs({ 'wait', 'active', 'paused' }) do
    for _, id in ipairs(redis.call('LRANGE', from .. list, 0, -1)) do
      local ours = place[id] ~= nil
      if not ours and string.sub(id, 1, #prefix) == prefix then
        place[id] = tonumber(string.sub(id, #prefix + 1)) or 0
        ours = true
      end
      if ours and redis.call('EXISTS', ARGV[12] .. id .. ARGV[13]) == 0 then
        redis.call('LREM', from .. list, 0, id)
        redis.call('DEL', from .. id .. ':lock')
        table.insert(ids, id)
      end
    end
  end
  table.sort(ids, function(a, b) return place[a] < place[b] end)
  for _, id in ipairs(ids) do
    if redis.call('EXISTS', from .. id) == 1 then
      redis.call('RENAME', from .. id, to .. id)
      -- The consumer takes from the right end: the first to run is pushed first.
      redis.call('LPUSH', to .. 'wait', id)
      redis.call('XADD', to .. 'events', 'MAXLEN', '~', 10000, '*', 'event', 'waiting', 'jobId', id, 'prev', 'moved')
      mark(id, ARGV[6])
      moved = moved + 1
    end
  end
  -- Wakes the new agent's consumer.
  if moved > 0 then redis.call('ZADD', to .. 'marker', 0, '0') end
  -- Held ops: their jobs are stored on the queue they will be released onto.
  local held = redis.call('HGETALL', KEYS[3])
  for k = 1, #held, 2 do
    local q, id = string.match(held[k + 1], '^(%S+) (%S+)$')
    if q == ARGV[5] then
      if redis.call('EXISTS', from .. id) == 1 then redis.call('RENAME', from .. id, to .. id) end
      redis.call('HSET', KEYS[3], held[k], ARGV[6] .. ' ' .. id)
      mark(id, ARGV[6])
    end
  end
end
redis.call('SET', KEYS[1], ARGV[3], 'KEEPTTL')
redis.call('ZREM', KEYS[2], ARGV[1])
return moved
