//! dlock on etcd: `etcd://h1:p1,h2:p2,h3:p3[/prefix]` (`etcds://` for TLS).
//!
//! # How it works
//!
//! * **Session = one lease** (`LeaseGrant` with the session TTL, rounded up to
//!   whole seconds as etcd counts them), kept alive by the session's renewal
//!   round: one `LeaseKeepAlive` on the lease's stream plus one read of the
//!   session's keys. The local validity deadline is counted from when the
//!   answered keep-alive was *sent* (S4). A lease that is gone (TTL 0 or
//!   "lease not found") is a lost session. All of a session's locks hang on
//!   its one lease: no lease per lock.
//! * **Take**: `txn(create_revision(key) == 0 → put key with the lease; else get
//!   key)` on the attempt's own key `prefix/<name>/<lease>-<attempt>` (the name
//!   spelled as one path segment, [`LockName::flat`], so `a` and `a/b` never
//!   share a range). Idempotent: a retried take finds its key. The holder is
//!   the key with the lowest create revision under `prefix/<name>/`; a later
//!   key is a waiter. Fair: FIFO by create revision.
//! * **Wake-up**: a waiter watches only the next-lower key (no herd). The
//!   watch starts "from now" and, once etcd confirms it, the waiter reads the
//!   key once more: a deletion before that read is seen by the read, one
//!   after it by the watch. (A watch with a start revision at or below etcd's
//!   current revision is served from the *unsynced* group, which a 100 ms
//!   loop drains; etcd's own lock recipe, and a watch from "read revision +
//!   1" once other clients have written since, land there and wait ~100 ms
//!   per handoff.) On the deletion the waiter re-checks: if another key is
//!   still ahead, it watches that one.
//! * **Token** = the own key's create revision: etcd's global revision, so
//!   strictly increasing per name, durable across restarts and leader changes.
//! * **Release** deletes the own key in a txn comparing its create revision (a
//!   late release never deletes another holder's key); a cancelled or
//!   timed-out waiter deletes its key so it never blocks those behind it.
//!   `force_release` deletes the holder's key; the old holder's next renewal
//!   finds it missing.
//!
//! Each `Lock` handle is its own owner, so two handles of one session on one
//! name get two keys under the same lease (the key carries an attempt id as
//! well as the lease; DESIGN.md sketched `prefix/name/<lease>`).
//!
//! ```no_run
//! # async fn demo() -> Result<(), dlock_core::Error> {
//! use dlock_core::{Backend, SessionOptions};
//! let backend = dlock_etcd::EtcdBackend::connect("etcd://127.0.0.1:2379").await?;
//! let session = backend.session(SessionOptions::new()).await?;
//! let guard = session.lock("jobs/import")?.acquire().await?;
//! guard.release().await?;
//! # Ok(()) }
//! ```

mod session;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::RawSession;
use dlock_core::url::redact;
use dlock_core::{
    Backend, Error, FencingToken, LockInfo, LockName, SessionId, SessionOptions, name,
};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, SortOrder, SortTarget, TlsOptions, Txn,
    TxnOp,
};

const BACKEND: &str = "etcd";

/// The smallest TTL: etcd counts lease TTLs in whole seconds, and its
/// minimum lease TTL depends on the election timeout (1 s with a 500 ms
/// election timeout, 2 s with etcd's defaults; etcd raises smaller TTLs and
/// the session then runs with what etcd granted).
pub const MIN_TTL: Duration = Duration::from_secs(1);

/// The key prefix used unless the URL has a path.
pub const DEFAULT_PREFIX: &str = "dlock";

/// A lock service on an etcd cluster (see the [crate docs](crate)).
#[derive(Clone)]
pub struct EtcdBackend {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) client: Client,
    pub(crate) prefix: String,
    shown: String,
}

impl Inner {
    /// `prefix/<flat name>/`: the range holding one lock's queue.
    pub(crate) fn queue(&self, name: &LockName) -> String {
        format!("{}/{}/", self.prefix, name.flat())
    }
}

/// Maps a driver error to the core error by meaning.
pub(crate) fn map_err(e: etcd_client::Error) -> Error {
    use etcd_client::Error as E;
    use tonic::Code;
    match e {
        E::GRpcStatus(ref s) if s.message().contains("lease not found") => Error::SessionLost {
            session: s.message().to_owned(),
        },
        E::GRpcStatus(ref s)
            if matches!(
                s.code(),
                Code::Unavailable
                    | Code::DeadlineExceeded
                    | Code::Aborted
                    | Code::ResourceExhausted
                    | Code::Cancelled
                    | Code::Unknown
            ) =>
        {
            Error::unavailable(BACKEND, e)
        }
        E::TransportError(_) | E::IoError(_) | E::LeaseKeepAliveError(_) | E::WatchError(_) => {
            Error::unavailable(BACKEND, e)
        }
        E::InvalidUri(_) | E::InvalidArgs(_) => Error::Config(format!("{BACKEND}: {e}")),
        E::Utf8Error(_) => Error::protocol(BACKEND, e.to_string()),
        other => Error::backend(BACKEND, other),
    }
}

