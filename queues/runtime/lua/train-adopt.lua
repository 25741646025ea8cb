--[[
  At an agent's start, one job that an earlier process of the same agent id left on its training
  queue's active list (queues/runtime/train-consumer.ts TrainConsumer.adoptEarlier). That process is gone (the
  agent id is this process's, queues/runtime/liveness.ts claimId), so nothing will ever end the job unless
  this process does.

  KEYS[1] active: active list   KEYS[2] wait: wait list   KEYS[3] marker: the wake marker  KEYS[4] events: event stream
  KEYS[5] job: the job's hash   KEYS[6] lock: the job's lock   KEYS[7] outcome: the op's outcome record
  ARGV[1] jobId: job id   ARGV[2] lockToken: this consumer's lock token   ARGV[3] lockMs: the lock's duration, ms

  Returns
    { 'gone' }          the job is not active, or its hash is gone (taken off the active list);
    { 'requeued' }      no outcome record: the op never started. It goes back to the head of the
                        wait list (the next job taken), unstarted, to run in its place;
    { 'held', record }  an outcome record stands (running: an earlier process claimed it; or final):
                        the job's lock is now this consumer's, which ends the job as the record says.
]]
if not redis.call('LPOS', KEYS[1], ARGV[1]) then return { 'gone' } end
if redis.call('EXISTS', KEYS[5]) == 0 then
  redis.call('LREM', KEYS[1], 0, ARGV[1])
  redis.call('DEL', KEYS[6])
  return { 'gone' }
end
local o = redis.call('GET', KEYS[7])
if not o then
  redis.call('LREM', KEYS[1], 0, ARGV[1])
  redis.call('DEL', KEYS[6])
  -- The consumer takes from the right end (RPOPLPUSH): this job is taken next.
  redis.call('RPUSH', KEYS[2], ARGV[1])
  redis.call('ZADD', KEYS[3], 0, '0')
  redis.call('XADD', KEYS[4], '*', 'event', 'waiting', 'jobId', ARGV[1], 'prev', 'active')
  return { 'requeued' }
end
redis.call('SET', KEYS[6], ARGV[2], 'PX', ARGV[3])
return { 'held', o }
