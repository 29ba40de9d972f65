//! dlock on etcd: `etcd://[user:password@]h1:p1,h2:p2,h3:p3[/prefix]`, or
//! `etcds://...` for TLS. [`EtcdAdapter`] is the [`Adapter`](dlock_core::Adapter) of both schemes
//! (register it in a [`Registry`](dlock_core::Registry)), with the
//! [`Capabilities`] every etcd backend promises; [`EtcdBackend::connect`]
//! opens one directly.
//!
//! User and password are percent-decoded; etcd's auth tokens are renewed as
//! they expire. The prefix (default [`DEFAULT_PREFIX`]) is `/`-separated
//! segments of `[A-Za-z0-9-_.]`, at most 64 characters. A wrong user or
//! password is [`Error::Auth`], a server certificate that is not trusted
//! [`Error::Config`]: neither is retried.
//!
//! # URL options
//!
//! Only for `etcds://`; any other option is an [`Error::InvalidUrl`].
//!
//! | Option | Meaning |
//! |---|---|
//! | `ca=<PEM file>` | the CA of the server's certificate (the system's roots otherwise) |
//! | `cert=<PEM file>`, `key=<PEM file>` | a client certificate and its key (both or neither) |
//! | `domain=<name>` | the name to check the server's certificate against (default: the host) |
//!
//! # How it works
//!
//! * **Session = one lease** (`LeaseGrant` with the session TTL, rounded up to
//!   whole seconds as etcd counts them), kept alive by the session's renewal
//!   round: one `LeaseKeepAlive` on the lease's stream plus one read of the
//!   session's keys. Lease renewals are served by etcd's leader (a follower
//!   forwards them), so a member cut off from its peers cannot confirm one.
//!   The local validity deadline is counted from when the answered
//!   keep-alive was *sent* (S4); a renewal cut off by its timeout drops the
//!   stream, so its late answer is never taken for a later keep-alive's. A
//!   lease that is gone (TTL 0, or "lease not found" on a new stream or a
//!   put) is a lost session. All of a session's locks hang on its one lease:
//!   no lease per lock.
//! * **Take**: `txn(create_revision(key) == 0 and create_revision(tombstone)
//!   == 0 → put key with the lease; else get key)` on the attempt's own key
//!   `prefix/<name>/<lease>-<attempt>` (the name spelled as one path
//!   segment, [`LockName::flat`], so `a` and `a/b` never share a range).
//!   Idempotent: a retried take finds its key. The holder is the key with the
//!   lowest create revision under `prefix/<name>/`; a later key is a waiter.
//!   Fair: FIFO by create revision.
//! * **Late creates**: a take whose answer never came may still reach etcd
//!   later (requests travel on their own HTTP/2 streams, and one held in the
//!   network arrives whenever it does), after the attempt was abandoned or
//!   its key released, where it would leave an orphan on the lease that
//!   blocks the queue while the session lives. The attempt's next txn (its
//!   retried take, or its clean-up) then also writes the key's *tombstone*
//!   `prefix/%abandoned/<name>/<lease>-<attempt>` on the lease, and every
//!   create compares the tombstone absent: whatever lands later creates
//!   nothing. Tombstones exist only for attempts that met a fault, and go
//!   with the lease.
//! * **Wake-up**: each backend keeps one watch per lock queue it waits on
//!   (deletions under `prefix/<name>/`, from "now"), shared by its waiters
//!   through a channel in the process, and dropped 10–15 s after its last
//!   waiter (or when the client is replaced after a stuck request). A waiter subscribes, then reads the keys ahead of its own (the
//!   nearest 16) in a txn that also checks its own key; each deletion it
//!   hears of leaves one fewer. When none is left and the read saw all of
//!   them, the waiter is first and is granted at once, without another
//!   read: a handoff is the release, the watch event and nothing more. A
//!   deletion of its own key, a watch that ended, a waiter that fell behind
//!   the channel, or a partial read: it reads again. A release wakes only
//!   the waiters of that name, one event each; the next in line is granted.
//!   Why one watch per queue rather than per wait: etcd starts a watch
//!   "from now" at the revision it read *before* registering it, and one
//!   registered after another write is served from the *unsynced* group,
//!   which a 100 ms loop drains. Under a hot lock that is when waiters make
//!   their watches: with a watch per wait, about one handoff in fifty took
//!   ~90 ms (etcd's own lock recipe, which also watches per wait, shows the
//!   same tail in `dlock bench`). A kept watch meets that at most once.
//! * **Token** = the own key's create revision: etcd's global revision, so
//!   strictly increasing per name, durable across restarts and leader changes.
//! * **Release** deletes the own key in a txn comparing its create revision (a
//!   late release never deletes another holder's key); a cancelled or
//!   timed-out waiter deletes its key so it never blocks those behind it
//!   (the core retries a clean-up until it succeeds or the session ends).
//!   `force_release` deletes the holder's key; the old holder's next renewal
//!   finds it missing. (A waiter next in line that is force-released as
//!   soon as it became first may still be granted as of the revision at
//!   which it became first, then hears of it at its next renewal, as any
//!   holder; its token is below the next holder's.)
//! * **Connections**: requests carry etcd's "require leader" flag, so a
//!   member without a leader refuses them at once. The client's balancer
//!   spreads requests over every endpoint; one that certainly never left
//!   (its member refused the connection) is sent again at once, so a client
//!   works while a minority is unreachable, also when it connects then. A
//!   renewal cut off by its timeout marks the client's connections suspect
//!   (a silently dead connection is noticed by HTTP/2 pings only after
//!   seconds, and etcd refuses pings more often than every 5 s): the next
//!   request first replaces the client.
//!
//! Each `Lock` handle is its own owner, so two handles of one session on one
//! name get two keys under the same lease (the key carries an attempt id as
//! well as the lease; the original contract, now docs/DESIGN.md in the
//! repository, sketched `prefix/name/<lease>`).
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