/// Runs a unary request again while it fails with `Unavailable`, for up to
/// about a second: with several endpoints, the client's balancer keeps a dead
/// member in rotation for a while, and a later try reaches a live one.
pub(crate) async fn retrying<T, F, Fut>(mut call: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    let give_up = tokio::time::Instant::now() + Duration::from_secs(1);
    let mut delay = Duration::from_millis(10);
    loop {
        match call().await {
            Err(e) if e.is_retryable() && tokio::time::Instant::now() + delay < give_up => {
                tracing::debug!(error = %e, "etcd request failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_millis(200));
            }
            other => return other,
        }
    }
}

struct Parsed {
    endpoints: Vec<String>,
    user: Option<(String, String)>,
    prefix: String,
    tls: bool,
}

fn parse(url: &str) -> Result<Parsed, Error> {
    let bad = |reason: &str| Error::invalid_url(url, reason);
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| bad("expected etcd://host:port[,host:port...][/prefix]"))?;
    let tls = match scheme {
        "etcd" => false,
        "etcds" => true,
        _ => return Err(bad("expected etcd:// or etcds://")),
    };
    if rest.contains('?') {
        return Err(bad("etcd URLs take no query options"));
    }
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let user = match userinfo {
        None => None,
        Some(u) => {
            let (name, password) = u
                .split_once(':')
                .ok_or_else(|| bad("user without password"))?;
            if name.is_empty() {
                return Err(bad("empty user name"));
            }
            Some((name.to_owned(), password.to_owned()))
        }
    };
    let endpoints: Vec<String> = hosts
        .split(',')
        .map(|h| {
            let (host, port) = h
                .rsplit_once(':')
                .ok_or_else(|| bad("every host needs a port"))?;
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(bad("every endpoint must be host:port"));
            }
            Ok(format!("{}://{h}", if tls { "https" } else { "http" }))
        })
        .collect::<Result<_, _>>()?;
    let prefix = path.trim_end_matches('/');
    let prefix = if prefix.is_empty() {
        DEFAULT_PREFIX
    } else {
        prefix
    };
    let prefix_ok = prefix.len() <= 64
        && prefix.split('/').all(|s| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        });
    if !prefix_ok {
        return Err(bad(
            "the prefix must be /-separated segments of [A-Za-z0-9-_.]",
        ));
    }
    Ok(Parsed {
        endpoints,
        user,
        prefix: prefix.to_owned(),
        tls,
    })
}

impl EtcdBackend {
    /// Connects to the cluster (see the crate docs for the URL).
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let parsed = parse(url)?;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(Duration::from_millis(1500))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3));
        if let Some((user, password)) = parsed.user {
            options = options.with_user(user, password);
        }
        if parsed.tls {
            options = options.with_tls(TlsOptions::new());
        }
        let client = tokio::time::timeout(
            Duration::from_secs(10),
            Client::connect(&parsed.endpoints, Some(options)),
        )
        .await
        .map_err(|_| Error::unavailable(BACKEND, "connect timed out"))?
        .map_err(map_err)?;
        let backend = Self {
            inner: Arc::new(Inner {
                client,
                prefix: parsed.prefix,
                shown: redact(url),
            }),
        };
        // The channel connects lazily: ask once, so that a cluster that is
        // down is reported here, as for the other backends.
        backend.ping().await?;
        Ok(backend)
    }

    /// Keys under the lock names starting with `prefix`: zero once nothing
    /// is held or waited for (for the conformance suite's leak check).
    pub async fn keys_under(&self, prefix: &str) -> Result<usize, Error> {
        name::check_prefix(prefix)?;
        let start = format!("{}/{}", self.inner.prefix, prefix.replace('/', "%2F"));
        let mut kv = self.inner.client.kv_client();
        let resp = kv
            .get(
                start,
                Some(GetOptions::new().with_prefix().with_count_only()),
            )
            .await
            .map_err(map_err)?;
        Ok(resp.count() as usize)
    }

    /// The holder key of `name` (lowest create revision) and the queue length.
    async fn head(&self, name: &LockName) -> Result<Option<(etcd_client::KeyValue, i64)>, Error> {
        let resp = retrying(|| {
            let mut kv = self.inner.client.kv_client();
            let queue = self.inner.queue(name);
            async move {
                let options = GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Create, SortOrder::Ascend)
                    .with_limit(1);
                kv.get(queue, Some(options)).await.map_err(map_err)
            }
        })
        .await?;
        Ok(resp.kvs().first().cloned().map(|kv| (kv, resp.count())))
    }
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("url", &self.inner.shown)
            .field("prefix", &self.inner.prefix)
            .finish()
    }
}

