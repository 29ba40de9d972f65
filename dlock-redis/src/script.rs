//! The Lua scripts: every state change is one atomic script on one node.
//!
//! Keys per lock name N (the name in a hash tag, so all of them map to one
//! Cluster slot): `P:{N}` the lock hash (`owner`, `session`, `token`, `why`,
//! `at`) with a `PX` expiry; `P:{N}:t` the last token, kept for 10 s after
//! release on a single Redis and for good on Redlock nodes; `P:{N}:r:ID`, the
//! receipt of one release request, for 10 s; channel `P:{N}:c` for release
//! notifications. Per node (per slot on a Redis Cluster, `P:boot:{T}`):
//! `P:boot`, the restart guard's record (`run`, `since`).
//!
//! Tokens: `max(last + 1, TIME in µs)`. While the last-token key lives, that is
//! `last + 1`; once it is gone (expired, or lost with a restart without
//! persistence) the server clock in microseconds is larger than every token
//! issued before — **assuming the server's clock never steps back**. That
//! floor only orders tokens one server issued: Redlock nodes therefore keep
//! the key for good (a node two quorums share then orders their tokens,
//! whatever the skew between the nodes' clocks).
//!
//! Restart guard (when `min_uptime > 0`): the server's `run_id` (from `INFO
//! server`, drawn at random by every server process at start and never
//! persisted) is compared with the one recorded in `P:boot`, and its
//! replication id (`master_replid`, from `INFO replication`) with the
//! recorded one when the server was promoted (`master_replid2` set: a
//! promotion draws a new id and keeps the old one there; creating or
//! freeing the replication backlog draws a new id too but clears it, and
//! is no new term). A missing record, another `run_id`, or another id after
//! a promotion means a server process, or a term as master, dlock has not
//! seen before (a restart with or without data, a promoted replica — also
//! one that was master before and kept an old record of its own —, a
//! `FLUSHALL`): the node records them with the server time and, for
//! `min_uptime` from then, grants nothing and confirms no renewal. A
//! record without the replication id (written by an earlier dlock) is
//! adopted, so old and new clients can share a deployment.
use redis::Script;
use std::sync::LazyLock;

/// Defines `guard_wait(key, min_uptime_ms, now_ms)`: the ms this node must
/// still wait before it may grant or confirm a renewal (0: it may).
const GUARD: &str = r#"
local function guard_wait(key, min_uptime, now_ms)
  if min_uptime <= 0 then return 0 end
  local run = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
  if not run then error('dlock: INFO server shows no run_id') end
  -- The replication ids ('' before Redis 4: the run_id alone counts then).
  -- A promotion draws a new master_replid and keeps the old one as
  -- master_replid2; creating or freeing the replication backlog draws a
  -- new one too, but clears master_replid2: that is no new term.
  local repl = redis.call('INFO', 'replication')
  local replid = string.match(repl, 'master_replid:(%x+)') or ''
  local replid2 = string.match(repl, 'master_replid2:(%x+)') or ''
  local promoted = string.find(replid2, '[^0]') ~= nil
  local since = nil
  if redis.call('TYPE', key)['ok'] == 'hash' then
    local v = redis.call('HMGET', key, 'run', 'since', 'replid')
    -- (a record without replid, written before it was kept, is adopted)
    if v[1] == run and not (v[3] and v[3] ~= replid and promoted) then
      since = tonumber(v[2])
      if v[3] ~= replid then redis.call('HSET', key, 'replid', replid) end
    end
  end
  if not since then
    redis.call('DEL', key)
    redis.call('HSET', key, 'run', run, 'replid', replid, 'since', string.format('%.0f', now_ms))
    return min_uptime
  end
  return math.max(0, math.ceil(min_uptime - (now_ms - since)))
end
"#;

/// Defines `set_last(key, token, keep_ms)`: the last-token key, expiring
/// after `keep_ms`, or never when it is 0 (Redlock).
const SET_LAST: &str = r#"
local function set_last(key, token, keep_ms)
  if keep_ms > 0 then
    redis.call('SET', key, token, 'PX', keep_ms)
  else
    redis.call('SET', key, token)
  end