mod fence;
mod floor;
mod session;
mod watch;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::RawSession;
use dlock_core::url::StoreUrl;
use dlock_core::{
    Backend, Capabilities, Error, FencingToken, LockInfo, LockName, SessionId, SessionOptions, name,
};
/// The etcd client this crate speaks (its clients are what [`EtcdFence`]
/// commits on).
pub use etcd_client;
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, GetOptions, Identity, SortOrder,
    SortTarget, TlsOptions, Txn, TxnOp,
};
use etcd_client::{GetResponse, TxnResponse};
pub use fence::EtcdFence;
pub use floor::EtcdFloor;
use futures::StreamExt as _;

const BACKEND: &str = "etcd";

/// How many lease reads `list` keeps in flight (one per holding session).
const LEASE_READS_IN_FLIGHT: usize = 16;

/// How long `list` spends reading leases for the expiries it shows.
const LEASE_READS_LIMIT: Duration = Duration::from_secs(2);

/// The smallest TTL: etcd counts lease TTLs in whole seconds, and its
/// minimum lease TTL depends on the election timeout (1 s with a 500 ms
/// election timeout, 2 s with etcd's defaults; etcd raises smaller TTLs and
/// the session then runs with what etcd granted).
pub const MIN_TTL: Duration = Duration::from_secs(1);

/// The key prefix used unless the URL has a path.
pub const DEFAULT_PREFIX: &str = "dlock";

/// The `etcd://` and `etcds://` [`Adapter`](dlock_core::Adapter): register it to open etcd URLs
/// through a [`Registry`](dlock_core::Registry).
///
/// ```no_run
/// # async fn demo() -> Result<(), dlock_core::Error> {
/// use dlock_etcd::EtcdAdapter;
/// dlock_core::registry().register(EtcdAdapter)?;
/// let backend = dlock_core::registry().connect("etcd://127.0.0.1:2379/jobs").await?;
/// assert_eq!(backend.capabilities(), EtcdAdapter.capabilities());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct EtcdAdapter;

impl EtcdAdapter {
    /// What every etcd backend promises, whatever its URL (what
    /// [`Backend::capabilities`] of an [`EtcdBackend`] answers).
    pub fn capabilities(&self) -> Capabilities {
        // FIFO by create revision; tokens are create revisions (etcd's
        // global revision, persisted by raft before it is acknowledged);
        // a waiter hears of the deletions ahead of it; the lease, not the
        // connection, carries the session. The leader checks lease expiry
        // every 500 ms, and may run up to that late. A doubtful attempt's
        // key gets a tombstone that refuses its late create.
        Capabilities::watched_queue(Duration::from_millis(1500))
    }
}

