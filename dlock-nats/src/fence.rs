//! [`NatsFence`]: a lock's fencing token checked where the protected data
//! lives, when that is a NATS KV bucket.

use async_nats::HeaderMap;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::kv::Store;
use async_nats::jetstream::stream::DirectGetErrorKind;
use bytes::Bytes;
use dlock_core::{FenceError, FencingToken, StaleToken};

/// The header that carries the token of the write that made a value.
pub const FENCE_HEADER: &str = "Dlock-Fence";

/// Tries before a key that keeps moving is reported.
const TRIES: usize = 64;

/// Fenced writes to one key of a NATS KV bucket: the value is written with
/// its token in the header `Dlock-Fence`, conditional on the key's last
/// sequence that the check read, so the server takes it only if no other
/// write came in between; an older token than the key's is
/// [`FenceError::Stale`] and nothing is written. The check is a read of the
/// key's last message before the write (one more round trip), retried if
/// the key moved. Equal tokens are accepted, so a holder may write many
/// times. Readers see the value as usual (`kv.get`).
///
/// The token lives with the value: **never delete or purge a fenced key**
/// (a new value starts from no token), and keep fenced keys in a bucket
/// without `max_age` (an expired value forgets its token too). A value
/// written without the fence counts as token 0. Tokens are per lock name:
/// guard one resource with one lock name on one backend. Buckets under a
/// JetStream domain prefix, mirrors, buckets that drop values on their own
/// and buckets with replicas are refused ([`FenceError::InvalidResource`]);
/// a key that was deleted or purged is [`FenceError::Store`].
///
/// ```no_run
/// # async fn demo(client: async_nats::Client, guard: dlock_core::LockGuard) -> Result<(), Box<dyn std::error::Error>> {
/// use dlock_nats::NatsFence;
///
/// let js = async_nats::jetstream::new(client);
/// let accounts = js.get_key_value("accounts").await?;
/// NatsFence::new("acct.42")
///     .put(&js, &accounts, guard.token(), "90".into())
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct NatsFence {
    key: String,
}

impl NatsFence {
    /// The fence of the bucket's key `key`.
    pub fn new(key: impl Into<String>) -> Self {
        Self { key: key.into() }
    }

    /// The key this fence guards.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Writes `value` to the key of `kv` if `token` is at least the token
    /// of the key's current value; the write's revision. `js` is the
    /// JetStream context the bucket was opened with.
    ///
    /// # Errors
    /// [`FenceError::Stale`] for an older token (nothing written),
    /// [`FenceError::Store`] when the server does not answer or refuses.
    pub async fn put(
        &self,
        js: &async_nats::jetstream::Context,
        kv: &Store,
        token: FencingToken,
        value: Bytes,
    ) -> Result<u64, FenceError> {
        let subject = format!("{}{}", kv.prefix, self.key);
        // (`current` refuses a bucket or key the fence cannot keep)
        for _ in 0..TRIES {
            let (highest, last) = self.current(kv).await?;
            if highest > token.get() {
                return Err(self.stale(token, highest));
            }
            let mut headers = HeaderMap::new();
            headers.insert(FENCE_HEADER, token.get().to_string().as_str());
            headers.insert(
                async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
                last.to_string().as_str(),
            );
            let sent = js
                .publish_with_headers(subject.clone(), headers, value.clone())
                .await
                .map_err(|e| self.store_error(e))?;
            match sent.await {
                Ok(ack) => return Ok(ack.sequence),
                // Another write came in since the read: look again.
                Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => continue,
                Err(e) => return Err(self.store_error(e)),
            }
        }
        Err(self.store_error("the key kept changing"))
    }

    /// The token of the key's current value (0 for an unfenced one), if
    /// the key has a value.
    pub async fn highest(&self, kv: &Store) -> Result<Option<FencingToken>, FenceError> {
        let (highest, last) = self.current(kv).await?;
        Ok((last != 0).then(|| FencingToken::new(highest)))
    }

    /// Refuses what the fence cannot keep its promise on: a key KV would
    /// refuse, a bucket that forgets values on its own (`max_age`, limits
    /// that discard old messages) or whose writes go elsewhere (a mirror, a
    /// JetStream domain), or with replicas (nats-server before 2.9.21
    /// checked a write's expected sequence outside the replicated write:
    /// nats-server#4320).
    fn check_bucket(&self, kv: &Store) -> Result<(), FenceError> {
        let valid_key = !self.key.is_empty()
            && !self.key.starts_with('.')
            && !self.key.ends_with('.')
            && !self.key.contains("..")
            && self
                .key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-/_=.".contains(&b));
        let config = &kv.stream.cached_info().config;
        let why = if !valid_key {
            "not a KV key ([-/_=.a-zA-Z0-9], no empty token)"
        } else if kv.use_jetstream_prefix || kv.put_prefix.is_some() || config.mirror.is_some() {
            "the bucket is a mirror or under a JetStream domain: its writes go to another stream"
        } else if !config.max_age.is_zero()
            || (config.discard == async_nats::jetstream::stream::DiscardPolicy::Old
                && (config.max_messages > 0 || config.max_bytes > 0))
        {
            "the bucket drops values on its own (max_age, or limits that discard old \
             messages): a dropped value forgets its token"
        } else if config.num_replicas > 1 {
            "the bucket has replicas (the fence is proven on one replica only)"
        } else {
            return Ok(());
        };
        Err(FenceError::InvalidResource {
            resource: self.key.clone(),
            why,
        })
    }

    /// The token of the key's last message and its sequence (0 and 0 if
    /// there is none).
    async fn current(&self, kv: &Store) -> Result<(u64, u64), FenceError> {
        self.check_bucket(kv)?;
        let subject = format!("{}{}", kv.prefix, self.key);
        match kv.stream.direct_get_last_for_subject(subject).await {
            // A delete or purge marker: the token went with the value.
            Ok(message) if message.headers.get("KV-Operation").is_some() => Err(self.store_error(
                "the key was deleted or purged, and its token with it (never delete a \
                     fenced key)",
            )),
            Ok(message) => Ok((parse(message.headers.get(FENCE_HEADER)), message.sequence)),
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => Ok((0, 0)),
            Err(e) => Err(self.store_error(e)),
        }
    }

    fn stale(&self, token: FencingToken, highest: u64) -> FenceError {
        FenceError::Stale {
            resource: self.key.clone(),
            stale: StaleToken {
                token,
                highest: FencingToken::new(highest),
            },
        }
    }

    fn store_error(&self, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> FenceError {
        FenceError::Store {
            resource: self.key.clone(),
            source: e.into(),
        }
    }
}

/// The token in a `Dlock-Fence` header: 0 without one (an unfenced
/// write), the largest for an unreadable one (refusing is the safe side).
fn parse(header: Option<&async_nats::HeaderValue>) -> u64 {
    match header {
        None => 0,
        Some(value) => value.as_str().parse().unwrap_or(u64::MAX),
    }
}
