--[[
  The per-model ordering gate's shared steps (queues/runtime/gate.ts). A model's gate is:
    next       the seq_id released next (it keeps its TTL: the model's lifetime, queues/contract/names.ts)
    held       seq_id -> '<queue> <job id>' (an admitted op whose job hash is stored) or '- <job id>' (a
               seq_id used up by a refused request)
    held-index job id -> model id, for every held entry (a held future is pending, not unknown)
    digests    seq_id -> payload digest, for `window` seq_ids back (replays with another payload)
    gaps       (shared) model id -> deadline of the ops waiting behind a gap
  `G` is the table { next, held, index, digests, gaps } of key names.
]]

local function nowMs()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function heldParts(v)
  local sp = string.find(v, ' ', 1, true)
  return string.sub(v, 1, sp - 1), string.sub(v, sp + 1)
end

-- Releases the in-order prefix of held entries onto their queue; returns how many moved. `nxt`, when
-- given, is the gate's next seq_id as the caller read it; `first`, when given, is the op at that seq_id,
-- admitted by the caller without being held ({ queue ('-' for a used-up seq_id), jobId }): it goes first.
-- The gate never holds an entry at its next seq_id (a drain moves next past every held op in order),
-- and holds none at all while the model has no entry in gaps (an op held adds one; only a drain that
-- leaves nothing held, or an expiry that fails every held op, removes it): `noneHeld` (the caller
-- found no gap deadline standing) skips looking.
local function gateDrain(G, modelId, bullPrefix, window, gapMs, nxt, first, noneHeld)
  nxt = nxt or tonumber(redis.call('GET', G.next))
  local start = nxt
  if first then
    if first.queue ~= '-' then bullPushJob(bullPrefix .. first.queue .. ':', first.jobId) end
    redis.call('HDEL', G.digests, tostring(nxt - window))
    nxt = nxt + 1
    if noneHeld then
      redis.call('SET', G.next, tostring(nxt), 'KEEPTTL')
      return 1
    end
  end
  while true do
    local v = redis.call('HGET', G.held, tostring(nxt))
    if not v then break end
    local queue, jobId = heldParts(v)
    if queue ~= '-' then bullPushJob(bullPrefix .. queue .. ':', jobId) end
    redis.call('HDEL', G.held, tostring(nxt))
    redis.call('HDEL', G.index, jobId)
    redis.call('HDEL', G.digests, tostring(nxt - window))
    nxt = nxt + 1
  end
  if nxt == start then return 0 end
  redis.call('SET', G.next, tostring(nxt), 'KEEPTTL')
  -- The gap deadline counts from when the gate last moved.
  redis.call('ZREM', G.gaps, modelId)
  if redis.call('HLEN', G.held) > 0 then redis.call('ZADD', G.gaps, nowMs() + gapMs, modelId) end
  return nxt - start
end

-- A gap past its deadline: every op held behind it fails (a failed-future record with the reason; its
-- job hash is removed), every missing seq_id up to the last held one gets the same record (a late
-- arrival finds it), and the gate moves past them. Returns how many held ops failed, true when the
-- gate's next seq_id moved, and true when the model holds nothing (no gap deadline stands: see gateDrain).
local function gateExpireGap(G, modelId, bullPrefix, failedPrefix, failedTtlS, gapS)
  local dl = redis.call('ZSCORE', G.gaps, modelId)
  if not dl then return 0, false, true end
  if tonumber(dl) > nowMs() then return 0, false, false end
  redis.call('ZREM', G.gaps, modelId)
  local nxt = tonumber(redis.call('GET', G.next))
  if not nxt then return 0, false, true end
  local last = nxt - 1
  for _, s in ipairs(redis.call('HKEYS', G.held)) do
    if tonumber(s) > last then last = tonumber(s) end
  end
  if last < nxt then return 0, false, true end
  local missing = {}
  for s = nxt, last do
    if redis.call('HEXISTS', G.held, tostring(s)) == 0 then table.insert(missing, s) end
  end
  local gap = table.concat(missing, ', ')
  local n = 0
  for s = nxt, last do
    local v = redis.call('HGET', G.held, tostring(s))
    local msg
    local op = 'forward_backward'
    local jobId
    if v then
      local queue
      queue, jobId = heldParts(v)
      if queue ~= '-' then
        local jobKey = bullPrefix .. queue .. ':' .. jobId
        op = redis.call('HGET', jobKey, 'name') or op
        redis.call('DEL', jobKey)
      end
      redis.call('HDEL', G.held, tostring(s))
      redis.call('HDEL', G.index, jobId)
      n = n + 1
      msg = 'not run: seq_id ' .. gap .. ' of model ' .. modelId .. ' never reached the server within ' .. gapS .. ' s, so this op (seq_id ' .. s .. ') and the others waiting behind the gap (up to seq_id ' .. last .. ') were failed without running; the model is as it was before them'
    else
      jobId = nil
      msg = 'not run: this op (seq_id ' .. s .. ' of model ' .. modelId .. ') did not reach the server within ' .. gapS .. ' s while later ops waited; it and the ops behind it (up to seq_id ' .. last .. ') were failed without running'
    end
    -- A missing seq_id's job id is its model's train job id for that seq_id (queues/contract/names.ts jobIds.train).
    if not jobId then jobId = G.jobIdPrefix .. s end
    redis.call('SET', failedPrefix .. jobId, cjson.encode({op = op, category = 'user', message = msg}), 'EX', failedTtlS, 'NX')
  end
  redis.call('SET', G.next, tostring(last + 1), 'KEEPTTL')
  return n, true, true
end