dlock_core::impl_adapter!(EtcdAdapter, name: BACKEND, schemes: &["etcd", "etcds"], connect: EtcdBackend::connect, floor: EtcdFloor::connect);

/// A lock service on an etcd cluster (see the [crate docs](crate)).
#[derive(Clone)]
pub struct EtcdBackend {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// The client in use: replaced when a request was found stuck.
    client: std::sync::RwLock<Client>,
    /// What a new client is made from.
    endpoints: Vec<String>,
    options: ConnectOptions,
    /// A request hung on the client's connections (see [`Inner::stalled`]).
    stalled: AtomicBool,
    replacing: tokio::sync::Mutex<()>,
    /// How many times the client was replaced: a queue watch made on an
    /// earlier client is made again.
    generation: std::sync::atomic::AtomicU64,
    /// The lock queues' watches, shared by this backend's waiters.
    pub(crate) watches: Arc<watch::QueueWatches>,
    pub(crate) prefix: String,
    /// Shown redacted.
    url: StoreUrl,
}

impl Inner {
    /// `prefix/<flat name>/`: the range holding one lock's queue.
    pub(crate) fn queue(&self, name: &LockName) -> String {
        format!("{}/{}/", self.prefix, name.flat())
    }

    /// The client in use (clones share its connections).
    pub(crate) fn client(&self) -> Client {
        self.client
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A receiver of every deletion in `queue` from now on (see
    /// [`watch`]); `None` if etcd made no watch within `limit`.
    pub(crate) async fn subscribe(
        &self,
        queue: &str,
        limit: Duration,
    ) -> Option<tokio::sync::broadcast::Receiver<watch::Deleted>> {
        let subscribed = tokio::time::timeout(limit, async {
            self.replace_if_stalled().await.ok()?;
            let (client, generation) = {
                let client = self.client.read().unwrap_or_else(|e| e.into_inner());
                (client.clone(), self.generation.load(Ordering::Acquire))
            };
            self.watches.subscribe(client, generation, queue).await
        })
        .await;
        if subscribed.is_err() {
            tracing::debug!("no watch of the lock queue in time; waiting on the fallback timer");
        }
        subscribed.ok().flatten()
    }

    /// Records that a request hung: the connections it went over may be
    /// silently dead (nothing resets a connection whose peer vanished, and
    /// HTTP/2 keep-alive pings take seconds to notice, as etcd refuses
    /// pings more often than every 5 s). The next request first replaces
    /// the client, whose new connections work if the network does.
    pub(crate) fn stalled(&self) {
        self.stalled.store(true, Ordering::Release);
    }

    /// Replaces the client if a request was found stuck.
    async fn replace_if_stalled(&self) -> Result<(), Error> {
        if !self.stalled.load(Ordering::Acquire) {
            return Ok(());
        }
        let _one = self.replacing.lock().await;
        if !self.stalled.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        match new_client(&self.endpoints, &self.options).await {
            Ok(client) => {
                tracing::debug!(url = %self.url, "replaced the etcd client after a stuck request");
                {
                    // The client and its generation change together.
                    let mut current = self.client.write().unwrap_or_else(|e| e.into_inner());
                    *current = client;
                    self.generation.fetch_add(1, Ordering::AcqRel);
                }
                self.watches.end_all();
                Ok(())
            }
            Err(e) => {
                self.stalled.store(true, Ordering::Release);
                Err(e)
            }
        }
    }

    /// Runs a request, again for up to about a second while it fails in a
    /// way `repeat` allows. The client's balancer spreads requests over
    /// every endpoint, a member that refuses connections included, whose
    /// requests fail at once: the next try goes to a live member.
    pub(crate) async fn call<T, F, Fut>(&self, repeat: Repeat, mut request: F) -> Result<T, Error>
    where
        F: FnMut(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        self.replace_if_stalled().await?;
        let give_up = tokio::time::Instant::now() + Duration::from_secs(1);
        let mut delay = Duration::from_millis(5);
        loop {
            let e = match request(self.client()).await {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            let unsent = never_sent(&e);
            if timed_out(&e) {
                self.stalled();
            }
            let e = map_err(e);
            let again = match repeat {
                Repeat::Idempotent => e.is_retryable(),
                Repeat::Unsent => unsent,
            };
            if !again || tokio::time::Instant::now() + delay >= give_up {
                return Err(e);
            }
            tracing::debug!(error = %e, "etcd request failed; sending it again");
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(200));
            self.replace_if_stalled().await?;
        }
    }

    /// Runs `txn` through [`call`](Self::call).
    pub(crate) async fn txn(&self, repeat: Repeat, txn: Txn) -> Result<TxnResponse, Error> {
        self.call(repeat, |client| {
            let mut kv = client.kv_client();
            let txn = txn.clone();
            async move { kv.txn(txn).await }
        })
        .await
    }

    /// Reads `key` (with `options`) through [`call`](Self::call); reads are
    /// idempotent.
    pub(crate) async fn get(
        &self,
        key: impl Into<Vec<u8>>,
        options: GetOptions,
    ) -> Result<GetResponse, Error> {
        let key = key.into();
        self.call(Repeat::Idempotent, |client| {
            let mut kv = client.kv_client();
            let (key, options) = (key.clone(), options.clone());
            async move { kv.get(key, Some(options)).await }
        })
        .await
    }

    /// The start of the keys of the lock names beginning with `prefix`
    /// (checked).
    fn names_from(&self, prefix: &str) -> Result<String, Error> {
        name::check_prefix(prefix)?;
        Ok(format!("{}/{}", self.prefix, prefix.replace('/', "%2F")))
    }
}

/// A new client (no request is sent unless the URL has credentials: then
/// it authenticates, through any reachable member).
async fn new_client(endpoints: &[String], options: &ConnectOptions) -> Result<Client, Error> {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(1);
    let mut delay = Duration::from_millis(5);
    loop {
        match Client::connect(endpoints, Some(options.clone())).await {
            Ok(client) => return Ok(client),
            Err(e) => {
                let e = map_err(e);
                if !e.is_retryable() || tokio::time::Instant::now() + delay >= give_up {
                    return Err(e);
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_millis(200));
            }
        }
    }
}

/// The text of an error and all its sources, for classifying driver errors
/// whose types are not public.
fn chain_text(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(source) = next {
        text.push_str(": ");
        text.push_str(&source.to_string());
        next = source.source();
    }
    text
}

/// A transient failure as [`Error::Unavailable`], in the OS's words when a
/// connection could not be opened.
fn unreachable(e: etcd_client::Error) -> Error {
    match connect_failure(&e) {
        Some(text) => Error::unavailable(BACKEND, text),
        None => Error::unavailable(BACKEND, e),
    }
}

/// "cannot connect: <the OS's words>" when a connection could not be opened
/// (instead of tonic's whole debug chain), else `None`.
fn connect_failure(e: &etcd_client::Error) -> Option<String> {
    // (etcd_client::Error names no source: start from what it wraps)
    let root: &(dyn std::error::Error + 'static) = match e {
        etcd_client::Error::GRpcStatus(s) => s,
        etcd_client::Error::TransportError(t) => t,
        other => other,
    };
    let mut next = Some(root);
    let mut connecting = false;
    while let Some(source) = next {
        connecting |= source.to_string().contains("connect error");
        if let Some(io) = source.downcast_ref::<std::io::Error>() {
            return connecting.then(|| format!("cannot connect: {io}"));
        }
        next = source.source();
    }
    None
}

/// Whether the request certainly never reached etcd: the connection to the
/// member it was routed to could not be opened. Repeating such a request is
/// always safe, whatever it does.
pub(crate) fn never_sent(e: &etcd_client::Error) -> bool {
    use std::error::Error as _;
    let status = match e {
        etcd_client::Error::GRpcStatus(s) => s,
        etcd_client::Error::TransportError(t) => {
            return chain_text(t).contains("connect error") || t.source().is_none();
        }
        _ => return false,
    };
    let mut next: Option<&(dyn std::error::Error + 'static)> = status.source();
    while let Some(source) = next {
        if source.downcast_ref::<tonic::ConnectError>().is_some() {
            return true;
        }
        next = source.source();
    }
    false
}

/// Maps a driver error to the core error by meaning.
pub(crate) fn map_err(e: etcd_client::Error) -> Error {
    use etcd_client::Error as E;
    use tonic::Code;
    let text = chain_text(&e);
    // TLS: a server certificate this client does not trust is a
    // configuration problem; a client certificate the server refuses, a
    // credentials one. Neither is fixed by trying again.
    if let Some(at) = text.find("invalid peer certificate") {
        let why: String = text[at..]
            .chars()
            .take_while(|c| !matches!(c, '"' | ',' | ')'))
            .collect();
        return Error::Config(format!(
            "{BACKEND}: the server's TLS certificate is not trusted ({why}); give its CA with ?ca="
        ));
    }
    if text.contains("received fatal alert: BadCertificate")
        || text.contains("received fatal alert: CertificateRequired")
        || text.contains("received fatal alert: UnknownCA")
    {
        return Error::Auth {
            backend: BACKEND,
            reason: "the server refused the client certificate (?cert=, ?key=)".into(),
        };
    }
    match e {
        // A put on a lease etcd no longer knows, or a keep-alive stream
        // opened for one (etcd-client reports its TTL 0 answer so).
        E::GRpcStatus(ref s) if s.message().contains("lease not found") => Error::session_lost(
            "",
            "etcd no longer knows its lease (it expired, or was revoked)",
        ),
        E::LeaseKeepAliveError(ref m) if m.contains("lease not found") => Error::session_lost(
            "",
            "etcd no longer knows its lease (it expired, or was revoked)",
        ),
        E::GRpcStatus(ref s) if s.message().contains("authentication failed") => Error::Auth {
            backend: BACKEND,
            reason: "wrong user name or password".into(),
        },
        E::GRpcStatus(ref s) if s.message().contains("authentication is not enabled") => {
            Error::Config(format!(
                "{BACKEND}: the URL has credentials, but authentication is not enabled on this cluster"
            ))
        }
        E::GRpcStatus(ref s) if s.message().contains("user name is empty") => Error::Auth {
            backend: BACKEND,
            reason: "the cluster requires a user (etcd://user:password@...)".into(),
        },
        E::GRpcStatus(ref s)
            if s.code() == Code::Unauthenticated || s.message().contains("invalid auth token") =>
        {
            Error::Auth {
                backend: BACKEND,
                reason: format!(
                    "{} (does the cluster require a user? etcd://user:password@...)",
                    s.message()
                ),
            }
        }
        E::GRpcStatus(ref s) if s.code() == Code::PermissionDenied => Error::backend(
            BACKEND,
            format!(
                "{}: the user's roles must grant readwrite on the key prefix",
                s.message()
            ),
        ),
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
            unreachable(e)
        }
        E::TransportError(_) | E::IoError(_) | E::LeaseKeepAliveError(_) | E::WatchError(_) => {
            unreachable(e)
        }
        E::InvalidUri(_) | E::InvalidArgs(_) => Error::Config(format!("{BACKEND}: {e}")),
        E::Utf8Error(_) => Error::protocol(BACKEND, e.to_string()),
        other => Error::backend(BACKEND, other),
    }
}

/// Which failed calls [`call`] sends again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Repeat {
    /// Any retryable failure: reads, and writes that may be applied twice.
    Idempotent,
    /// Only a request that certainly never reached etcd.
    Unsent,
}

/// Whether the request ran into the client's own request timeout.
fn timed_out(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            s.code() == tonic::Code::DeadlineExceeded
                || s.code() == tonic::Code::Cancelled && s.message().contains("Timeout expired")
                || chain_text(s).contains("request timed out")
                || chain_text(s).contains("Timeout expired")
        }
        etcd_client::Error::TransportError(t) => chain_text(t).contains("timed out"),
        _ => false,
    }
}

