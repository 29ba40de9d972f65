//! Connections: dialling with every step bounded, the bucket's stream,
//! and the rule that moves requests to a new connection when one goes
//! unanswered.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv::Store;
use dlock_core::Error;
use tokio::time::Instant;

use crate::{Inner, REQUEST_TIMEOUT, SCHEME};

/// A connection and the bucket opened on it.
pub(crate) struct Conn {
    pub(crate) client: async_nats::Client,
    pub(crate) kv: Store,
    /// JetStream publishes with headers (removals, sequence catch-up).
    pub(crate) js: async_nats::jetstream::Context,
}

impl Conn {
    /// A connection's parts, with its own JetStream context.
    pub(crate) fn new(client: async_nats::Client, kv: Store) -> Self {
        let js = async_nats::jetstream::new(client.clone());
        Self { client, kv, js }
    }
}

/// Makes connections to the URL's servers.
pub(crate) struct Dialer {
    pub(crate) servers: Vec<String>,
    /// User and password, or a token (the URL's user without a password).
    pub(crate) credentials: Option<(String, Option<String>)>,
}

impl Dialer {
    /// A new connection, its whole handshake bounded.
    pub(crate) async fn dial(&self, shown: &str) -> Result<async_nats::Client, Error> {
        let mut connect = async_nats::ConnectOptions::new()
            .connection_timeout(REQUEST_TIMEOUT)
            .request_timeout(Some(REQUEST_TIMEOUT))
            // A silently dead connection is noticed within about a second
            // (two unanswered pings), not the client's default two minutes.
            .ping_interval(Duration::from_millis(500))
            // Reconnect attempts 100 ms apart, growing to 1 s (the client's
            // default grows to 4 s, which a lock with a short TTL outlives).
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis(100 * attempts.min(10) as u64)
            })
            .max_reconnects(None);
        connect = match &self.credentials {
            Some((user, Some(password))) => {
                connect.user_and_password(user.clone(), password.clone())
            }
            // `nats://TOKEN@host`: NATS's token authentication.
            Some((token, None)) => connect.token(token.clone()),
            None => connect,
        };
        let connected =
            tokio::time::timeout(REQUEST_TIMEOUT, connect.connect(self.servers.clone()))
                .await
                .map_err(|_| Error::unavailable(SCHEME, format!("no answer from {shown}")))?;
        connected.map_err(|e| match e.kind() {
            async_nats::ConnectErrorKind::AuthorizationViolation
            | async_nats::ConnectErrorKind::Authentication => Error::Auth {
                backend: SCHEME,
                reason: format!("{shown}: {e}"),
            },
            _ => Error::unavailable(SCHEME, format!("cannot connect to {shown}: {e}")),
        })
    }
}

/// Opens the KV bucket `bucket`; one that cannot be opened is created
/// first when `create` gives its `max_age` (see [`create_bucket`]).
pub(crate) async fn open_bucket(
    client: &async_nats::Client,
    bucket: &str,
    create: Option<Duration>,
) -> Result<Store, Error> {
    let js = async_nats::jetstream::new(client.clone());
    let open = || async {
        tokio::time::timeout(REQUEST_TIMEOUT, js.get_key_value(bucket))
            .await
            .map_err(|_| Error::unavailable(SCHEME, "no answer opening the bucket"))
    };
    let opened = match (open().await?, create) {
        (Err(_), Some(max_age)) => {
            create_bucket(client, bucket, max_age).await?;
            open().await?
        }
        (opened, _) => opened,
    };
    opened.map_err(|e| Error::unavailable(SCHEME, format!("cannot open bucket {bucket}: {e}")))
}

/// Creates `bucket`'s stream as KV would (roll-ups and purges allowed: a
/// release purges the held message, see `Inner::remove_exact`), with
/// message deletes allowed too, as buckets of earlier dlock versions were.
///
/// A raw JetStream request: the client's own stream and bucket creation
/// cannot read nats-server 2.9's answer.
async fn create_bucket(
    client: &async_nats::Client,
    bucket: &str,
    max_age: Duration,
) -> Result<(), Error> {
    let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    // (a duplicate window longer than max_age is refused)
    let window = max_age.min(Duration::from_secs(120));
    let config = format!(
        r#"{{"name":"KV_{bucket}","subjects":["$KV.{bucket}.>"],"retention":"limits",
"max_consumers":-1,"max_msgs_per_subject":1,"max_msgs":-1,"max_bytes":-1,
"max_age":{},"max_msg_size":-1,"storage":"file","discard":"new","num_replicas":1,
"duplicate_window":{},"allow_rollup_hdrs":true,"deny_delete":false,"deny_purge":false,
"allow_direct":true}}"#,
        nanos(max_age),
        nanos(window)
    );
    let reply = tokio::time::timeout(
        REQUEST_TIMEOUT,
        client.request(format!("$JS.API.STREAM.CREATE.KV_{bucket}"), config.into()),
    )
    .await
    .map_err(|_| Error::unavailable(SCHEME, "no answer creating the bucket"))?
    .map_err(|e| Error::unavailable(SCHEME, format!("cannot create bucket {bucket}: {e}")))?;
    // `{"error":{"code":..,"err_code":..,"description":".."}}` on failure.
    let text = String::from_utf8_lossy(&reply.payload);
    match text.split_once(r#""description":""#) {
        // (a bucket another client created meanwhile is fine: it is read next)
        Some(_) if text.contains("10058") => Ok(()),
        Some((_, why)) => Err(Error::unavailable(
            SCHEME,
            format!(
                "cannot create bucket {bucket}: {}",
                why.split('"').next().unwrap_or_default()
            ),
        )),
        None => Ok(()),
    }
}

/// A request in flight: if it is dropped unanswered after `STALLED`, the
/// connection is replaced.
pub(crate) struct InFlight<'a> {
    pub(crate) inner: Option<&'a Arc<Inner>>,
    pub(crate) since: Instant,
}

/// How long a request may go unanswered before its connection counts as
/// dead (loopback round trips take well under a millisecond; a request
/// cancelled sooner, e.g. by a caller's `select!`, says nothing).
pub(crate) const STALLED: Duration = Duration::from_millis(50);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.filter(|_| self.since.elapsed() >= STALLED) {
            inner.replace_connection();
        }
    }
}
