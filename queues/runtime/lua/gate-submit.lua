--[[
  Admits one training op (or a refused request's seq_id) into its model's ordering gate and, when it
  is in order, releases it and every held op now in order onto the model's queue: the whole submit in
  one round trip (queues/runtime/gate.ts OrderingGate.submit / skip).

  KEYS[1] next: gate next            KEYS[2] held: gate held        KEYS[3] heldIndex: gate held-index
  KEYS[4] digests: gate digests      KEYS[5] gaps: gate gaps        KEYS[6] agentAlive: the agent's liveness key
  KEYS[7] owner: the future's owner record                          KEYS[8] modelLast: models' last-request hash
  KEYS[9] agentDrained: the agent's drain record (the models a drained agent saved for its restart)
  KEYS[10] model: the model's record
  KEYS[11] agentRecovers: the agent's recovers marker (it snapshots: its models are adopted when it dies)
  KEYS[12] moved: the op's moved marker (set `pending` when the op is admitted for such an agent while it is not alive)

  ARGV[1]  seqId: seq_id            ARGV[2]  jobId: job id          ARGV[3]  modelId: model id
  ARGV[4]  digest: payload digest ('skip' for a refused request)
  ARGV[5]  window: seq_ids held ahead   ARGV[6]  gapMs: gap timeout ms
  ARGV[7]  digestTtlMs: digest ttl ms
  ARGV[8]  bullPrefix: BullMQ key prefix ('<prefix>-bull:')         ARGV[9]  queue: queue ('' for a refused request)
  ARGV[10] jobName: job name (op)   ARGV[11] jobData: job data (JSON, stored as given)
  ARGV[12] jobOpts: job opts (JSON) ARGV[13] timestamp: job timestamp ms
  ARGV[14] failedPrefix: failed-future key prefix                   ARGV[15] failedTtlS: failed-future ttl s
  ARGV[16] gapS: gap timeout s (for messages)
  ARGV[17] trainJobIdPrefix: job id prefix of the model's train jobs
  ARGV[18] tenant: owner tenant ('' = record no owner)              ARGV[19] ownerTtlS: owner ttl s
  ARGV[20] nowIso: now (ISO time, the model's last request)
  ARGV[21] checkAgent: '1': refuse when the agent is not alive
  ARGV[22] modelTtlMs: the model's lifetime ms (its record and gate live at least this long after each op; never shortened)
  ARGV[23] checkModel: '1': check the model's record (the caller used a copy read earlier): refuse when it is gone or lost
  Optional, sent together or not at all (absent: no take):
  ARGV[24] take: '1': the queue's agent runs in the caller's process and no take of its own is in flight: when the op is
           released, take the queue's next job for it (queues/runtime/lua/train-take-lib.lua) and return it, to be
           handed over in memory (queues/runtime/train-consumer.ts TrainConsumer.handOff); then
  ARGV[25] lockToken: the lock token   ARGV[26] lockMs: the lock's duration, ms   ARGV[27] claim: '1' = claim the outcome
  ARGV[28] outcomeBefore: the outcome key's text before the job id
  ARGV[29] outcomeAfter: its text after the job id
  ARGV[30] agentId: the agent id   ARGV[31] tokenPrefix: the claim token's text before the job id
  ARGV[32] outcomeTtlS: the outcome record's TTL, s

  Returns 1 admitted, 0 duplicate (same payload, or a seq_id already past), -1 gate not open,
  -2 beyond the window, -3 the seq_id was used with another payload, -4 too old to recognise,
  -5 the model's agent is not alive, nor drained with this model saved for its restart, nor one whose
  models are adopted when it dies (nothing written),
  -7 the model's record is gone, { -6, reason } the model is lost, -8 the model is on another queue
  now (an agent adopted it: the caller's copy of its record is old) (with ARGV[23] = '1'; nothing written),
  or, admitted with a job taken (ARGV[24] = '1'), { 1, job id, 1 when more jobs wait else 0, claim, the
  record found first or false (as train-take-lib's), { name, opts, timestamp, ats, atm, data } } where
  data is false when the job taken is the one submitted (the caller has it) and claim is -1 when the
  job's hash was gone (nothing held).
]]
--- @include "bullmq-job"
--- @include "gate-lib"
--- @include "train-take-lib"

local G = { next = KEYS[1], held = KEYS[2], index = KEYS[3], digests = KEYS[4], gaps = KEYS[5], jobIdPrefix = ARGV[17] }
local seq = tonumber(ARGV[1])
local jobId = ARGV[2]
local modelId = ARGV[3]
local window = tonumber(ARGV[5])
local gapMs = tonumber(ARGV[6])
local skip = ARGV[9] == ''

if ARGV[23] == '1' and not skip then
  local rec = redis.call('GET', KEYS[10])
  if not rec then return -7 end
  local m = cjson.decode(rec)
  if m.lost_reason and m.lost_reason ~= cjson.null then return { -6, m.lost_reason } end
  if m.train_queue ~= ARGV[9] then return -8 end
end
local nxt = redis.call('GET', G.next)
if not nxt then return -1 end
if ARGV[21] == '1' and redis.call('EXISTS', KEYS[6]) == 0 then
  -- A drained agent comes back with the models it saved: their ops queue for it, as the ops queued before the drain do.
  -- An agent that snapshots comes back, or another adopts its models: their ops queue and move with them.
  local drained = redis.call('GET', KEYS[9])
  if not drained or not string.find(drained, '"model_id":"' .. modelId .. '"', 1, true) then
    if redis.call('EXISTS', KEYS[11]) == 0 then return -5 end
    -- Its future waits for the model's next agent, whatever the dead one's reaped marker says.
    if not skip then redis.call('SET', KEYS[12], 'pending', 'EX', tonumber(ARGV[15]), 'NX') end
  end
end
local _, moved, noneHeld = gateExpireGap(G, modelId, ARGV[8], ARGV[14], tonumber(ARGV[15]), ARGV[16])
nxt = tonumber(moved and redis.call('GET', G.next) or nxt)

local function owned(r)
  if ARGV[18] ~= '' then redis.call('SET', KEYS[7], ARGV[18], 'EX', tonumber(ARGV[19]), 'NX') end
  if not skip then
    redis.call('HSET', KEYS[8], modelId, ARGV[20])
    -- A model in use lives on (GT: a model kept without a TTL, for its checkpoints, stays so).
    redis.call('PEXPIRE', KEYS[1], ARGV[22], 'GT')
    redis.call('PEXPIRE', KEYS[10], ARGV[22], 'GT')
  end
  return r
end

if seq >= nxt + window then return -2 end
local prev = redis.call('HGET', G.digests, ARGV[1])
if prev then
  if prev ~= ARGV[4] then return -3 end
  return owned(0)
end
if seq < nxt then
  if seq < nxt - window then return -4 end
  return owned(0)
end
-- The op at the gate's next seq_id is never held (gateDrain), so only a later one can be held already.
if seq > nxt and redis.call('HEXISTS', G.held, ARGV[1]) == 1 then return owned(0) end
redis.call('HSET', G.digests, ARGV[1], ARGV[4])
redis.call('PEXPIRE', G.digests, tonumber(ARGV[7]))
local held = skip and '- ' .. jobId or ARGV[9] .. ' ' .. jobId
-- The payload is stored once, as the job itself; releasing it only queues its id.
if not skip then bullStoreJob(ARGV[8] .. ARGV[9] .. ':', jobId, ARGV[10], ARGV[11], ARGV[12], ARGV[13]) end
if seq > nxt then
  redis.call('HSET', G.held, ARGV[1], held)
  redis.call('HSET', G.index, jobId, modelId)
  redis.call('ZADD', G.gaps, 'NX', nowMs() + gapMs, modelId)
  return owned(1)
end
-- In order: released at once, with every held op now in order behind it.
gateDrain(G, modelId, ARGV[8], window, gapMs, nxt, { queue = skip and '-' or ARGV[9], jobId = jobId }, noneHeld)
if ARGV[24] == '1' then
  local q = ARGV[8] .. ARGV[9] .. ':'
  local id, more, exists, claim, prev, ats = trainTake({
    q = q, now = ARGV[13], lockToken = ARGV[25], lockMs = ARGV[26], claim = ARGV[27],
    outcomeBefore = ARGV[28], outcomeAfter = ARGV[29], agentId = ARGV[30], tokenPrefix = ARGV[31],
    nowIso = ARGV[20], outcomeTtlS = ARGV[32], stored = not skip and { id = jobId, name = ARGV[10] } or nil,
  })
  if id then
    if not exists then return owned({ 1, id, more, -1, false, {} }) end
    -- The job submitted here is as this script stored it (no attempt finished yet); another is read.
    local f
    if id == jobId then
      f = { ARGV[10], ARGV[12], ARGV[13], tostring(ats), false, false }
    else
      f = redis.call('HMGET', q .. id, 'name', 'opts', 'timestamp', 'ats', 'atm')
      f[6] = redis.call('HGET', q .. id, 'data')
    end
    return owned({ 1, id, more, claim, prev, f })
  end
end
return owned(1)