/// TLS files named by the URL's query.
#[derive(Debug, Default, PartialEq, Eq)]
struct TlsFiles {
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    domain: Option<String>,
}

/// What an `etcd://` or `etcds://` URL says (no `Debug`: it holds the
/// password).
struct Parsed {
    endpoints: Vec<String>,
    user: Option<(String, String)>,
    prefix: String,
    tls: Option<TlsFiles>,
}

fn parse(url: &StoreUrl) -> Result<Parsed, Error> {
    let tls = match url.scheme() {
        "etcd" => false,
        "etcds" => true,
        _ => return Err(url.invalid("expected etcd:// or etcds://")),
    };
    if url.hosts().is_empty() {
        return Err(url.invalid("expected etcd://host:port[,host:port...][/prefix]"));
    }
    let endpoints = url
        .hosts()
        .iter()
        .map(|h| match h.port {
            Some(_) => Ok(format!("{}://{h}", if tls { "https" } else { "http" })),
            None => Err(url.invalid(format!(
                "every endpoint must be host:port ({h} has no port)"
            ))),
        })
        .collect::<Result<_, _>>()?;
    let user = match (url.username(), url.password()) {
        ("", None) => None,
        ("", Some(_)) => return Err(url.invalid("empty user name")),
        (_, None) => return Err(url.invalid("user without password")),
        (name, Some(password)) => Some((name.to_owned(), password.to_owned())),
    };
    if url.fragment().is_some() {
        return Err(url.invalid("etcd URLs take no #fragment"));
    }
    let path = url.path_decoded()?;
    let prefix = match path.trim_end_matches('/') {
        "" => DEFAULT_PREFIX,
        prefix => prefix,
    };
    let prefix_ok = prefix.len() <= 64
        && prefix.split('/').all(|s| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        });
    if !prefix_ok {
        return Err(url.invalid("the prefix must be /-separated segments of [A-Za-z0-9-_.]"));
    }
    let mut options = url.options();
    let files = TlsFiles {
        ca: options.path("ca")?,
        cert: options.path("cert")?,
        key: options.path("key")?,
        domain: options.string("domain")?,
    };
    options.finish()?;
    if files.domain.as_deref() == Some("") {
        return Err(url.invalid("domain must be a host name"));
    }
    if !tls && files != TlsFiles::default() {
        return Err(url.invalid("TLS options need etcds://"));
    }
    if files.cert.is_some() != files.key.is_some() {
        return Err(url.invalid("a client certificate needs both cert= and key="));
    }
    Ok(Parsed {
        endpoints,
        user,
        prefix: prefix.to_owned(),
        tls: tls.then_some(files),
    })
}