/// The holder's session id, stored as the first line of the key's value.
fn holder_of(value: &[u8]) -> (String, Option<String>) {
    let text = String::from_utf8_lossy(value);
    let (session, why) = text.split_once('\n').unwrap_or((&text, ""));
    (
        session.to_owned(),
        (!why.is_empty()).then(|| why.to_owned()),
    )
}

fn info_of(name: LockName, kv: &etcd_client::KeyValue, count: i64) -> LockInfo {
    let (holder, why) = holder_of(kv.value());
    let mut info = LockInfo::new(name, holder, FencingToken::new(kv.create_revision() as u64));
    info.why = why;
    info.waiters = Some((count - 1).max(0) as usize);
    info
}

#[async_trait]
impl Backend for EtcdBackend {
    fn scheme(&self) -> &'static str {
        BACKEND
    }

    fn min_ttl(&self) -> Duration {
        MIN_TTL
    }

    async fn ping(&self) -> Result<(), Error> {
        retrying(|| {
            let mut kv = self.inner.client.kv_client();
            let key = format!("{}/ping", self.inner.prefix);
            async move { kv.get(key, None).await.map_err(map_err) }
        })
        .await?;
        Ok(())
    }

    async fn open(
        &self,
        id: SessionId,
        options: &SessionOptions,
    ) -> Result<Arc<dyn RawSession>, Error> {
        Ok(Arc::new(
            session::EtcdSession::open(self.inner.clone(), id, options.ttl_value()).await?,
        ))
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>, Error> {
        Ok(self
            .head(name)
            .await?
            .map(|(kv, count)| info_of(name.clone(), &kv, count)))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>, Error> {
        name::check_prefix(prefix)?;
        let start = format!("{}/{}", self.inner.prefix, prefix.replace('/', "%2F"));
        let mut kv = self.inner.client.kv_client();
        let resp = kv
            .get(
                start,
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Key, SortOrder::Ascend),
                ),
            )
            .await
            .map_err(map_err)?;
        let mut by_name: std::collections::BTreeMap<String, (etcd_client::KeyValue, i64)> =
            Default::default();
        for item in resp.kvs() {
            let Ok(key) = item.key_str() else { continue };
            let Some(rest) = key.strip_prefix(&format!("{}/", self.inner.prefix)) else {
                continue;
            };
            let Some((flat, _)) = rest.split_once('/') else {
                continue;
            };
            let entry = by_name
                .entry(flat.to_owned())
                .or_insert_with(|| (item.clone(), 0));
            entry.1 += 1;
            if item.create_revision() < entry.0.create_revision() {
                entry.0 = item.clone();
            }
        }
        Ok(by_name
            .into_iter()
            .filter_map(|(flat, (kv, count))| {
                Some(info_of(LockName::unflat(&flat).ok()?, &kv, count))
            })
            .collect())
    }

    async fn validate(&self, name: &LockName, token: FencingToken) -> Result<bool, Error> {
        Ok(self
            .head(name)
            .await?
            .is_some_and(|(kv, _)| kv.create_revision() as u64 == token.get()))
    }

    async fn force_release(&self, name: &LockName) -> Result<bool, Error> {
        let Some((head, _)) = self.head(name).await? else {
            return Ok(false);
        };
        let mut kv = self.inner.client.kv_client();
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                head.key(),
                CompareOp::Equal,
                head.create_revision(),
            )])
            .and_then(vec![TxnOp::delete(head.key(), None)]);
        let resp = kv.txn(txn).await.map_err(map_err)?;
        if resp.succeeded() {
            tracing::info!(lock = %name, holder = %holder_of(head.value()).0, token = head.create_revision(), "force-released");
        }
        Ok(resp.succeeded())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_endpoints_user_and_prefix() {
        let p = parse("etcd://u:pw@a:1,b:2/apps/locks/").unwrap();
        assert_eq!(p.endpoints, ["http://a:1", "http://b:2"]);
        assert_eq!(p.user, Some(("u".into(), "pw".into())));
        assert_eq!((p.prefix.as_str(), p.tls), ("apps/locks", false));
        let p = parse("etcds://a:1").unwrap();
        assert_eq!(
            (p.endpoints[0].as_str(), p.prefix.as_str(), p.tls),
            ("https://a:1", "dlock", true)
        );
    }

    #[test]
    fn refuses_bad_urls_without_the_password() {
        for url in [
            "etcd://u:hunter2@a",
            "etcd://u:hunter2@a:x",
            "etcd://u:hunter2@a:1/bad prefix",
            "etcd://u:hunter2@a:1?x=1",
            "etcd://:hunter2@a:1",
            "http://a:1",
            "etcd://",
        ] {
            let e = parse(url).err().unwrap_or_else(|| panic!("{url} accepted"));
            assert!(matches!(e, Error::InvalidUrl { .. }), "{url}: {e:?}");
            assert!(!e.to_string().contains("hunter2"), "{e}");
        }
    }
}
