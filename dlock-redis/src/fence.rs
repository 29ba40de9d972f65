//! [`RedisFence`]: a lock's fencing token checked where the protected data
//! lives, when that is Redis.

use std::sync::LazyLock;

use dlock_core::{FenceError, FencingToken, StaleToken};
use redis::aio::ConnectionLike;
use redis::{FromRedisValue, Script, ToRedisArgs};

/// The error code a refused fenced script answers with.
const STALE: &str = "DLOCK_STALE";

/// Defines `dlock_fence(fence_key, token)`: records `token` in `fence_key`
/// and returns, or answers `DLOCK_STALE <highest>` if a newer token is
/// recorded. Tokens are compared as decimal strings (length, then digits):
/// Lua's numbers are doubles, exact only up to 2^53.
const GUARD: &str = r#"
local function dlock_fence(fence_key, token)
  local highest = redis.call('GET', fence_key)
  if highest and (#highest > #token or (#highest == #token and highest > token)) then
    return redis.error_reply('DLOCK_STALE ' .. highest)
  end
  redis.call('SET', fence_key, token)
  return nil
end
"#;

/// `SET KEYS[2] ARGV[2]` under the fence `KEYS[1]`, token `ARGV[1]`.
static SET: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{GUARD}\nlocal refused = dlock_fence(KEYS[1], ARGV[1])\n\
         if refused then return refused end\n\
         redis.call('SET', KEYS[2], ARGV[2])\nreturn 1"
    ))
});

/// Fenced writes to Redis: each is one script that checks the token against
/// the highest recorded for the resource (in the resource's *fence key*),
/// records it, and writes, atomically on the server; an older token is
/// [`FenceError::Stale`] and writes nothing. Equal tokens are accepted, so a
/// holder may write many times.
///
/// The fence key is yours to name, one per resource; on Redis Cluster give it
/// and the data keys one hash tag (`{acct:42}:fence`, `{acct:42}:balance`)
/// so that they share a slot. Tokens are per lock name: guard one resource
/// with one lock name on one backend.
///
/// Rules of use:
/// * **Never let the fence key go**: no TTL on it, and a `maxmemory-policy`
///   that cannot evict it (`noeviction`, or a `volatile-*` one): a fence key
///   that is gone accepts any token.
/// * A body given to [`eval`](Self::eval) is cached by the server as a
///   script for good: keep bodies constant and pass values in `args`. Up to
///   a few thousand keys and args (Lua's `unpack`). A body that fails half
///   way keeps what it wrote before (the token was current).
///
/// ```no_run
/// # async fn demo(mut conn: redis::aio::MultiplexedConnection, guard: dlock_core::LockGuard) -> Result<(), dlock_core::FenceError> {
/// use dlock_redis::RedisFence;
///
/// let fence = RedisFence::new("{acct:42}:fence");
/// fence.set(&mut conn, guard.token(), "{acct:42}:balance", 90).await?;
/// // Your own Lua, run only if the token is current (KEYS and ARGV are yours):
/// let _: i64 = fence
///     .eval(&mut conn, guard.token(),
///           "return redis.call('INCRBY', KEYS[1], ARGV[1])",
///           &["{acct:42}:balance"], &["-10"])
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisFence {
    key: String,
}

impl RedisFence {
    /// The fence kept in `fence_key`.
    pub fn new(fence_key: impl Into<String>) -> Self {
        Self {
            key: fence_key.into(),
        }
    }

    /// The fence key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// `SET key value`, if `token` is current.
    pub async fn set<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: FencingToken,
        key: &str,
        value: impl ToRedisArgs,
    ) -> Result<(), FenceError> {
        let mut invocation = SET.prepare_invoke();
        invocation
            .key(&self.key)
            .key(key)
            .arg(token.get().to_string())
            .arg(value);
        let result: redis::RedisResult<i64> = invocation.invoke_async(conn).await;
        self.answer(token, result).map(|_| ())
    }

    /// Runs `body` (a Lua script body: its `KEYS` and `ARGV` are `keys` and
    /// `args`) if `token` is current, and returns what it returns. The check
    /// and the body run as one script, so nothing can write between them.
    pub async fn eval<C: ConnectionLike + Send, T: FromRedisValue>(
        &self,
        conn: &mut C,
        token: FencingToken,
        body: &str,
        keys: &[&str],
        args: &[&str],
    ) -> Result<T, FenceError> {
        // The user's body runs in a function of its own, whose KEYS and ARGV
        // are the script's without the fence's own key and token.
        let script = Script::new(&format!(
            "{GUARD}\nlocal refused = dlock_fence(KEYS[1], ARGV[1])\n\
             if refused then return refused end\n\
             local function body(KEYS, ARGV)\n{body}\nend\n\
             return body({{unpack(KEYS, 2)}}, {{unpack(ARGV, 2)}})"
        ));
        let mut invocation = script.prepare_invoke();
        invocation.key(&self.key).arg(token.get().to_string());
        for key in keys {
            invocation.key(*key);
        }
        for arg in args {
            invocation.arg(*arg);
        }
        let result: redis::RedisResult<T> = invocation.invoke_async(conn).await;
        self.answer(token, result)
    }

    /// The highest token accepted so far, if any.
    pub async fn highest<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
    ) -> Result<Option<FencingToken>, FenceError> {
        let value: redis::RedisResult<Option<u64>> =
            redis::cmd("GET").arg(&self.key).query_async(conn).await;
        value
            .map(|v| v.map(FencingToken::new))
            .map_err(|e| self.store_error(e))
    }

    fn answer<T>(
        &self,
        token: FencingToken,
        result: redis::RedisResult<T>,
    ) -> Result<T, FenceError> {
        match result {
            Ok(v) => Ok(v),
            Err(e) if e.code() == Some(STALE) => {
                let highest = e
                    .detail()
                    .and_then(|d| d.trim().parse().ok())
                    .map_or(token, FencingToken::new);
                Err(FenceError::Stale {
                    resource: self.key.clone(),
                    stale: StaleToken { token, highest },
                })
            }
            Err(e) => Err(self.store_error(e)),
        }
    }

    fn store_error(&self, e: redis::RedisError) -> FenceError {
        FenceError::Store {
            resource: self.key.clone(),
            source: Box::new(e),
        }
    }
}