fn read_pem(what: &str, path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|e| {
        Error::Config(format!(
            "{BACKEND}: cannot read the {what} file {}: {e}",
            path.display()
        ))
    })
}

fn tls_options(files: &TlsFiles) -> Result<TlsOptions, Error> {
    let mut tls = TlsOptions::new();
    tls = match &files.ca {
        Some(ca) => tls.ca_certificate(Certificate::from_pem(read_pem("CA", ca)?)),
        None => tls.with_native_roots(),
    };
    if let (Some(cert), Some(key)) = (&files.cert, &files.key) {
        tls = tls.identity(Identity::from_pem(
            read_pem("client certificate", cert)?,
            read_pem("client key", key)?,
        ));
    }
    if let Some(domain) = &files.domain {
        tls = tls.domain_name(domain.clone());
    }
    Ok(tls)
}

impl EtcdBackend {
    /// When `lease` (a holder's) runs out, by its time to live in etcd's
    /// whole seconds from when the answer arrived; `None` if the key had
    /// no lease, the lease is gone (the hold just ended) or the read failed
    /// (an expiry is extra: it leaves it unknown).
    async fn lease_expiry(&self, lease: i64) -> Option<std::time::SystemTime> {
        if lease == 0 {
            return None;
        }
        let ttl = self
            .inner
            .call(Repeat::Idempotent, |client| {
                let mut leases = client.lease_client();
                async move { leases.time_to_live(lease, None).await }
            })
            .await
            .ok()?
            .ttl();
        // (-1: the lease is gone)
        let ttl = u64::try_from(ttl).ok()?;
        Some(std::time::SystemTime::now() + Duration::from_secs(ttl))
    }