end
"#;

fn guarded(body: &str) -> Script {
    Script::new(&format!(
        "if redis.replicate_commands then redis.replicate_commands() end\n{GUARD}\n{SET_LAST}\n{body}"
    ))
}

/// A script that writes the last-token key.
fn with_set_last(body: &str) -> Script {
    Script::new(&format!("{SET_LAST}\n{body}"))
}

/// Take if free. KEYS: lock, last, boot, the attempt's tombstone. ARGV:
/// owner, session, why, ttl_ms, keep_last_ms, min_uptime_ms. Returns
/// `{1, token}` (granted, also when this owner already holds it — then the
/// expiry is extended too), `{0, ms_until_retry}` (busy, or the restart
/// guard is on) or `{-1, 0}`: the attempt ended while this take was on the
/// wire (its tombstone exists, see [`RELEASE`]), and it grants nothing.
pub(crate) static TAKE: LazyLock<Script> = LazyLock::new(|| {
    guarded(
        r#"
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local wait = guard_wait(KEYS[3], tonumber(ARGV[6]), math.floor(now_us / 1000))
if wait > 0 then return {0, wait} end
if redis.call('EXISTS', KEYS[4]) == 1 then return {-1, 0} end
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner then
  if owner == ARGV[1] then
    -- A retry after a lost reply: the client counts validity from now.
    redis.call('PEXPIRE', KEYS[1], ARGV[4])
    return {1, tonumber(redis.call('HGET', KEYS[1], 'token'))}
  end
  return {0, redis.call('PTTL', KEYS[1])}
end
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
local token = math.max(last + 1, now_us)
local token_s = string.format('%.0f', token)
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'session', ARGV[2], 'token', token_s,
  'why', ARGV[3], 'at', string.format('%.0f', now_us / 1000))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
set_last(KEYS[2], token_s, tonumber(ARGV[5]) > 0 and tonumber(ARGV[4]) + tonumber(ARGV[5]) or 0)
return {1, token}
"#,
    )
});

/// Owner-checked release. KEYS: lock, last, receipt, the attempt's
/// tombstone. ARGV: owner, token (`""`: any), channel, keep_last_ms,
/// receipt_ms, tombstone_ms. With `tombstone_ms` > 0 (the attempt ends
/// while a take of it may still be on the wire: `Doubtful`) it first
/// leaves the attempt's tombstone for that long, whoever holds the lock
/// now: a take of the attempt that lands later, even after other attempts'
/// grants and releases, is refused (see [`TAKE`]). Returns 1 if released,
/// by this request or by an earlier sending of the very same request: a
/// release leaves a receipt key of its own (named by 64 random bits per
/// request) for `receipt_ms`, so that a request sent again after its reply
/// was lost (the Redis Cluster client resends the requests of a connection
/// that broke) reports what the first sending did, not "not held". A new
/// release request of the same hold has a new receipt key, and is "not
/// held". (Takes and renewals need no receipt: sent again, they grant or
/// extend the same attempt's hold, and an extension counted from after the
/// client's send errs on the safe side.) `receipt_ms` 0 keeps none: only
/// the Cluster driver resends (one server's and Redlock's connections never
/// do; dlock-core's own retries of a release know their first try's reply
/// was lost and take "not held" for done, S4), so a receipt there would be
/// a key written per release for nothing.
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    with_set_last(
        r#"
local keep_receipt = tonumber(ARGV[5]) > 0
if tonumber(ARGV[6]) > 0 then redis.call('SET', KEYS[4], '1', 'PX', ARGV[6]) end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  if keep_receipt then return redis.call('EXISTS', KEYS[3]) end
  return 0
end
local token = redis.call('HGET', KEYS[1], 'token')
if ARGV[2] ~= '' and token ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
set_last(KEYS[2], token, tonumber(ARGV[4]))
if keep_receipt then redis.call('SET', KEYS[3], '1', 'PX', ARGV[5]) end
redis.call('PUBLISH', ARGV[3], '1')
return 1
"#,
    )
});