    /// Connects to the cluster (see the crate docs for the URL).
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for a malformed URL, [`Error::Config`] for TLS
    /// files that cannot be read or a server certificate that is not
    /// trusted, [`Error::Auth`] for a wrong user or password,
    /// [`Error::Unavailable`] when no member answers.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn connect<U>(url: U) -> Result<Self, Error>
    where
        U: TryInto<StoreUrl, Error = Error>,
    {
        let url = url.try_into()?;
        let parsed = parse(&url)?;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(Duration::from_millis(1500))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3))
            // A member cut off from its leader answers "no leader" at once
            // instead of serving stale reads or holding requests.
            .with_require_leader(true);
        if let Some((user, password)) = parsed.user {
            options = options
                .with_user(user, password)
                .with_auto_token_refresh(true);
        }
        if let Some(files) = &parsed.tls {
            options = options.with_tls(tls_options(files)?);
        }
        let client = tokio::time::timeout(
            Duration::from_secs(10),
            new_client(&parsed.endpoints, &options),
        )
        .await
        .map_err(|_| Error::unavailable(BACKEND, "connect timed out"))??;
        let backend = Self {
            inner: Arc::new(Inner {
                client: std::sync::RwLock::new(client),
                endpoints: parsed.endpoints,
                options,
                stalled: AtomicBool::new(false),
                replacing: tokio::sync::Mutex::new(()),
                generation: Default::default(),
                watches: Default::default(),
                prefix: parsed.prefix,
                url,
            }),
        };
        // The channel connects lazily: ask once, so that a cluster that is
        // down is reported here, as for the other backends.
        backend.ping().await?;
        Ok(backend)
    }

    /// A new client of the cluster, with the URL's TLS and credentials: for
    /// writes of the protected data through [`EtcdFence`], e.g. by `dlock
    /// fence`.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn data_client(&self) -> Result<Client, Error> {
        new_client(&self.inner.endpoints, &self.inner.options).await
    }

    /// Keys under the lock names starting with `prefix`: zero once nothing
    /// is held or waited for (for the conformance suite's leak check).
    pub async fn keys_under(&self, prefix: &str) -> Result<usize, Error> {
        let start = self.inner.names_from(prefix)?;
        let options = GetOptions::new().with_prefix().with_count_only();
        Ok(self.inner.get(start, options).await?.count() as usize)
    }

    /// The holder key of `name` (lowest create revision) and the queue length.
    async fn head(&self, name: &LockName) -> Result<Option<(etcd_client::KeyValue, i64)>, Error> {
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let resp = self.inner.get(self.inner.queue(name), options).await?;
        Ok(resp.kvs().first().cloned().map(|kv| (kv, resp.count())))
    }
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("url", &self.inner.url)
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

    fn capabilities(&self) -> Capabilities {
        EtcdAdapter.capabilities()
    }

    async fn ping(&self) -> Result<(), Error> {
        let key = format!("{}/ping", self.inner.prefix);
        self.inner.get(key, GetOptions::new()).await?;
        Ok(())
    }

    async fn open(
        &self,
        id: SessionId,
        options: &SessionOptions,
    ) -> Result<Arc<dyn RawSession>, Error> {
        Ok(Arc::new(
            session::EtcdSession::open(
                self.inner.clone(),
                id,
                options.ttl_value(),
                options.request_timeout_or_default(),
            )
            .await?,
        ))
    }

    /// With `expires_at` from the holder's lease: one more request.
    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>, Error> {
        let Some((kv, count)) = self.head(name).await? else {
            return Ok(None);
        };
        let mut info = info_of(name.clone(), &kv, count);
        info.expires_at = self.lease_expiry(kv.lease()).await;
        Ok(Some(info))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>, Error> {
        let start = self.inner.names_from(prefix)?;
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Key, SortOrder::Ascend);
        let resp = self.inner.get(start, options).await?;
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
        let mut locks: Vec<(LockInfo, i64)> = by_name
            .into_iter()
            .filter_map(|(flat, (kv, count))| {
                Some((
                    info_of(LockName::unflat(&flat).ok()?, &kv, count),
                    kv.lease(),
                ))
            })
            .collect();
        // One request per lease (a session's holds share its lease), a few
        // at a time, all within LEASE_READS_LIMIT: an etcd slow to answer
        // them leaves expiries unknown rather than the list late.
        let leases: std::collections::BTreeSet<i64> = locks.iter().map(|(_, l)| *l).collect();
        let reads = futures::stream::iter(leases)
            .map(|lease| async move { (lease, self.lease_expiry(lease).await) })
            .buffer_unordered(LEASE_READS_IN_FLIGHT);
        futures::pin_mut!(reads);
        let until = tokio::time::Instant::now() + LEASE_READS_LIMIT;
        let mut expiries = std::collections::HashMap::new();
        while let Ok(Some((lease, at))) = tokio::time::timeout_at(until, reads.next()).await {
            expiries.insert(lease, at);
        }
        for (info, lease) in &mut locks {
            info.expires_at = expiries.get(lease).copied().flatten();
        }
        Ok(locks.into_iter().map(|(info, _)| info).collect())
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
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                head.key(),
                CompareOp::Equal,
                head.create_revision(),
            )])
            .and_then(vec![TxnOp::delete(head.key(), None)]);
        let resp = self.inner.txn(Repeat::Unsent, txn).await?;
        if resp.succeeded() {
            tracing::info!(lock = %name, holder = %holder_of(head.value()).0, token = head.create_revision(), "force-released");
        }
        Ok(resp.succeeded())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(url: &str) -> Result<Parsed, Error> {
        parse(&StoreUrl::parse(url)?)
    }

    #[test]
    fn parses_endpoints_user_and_prefix() {
        let p = parsed("etcd://u:pw@a:1,b:2/apps/locks/").unwrap();
        assert_eq!(p.endpoints, ["http://a:1", "http://b:2"]);
        assert_eq!(p.user, Some(("u".into(), "pw".into())));
        assert_eq!((p.prefix.as_str(), p.tls), ("apps/locks", None));
        let p = parsed("etcds://a:1").unwrap();
        assert_eq!(
            (p.endpoints[0].as_str(), p.prefix.as_str(), p.tls),
            ("https://a:1", "dlock", Some(TlsFiles::default()))
        );
        let p = parsed("etcd://[::1]:2379/").unwrap();
        assert_eq!(p.endpoints, ["http://[::1]:2379"]);
        assert_eq!(p.prefix, DEFAULT_PREFIX);
    }

    #[test]
    fn parses_tls_options_and_encoded_passwords() {
        let p = parsed("etcds://app:p%2Fa%40s%3As@h:1/pre?ca=/etc/ca.pem&cert=c.pem&key=k%20.pem&domain=etcd.local").unwrap();
        assert_eq!(p.user, Some(("app".into(), "p/a@s:s".into())));
        assert_eq!(p.prefix, "pre");
        assert_eq!(
            p.tls,
            Some(TlsFiles {
                ca: Some("/etc/ca.pem".into()),
                cert: Some("c.pem".into()),
                key: Some("k .pem".into()),
                domain: Some("etcd.local".into()),
            })
        );
        // An unencoded `@` in the password still works: the last `@` ends it.
        let p = parsed("etcd://u:p@ss@h:1").unwrap();
        assert_eq!(p.user, Some(("u".into(), "p@ss".into())));
    }

    #[test]
    fn refuses_bad_urls_without_the_password() {
        for (url, why) in [
            ("etcd://u:hunter2@a", "host:port"),
            ("etcd://u:hunter2@a:x", "port"),
            ("etcd://u:hunter2@a:1/bad prefix", "percent-encode"),
            ("etcd://u:hunter2@a:1/bad%20prefix", "prefix"),
            ("etcd://u:hunter2@a:1?x=1", "unknown option \"x\""),
            ("etcd://u:hunter2@a:1?ca=/ca.pem", "need etcds://"),
            ("etcds://u:hunter2@a:1?ca=", "ca must be a file path"),
            ("etcds://u:hunter2@a:1?domain=", "domain"),
            ("etcds://u:hunter2@a:1?ca=a&ca=b", "given twice"),
            ("etcds://u:hunter2@a:1?cert=c.pem", "both cert= and key="),
            ("etcd://:hunter2@a:1", "empty user name"),
            ("etcd://u@a:1", "user without password"),
            ("etcd://u:hunter2@a:1#x", "fragment"),
            ("etcd://u:hunter2@a:1,", "empty host"),
            ("http://a:1", "etcd://"),
            ("etcd://", "host:port"),
            ("etcd:a:1", "host:port"),
        ] {
            dlock_conformance::unit::assert_refused(url, parsed(url), why);
        }
    }

    /// The values the conformance harness runs with (it takes them from
    /// here): a change is a change of what etcd backends promise.
    #[test]
    fn capabilities_are_the_same_for_every_url() {
        let c = EtcdAdapter.capabilities();
        assert_eq!(c, Capabilities::watched_queue(Duration::from_millis(1500)));
        assert_eq!(
            dlock_core::Adapter::schemes(&EtcdAdapter),
            ["etcd", "etcds"]
        );
    }
}