/// Owner-checked renewal of many holds. KEYS: lock keys, then boot. ARGV:
/// ttl_ms, min_uptime_ms, then owner and token per lock key. Returns 1/0 per
/// lock key (all 0 while the restart guard is on: a restarted node vouches
/// for nothing).
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    guarded(
        r#"
local out = {}
local n = #KEYS - 1
local min_uptime = tonumber(ARGV[2])
if min_uptime > 0 then
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if guard_wait(KEYS[#KEYS], min_uptime, now_ms) > 0 then
    for i = 1, n do out[i] = 0 end
    return out
  end
end
for i = 1, n do
  if redis.call('HGET', KEYS[i], 'owner') == ARGV[2 * i + 1]
     and redis.call('HGET', KEYS[i], 'token') == ARGV[2 * i + 2] then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"#,
    )
});

/// Holder details. KEYS: lock. Returns `{session, token, why, at_ms, pttl,
/// now_ms, owner}` as strings, or nil if free.
pub(crate) static INSPECT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local v = redis.call('HMGET', KEYS[1], 'session', 'token', 'why', 'at', 'owner')
if not v[2] then return nil end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {v[1] or '', v[2], v[3] or '', v[4] or '0',
  tostring(redis.call('PTTL', KEYS[1])), string.format('%.0f', now_ms), v[5] or ''}
"#,
    )
});

/// Whether `token` is the live holder's. KEYS: lock. ARGV: token.
pub(crate) static VALIDATE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] and redis.call('PTTL', KEYS[1]) > 0 then
  return 1
end
return 0
"#,
    )
});

/// Admin break. KEYS: lock, last, receipt. ARGV: channel, keep_last_ms,
/// receipt_ms. Returns 1 if it was held. Like a release it leaves a
/// receipt key of its own request (on a cluster: `receipt_ms` > 0), with
/// its answer (also "it was free"): the same request sent again (after its
/// connection broke) answers the same and must not break the hold of
/// whoever took the lock meanwhile.
pub(crate) static FORCE: LazyLock<Script> = LazyLock::new(|| {
    with_set_last(
        r#"
local keep_receipt = tonumber(ARGV[3]) > 0
if keep_receipt then
  local done = redis.call('GET', KEYS[3])
  if done then return tonumber(done) end
end
local token = redis.call('HGET', KEYS[1], 'token')
if not token then
  if keep_receipt then redis.call('SET', KEYS[3], '0', 'PX', ARGV[3]) end
  return 0
end
redis.call('DEL', KEYS[1])
set_last(KEYS[2], token, tonumber(ARGV[2]))
if keep_receipt then redis.call('SET', KEYS[3], '1', 'PX', ARGV[3]) end
redis.call('PUBLISH', ARGV[1], '1')
return 1
"#,
    )
});

/// Redlock: after a quorum grant, write the chosen token (the quorum's
/// largest) to this node's hold and last-token key, so any later grant that
/// overlaps this quorum issues a larger one. KEYS: lock, last. ARGV: owner,
/// token, keep_ms. Returns 1 if this owner holds the lock here.
pub(crate) static BUMP: LazyLock<Script> = LazyLock::new(|| {
    with_set_last(
        r#"
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'token', ARGV[2])
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[2]) > last then
  set_last(KEYS[2], ARGV[2], tonumber(ARGV[3]))
end
return 1
"#,
    )
});

/// Restart guard alone: starts the guard's clock on a server process dlock
/// has not seen yet. KEYS: boot. ARGV: min_uptime_ms. Returns the ms left
/// before the node may grant.
pub(crate) static READY: LazyLock<Script> = LazyLock::new(|| {
    guarded(
        r#"
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return guard_wait(KEYS[1], tonumber(ARGV[1]), now_ms)
"#,
    )
});
