//! dlock on ZooKeeper: `zk://[user:password@]h1:p1,h2:p2,h3:p3[/root]`.
//! [`ZkAdapter`] is the [`Adapter`](dlock_core::Adapter) of the scheme (register it in a
//! [`Registry`](dlock_core::Registry)), with the [`Capabilities`] every
//! ZooKeeper backend promises; [`ZkBackend::connect`] opens one directly.
//!
//! User and password are percent-decoded (a `/`, `?`, `#` or `%` in them
//! must be percent-encoded; the user may not hold a `:`). The root
//! (default [`DEFAULT_ROOT`]) is `/`-separated segments of
//! `[A-Za-z0-9-_.]`, not `/zookeeper`. The URL takes no query options.
//!
//! # How it works
//!
//! * **Session = the ZooKeeper session**, with the session timeout negotiated
//!   from the TTL (the session runs with what the ensemble granted, less the
//!   bound below). A renewal round is a `sync` followed by one multi-read of
//!   the session's lock nodes, sent together: the `sync` goes through the
//!   ensemble's leader, which checks that the session is still open there
//!   (see *Why a renewal syncs* below); the read then checks that each node
//!   still exists with its token. `Disconnected` is a suspension: the holder
//!   keeps its locks only until its local deadline; a reconnection within
//!   the session keeps them. `Expired` loses the session and every lock
//!   (`lost()` fires; open a new session).
//! * **Take**: an `EPHEMERAL_SEQUENTIAL` node `<root>/<name>/<guid>-lock-`,
//!   where `<name>` is one path segment ([`LockName::flat`], so `a` and `a/b`
//!   never nest) and `guid` = session id + attempt id ("protected" mode:
//!   after a connection loss during the create, the attempt finds its own
//!   node by the guid instead of creating a second one; it `sync`s first, so
//!   the server it reconnected to has applied every create the leader
//!   accepted before). The create is a `multi` with an empty `setData` of
//!   the parent, whose answer is the parent's stat after the create: where
//!   the parent has one child, the new node is alone and holds, and an
//!   uncontended take of a name whose parent exists is one round trip with
//!   no list (the recipe's create and list cost ~1.3× a create and delete
//!   here: the list's answer came ~0.2 ms after the create's); otherwise the
//!   queue is listed. The lowest sequence holds; a waiter sets an
//!   exists-watch on its predecessor only (no herd) and then re-checks.
//!   Fair: FIFO by sequence. A cancelled or timed-out waiter deletes its
//!   node.
//! * **Token** = the own node's `czxid` (the zxid that created it): global,
//!   strictly increasing, durable. Not the sequence suffix, which belongs to
//!   the parent and restarts if the parent is recreated. A multi is one
//!   transaction with one zxid, so where a server answers the multi's
//!   create without a stat (ZOOKEEPER-4026, 3.8.0 among them), the parent's
//!   `mzxid` from the `setData` is that czxid.
//! * **Release** is one `delete` of the node (so a release whose reply is
//!   lost has still happened); the node's path is unique to its grant (the
//!   guid is never reused), and the token is checked against the hold's key,
//!   which carries it.
//! * The lock's parent node is a *container* node, which ZooKeeper deletes
//!   about a minute after it is left empty, and at most 10,000 a minute
//!   (`znode.container.*`). So the session also deletes a parent it emptied,
//!   2 s after its last release of the name (off the release path, in a
//!   task of the session) or when the session closes: a name locked again
//!   meanwhile finds its parent (no failed create), and 10,000 names leave
//!   nothing behind. The delete fails harmlessly if the parent has nodes. A
//!   waiter that finds the parent gone creates it and its own node in one
//!   multi, so a parent deleted in between cannot make it fail.
//! * `user:password@` authenticates with the `digest` scheme, and the nodes
//!   dlock creates then carry the `CREATOR_ALL` ACL (only that user may touch
//!   them); without credentials they are open to anyone (`ANYONE_ALL`).
//!   A take writes the lock's parent (the `setData` of its multi), so a
//!   parent made beforehand by hand needs `WRITE` as well as `CREATE` and
//!   `DELETE` for dlock's user; without it every take fails with
//!   [`Error::Auth`] and leaves nothing behind (the multi is undone).
//!   ZooKeeper accepts any digest credentials at connect and checks them
//!   against each node's ACL, so `connect` reads the root once: a wrong
//!   password (or a user the root's ACL does not admit) is
//!   [`Error::Auth`] there, not later.
//! * **`inspect` and `list`** cannot tell when a hold expires: ZooKeeper
//!   tells no client when the ensemble last heard from another client's
//!   session (its `dump` command shows it only to the leader's operators,
//!   with one-second dates in the server's time zone). Each lock node
//!   records its holder, its negotiated session timeout and the `why`, and
//!   [`LockInfo::session_timeout`] reports the timeout: the lock frees
//!   about that long after the holder's session falls silent (`dlock
//!   status` prints it so). Nodes written by earlier versions report none.
//!
//! # Why a renewal syncs, and the bound the deadline subtracts (S4)
//!
//! In an ensemble, a client talks to one server, often a follower. Reads and
//! pings are answered by that follower alone, and a follower records the
//! sessions it hears from in a *touch table* that it hands to the leader
//! only in its answer to the leader's next ping (the leader pings every
//! `tickTime / 2`; `Learner.ping`, `LearnerHandler` `PING`). Only the
//! leader expires sessions (`SessionTrackerImpl`: last touch + timeout,
//! rounded up to a tick). A follower cut off from the leader keeps
//! answering reads until it has heard nothing for `syncLimit × tickTime`
//! (its socket timeout), while the leader may expire the session and give
//! its locks to someone else meanwhile. So a successful read does not prove
//! the session alive where it matters. A `sync` does: the follower forwards
//! it to the leader, whose `PrepRequestProcessor` checks the session is not
//! closing (a closed one answers `SESSIONEXPIRED`), and it completes only
//! after the leader answered, after the renewal was sent.
//!
//! One gap remains: the leader learns of the renewal's own touch from the
//! follower's next ping answer. If the follower is cut off right after
//! answering the `sync`, that answer may never arrive, and the leader's last
//! touch is the session's previous request that a ping answer did carry.
//! Two bounds close it: the follower answered the leader's pings until at
//! least the `sync` completed (pings every `tickTime / 2`), and this
//! client sends some request at least every `touch_gap` (a read of its
//! own, sent on schedule whether or not the last one was answered: the
//! driver's pings wait for each other's answers). So the leader last heard of
//! the session no earlier than `send − touch_gap − tickTime / 2`, and the
//! session's TTL in effect (what the core counts the local deadline with)
//! is the negotiated timeout less that bound plus a little for messages in
//! flight. `tickTime` is not visible to clients: `connect` asks the
//! ensemble for a 200 ms session, which it raises to its `minSessionTimeout`
//! if that is longer, by default `2 × tickTime`, and takes half of what it
//! got as the tick (an upper bound; an ensemble whose `minSessionTimeout` is
//! set below `2 × tickTime` breaks it).
//! A standalone server (its `/zookeeper/config` names no voters) is its own
//! leader and touches sessions as requests arrive: no bound there.
//!
//! Curator, for comparison, treats a connection loss as `SUSPENDED` (its
//! lock recipes stop) and simulates expiry by a timer from then (TN12,
//! TN14), but a client whose follower is cut off from the leader stays
//! connected until the follower gives up after `syncLimit × tickTime`: its
//! recipes do not cover that window.
//!
//! ```no_run
//! # async fn demo() -> Result<(), dlock_core::Error> {
//! use dlock_core::{Backend, SessionOptions};
//! let backend = dlock_zk::ZkBackend::connect("zk://127.0.0.1:2181/dlock").await?;
//! let session = backend.session(SessionOptions::new()).await?;
//! let guard = session.lock("jobs/import")?.acquire().await?;
//! guard.release().await?;
//! # Ok(()) }
//! ```

mod fence;
mod floor;
mod node_data;
mod session;

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use async_trait::async_trait;
use dlock_core::backend::RawSession;
use dlock_core::url::StoreUrl;
use dlock_core::{
    Backend, Capabilities, Error, FencingToken, LockInfo, LockName, SessionId, SessionOptions, name,
};
pub use fence::ZkFence;
pub use floor::ZkFloor;
use zookeeper_client as zk;

const BACKEND: &str = "zk";

/// The smallest TTL dlock asks ZooKeeper for; the ensemble may raise it to its
/// `minSessionTimeout` (2 × tickTime) and the session then uses that.
pub const MIN_TTL: Duration = Duration::from_millis(200);

/// The root node unless the URL has a path.
pub const DEFAULT_ROOT: &str = "/dlock";

/// How long a connection may stay silent before the client drops it and
/// reconnects (the driver pings after three eighths of it).
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest this client goes without sending anything on a session of
/// `timeout`: the driver (zookeeper-client 0.11) checks every `tick`, which
/// is `timeout / 20`, or `CONNECTION_TIMEOUT / 8` once that is shorter than
/// `timeout × 3 / 5`, and pings when nothing was sent for three ticks.
pub(crate) fn touch_gap(timeout: Duration) -> Duration {
    let tick = if CONNECTION_TIMEOUT > timeout * 3 / 5 {
        timeout / 20
    } else {
        CONNECTION_TIMEOUT / 8
    };
    tick.max(Duration::from_millis(1)) * 4
}

/// Allowance for messages in flight in [`report_lag`] (client to follower,
/// follower to leader).
const IN_FLIGHT: Duration = Duration::from_millis(20);

/// Maps a driver error to the core error by meaning.
pub(crate) fn map_err(e: zk::Error) -> Error {
    use zk::Error as E;
    match e {
        E::SessionExpired => Error::session_lost("", "ZooKeeper expired it"),
        E::ClientClosed => Error::session_lost("", "its ZooKeeper client was closed"),
        E::AuthFailed => Error::Auth {
            backend: BACKEND,
            reason: "authentication failed".into(),
        },
        E::NoAuth => Error::Auth {
            backend: BACKEND,
            reason: "not authorized: the node's ACL does not admit these credentials (a wrong \
                     user or password, or none)"
                .into(),
        },
        // Everything about the connection (lost, reset, silent: the driver
        // reports "no response from connection in ...ms" and I/O errors as
        // `Custom`) may work on the next try.
        E::ConnectionLoss
        | E::Timeout
        | E::NoHosts
        | E::Throttled
        | E::SessionMoved
        | E::NotReadOnly
        | E::Custom(_) => Error::unavailable(BACKEND, e),
        E::UnmarshalError { .. }
        | E::MarshallingError
        | E::UnexpectedError(_)
        | E::RuntimeInconsistent => Error::protocol(BACKEND, e.to_string()),
        other => Error::backend(BACKEND, other),
    }
}

/// A parsed `zk://` URL.
#[derive(Clone)]
pub(crate) struct Config {
    /// `h1:p1,h2:p2`, the driver's connect string.
    pub(crate) hosts: String,
    pub(crate) root: String,
    pub(crate) auth: Option<(String, String)>,
    /// Shown redacted.
    url: StoreUrl,
}

impl Config {
    fn parse(url: &StoreUrl) -> Result<Self, Error> {
        if url.scheme() != "zk" || url.hosts().is_empty() {
            return Err(url.invalid("expected zk://host:port[,host:port...][/root]"));
        }
        url.options().finish()?;
        if url.fragment().is_some() {
            return Err(url.invalid("zk URLs take no #fragment"));
        }
        let auth = match (url.username(), url.password()) {
            ("", None) => None,
            (_, None) => return Err(url.invalid("user without password")),
            (user, Some(password)) => {
                if user.is_empty() || user.contains(':') {
                    return Err(url.invalid("empty user name, or one with a ':'"));
                }
                Some((user.to_owned(), password.to_owned()))
            }
        };
        let mut hosts = Vec::new();
        for host in url.hosts() {
            if host.port.is_none() {
                return Err(
                    url.invalid(format!("every host must be host:port ({host} has no port)"))
                );
            }
            hosts.push(host.to_string());
        }
        let path = url.path_decoded()?;
        let root = match path.trim_end_matches('/') {
            "" => DEFAULT_ROOT.to_owned(),
            root => format!("/{root}"),
        };
        let root_ok = root.len() <= 128
            && root[1..].split('/').all(|s| {
                !s.is_empty()
                    && s != "zookeeper"
                    && s.chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            });
        if !root_ok {
            return Err(url.invalid(
                "the root must be /-separated segments of [A-Za-z0-9-_.] (not /zookeeper)",
            ));
        }
        Ok(Self {
            hosts: hosts.join(","),
            root,
            auth,
            url: url.clone(),
        })
    }

    pub(crate) fn acls(&self) -> zk::Acls<'static> {
        if self.auth.is_some() {
            zk::Acls::creator_all()
        } else {
            zk::Acls::anyone_all()
        }
    }

    /// A new ZooKeeper session.
    pub(crate) async fn connect(&self, timeout: Duration) -> Result<zk::Client, Error> {
        let mut connector = zk::Client::connector()
            .with_session_timeout(timeout)
            .with_connection_timeout(CONNECTION_TIMEOUT);
        if let Some((user, password)) = &self.auth {
            connector = connector.with_auth("digest", format!("{user}:{password}").as_bytes());
        }
        let bound = Duration::from_secs(10);
        // The driver tries the hosts in turn until one gives a session, for
        // up to the bound (members refuse clients during an election). When
        // every host refuses the TCP connection, nothing listens: that is
        // said within a moment instead of after the bound. (Probed only once
        // the connect has taken that moment: a session that opens at once
        // costs no extra connection to each host.)
        let nothing_listens = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if !self.every_host_refuses().await {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            connected = tokio::time::timeout(bound, connector.connect(&self.hosts)) => match connected {
                Ok(result) => result.map_err(map_err),
                Err(_) => Err(Error::unavailable(
                    BACKEND,
                    format!("no answer from {} within {bound:?}", self.hosts),
                )),
            },
            () = nothing_listens => Err(Error::unavailable(
                BACKEND,
                format!("cannot connect to {}: connection refused", self.hosts),
            )),
        }
    }

    /// Whether every host refuses a TCP connection now (nothing listens).
    async fn every_host_refuses(&self) -> bool {
        let probes = self.hosts.split(',').map(|host| async move {
            matches!(
                tokio::time::timeout(
                    Duration::from_millis(500),
                    tokio::net::TcpStream::connect(host)
                )
                .await,
                Ok(Err(ref e)) if e.kind() == std::io::ErrorKind::ConnectionRefused
            )
        });
        futures::future::join_all(probes)
            .await
            .into_iter()
            .all(|refused| refused)
    }

    /// Why a read of `path` was refused, naming the user but never the
    /// password.
    fn refused(&self, path: &str) -> Error {
        Error::Auth {
            backend: BACKEND,
            reason: match &self.auth {
                Some((user, _)) => format!(
                    "digest user {user:?} may not read {path}: a wrong password, or a user the \
                     node's ACL does not admit"
                ),
                None => format!("{path} requires credentials (zk://user:password@...)"),
            },
        }
    }
}

/// The shared state of a backend: the configuration, an admin session and
/// what the ensemble told about itself.
pub(crate) struct Inner {
    pub(crate) config: Config,
    /// The admin session (`inspect`, `list`, `force_release`), replaced if
    /// it expires.
    admin: Mutex<zk::Client>,
    /// Half the ensemble's tick (see the crate docs); `None` for a
    /// standalone server.
    half_tick: Option<Duration>,
}

impl Inner {
    /// `<root>/<flat name>`: the parent of one lock's queue nodes.
    pub(crate) fn parent(&self, name: &LockName) -> String {
        format!("{}/{}", self.config.root, name.flat())
    }

    /// How long before a session of `timeout` expires on the leader a
    /// confirmed renewal may count from (see the crate docs).
    pub(crate) fn report_lag(&self, timeout: Duration) -> Duration {
        match self.half_tick {
            None => Duration::ZERO,
            Some(half_tick) => touch_gap(timeout) + half_tick + IN_FLIGHT,
        }
    }

    /// The admin session, a new one if the old one expired.
    async fn admin(&self) -> Result<zk::Client, Error> {
        let current = self.admin.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if !current.state().is_terminated() {
            return Ok(current);
        }
        let fresh = self.config.connect(ADMIN_TIMEOUT).await?;
        *self.admin.lock().unwrap_or_else(|e| e.into_inner()) = fresh.clone();
        Ok(fresh)
    }
}

/// The admin session's timeout.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether the ensemble has more than one voting server (its dynamic
/// configuration `/zookeeper/config`, which a standalone server leaves
/// empty). Servers without it (3.4), or that do not let this user read it,
/// count as an ensemble (the safe side).
async fn is_ensemble(admin: &zk::Client) -> Result<bool, Error> {
    match admin.get_data("/zookeeper/config").await {
        Ok((data, _)) => {
            let voters = String::from_utf8_lossy(&data)
                .lines()
                .filter(|l| l.starts_with("server.") && !l.contains(":observer"))
                .count();
            Ok(voters > 1)
        }
        Err(zk::Error::NoNode | zk::Error::NoAuth) => Ok(true),
        Err(e) => Err(map_err(e)),
    }
}

/// Half the ensemble's `tickTime`, at most: a session asked for a short
/// timeout gets at least the ensemble's `minSessionTimeout`, by default
/// `2 × tickTime`, so half of what it gets is at least the tick. (A shorter
/// ask would pin it down better, but the driver also gives up connecting
/// after the timeout asked for: start short, ask longer if that fails.)
async fn half_tick(config: &Config) -> Result<Duration, Error> {
    let mut last = None;
    for ask in [200, 1000, 5000].map(Duration::from_millis) {
        match config.connect(ask).await {
            Ok(probe) => return Ok(probe.session_timeout() / 4),
            Err(e) if e.is_retryable() => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| Error::unavailable(BACKEND, "no probe session")))
}

/// The `zk://` [`Adapter`](dlock_core::Adapter): register it to open ZooKeeper URLs through a
/// [`Registry`](dlock_core::Registry).
///
/// ```no_run
/// # async fn demo() -> Result<(), dlock_core::Error> {
/// use dlock_zk::ZkAdapter;
/// dlock_core::registry().register(ZkAdapter)?;
/// let backend = dlock_core::registry().connect("zk://127.0.0.1:2181/dlock").await?;
/// assert_eq!(backend.capabilities(), ZkAdapter.capabilities());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct ZkAdapter;

impl ZkAdapter {
    /// What every ZooKeeper backend promises, standalone or ensemble (what
    /// [`Backend::capabilities`] of a [`ZkBackend`] answers).
    pub fn capabilities(&self) -> Capabilities {
        // FIFO by sequence; tokens are czxids (global, strictly increasing,
        // logged to disk before acknowledged); a waiter's exists-watch is on
        // its predecessor only; a ZooKeeper session outlives its connection
        // and a server restart (sessions are in the snapshot and log).
        // Session expiry is checked every tick; ephemeral nodes go with it.
        // A session has one connection at a time: when the client
        // reconnects, the server closes the session's old connection
        // (`ZooKeeperServer::processConnectRequest`: `closeSession(..,
        // CLIENT_RECONNECT)`; another server refuses its requests as a moved
        // session's), so a request cut off on it never lands after the
        // retry that replaced it.
        Capabilities::watched_queue(Duration::from_millis(1000))
    }
}

dlock_core::impl_adapter!(ZkAdapter, name: BACKEND, schemes: &["zk"], connect: ZkBackend::connect, floor: ZkFloor::connect);

/// A lock service on a ZooKeeper ensemble (see the [crate docs](crate)).
#[derive(Clone)]
pub struct ZkBackend {
    inner: Arc<Inner>,
}

impl ZkBackend {
    /// Connects (one admin session for `inspect`, `list` and
    /// `force_release`), creates the root node if needed and checks that
    /// the credentials may read it.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for a malformed URL, [`Error::Auth`] when the
    /// root's ACL does not admit the credentials (a wrong password),
    /// [`Error::Unavailable`] when no server answers.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn connect<U>(url: U) -> Result<Self, Error>
    where
        U: TryInto<StoreUrl, Error = Error>,
    {
        let config = Config::parse(&url.try_into()?)?;
        let admin = config.connect(ADMIN_TIMEOUT).await?;
        let persistent = zk::CreateMode::Persistent.with_acls(config.acls());
        match admin.mkdir(&config.root, &persistent).await {
            Ok(()) => {}
            Err(zk::Error::NoAuth) => return Err(config.refused(&config.root)),
            Err(e) => return Err(map_err(e)),
        }
        // Digest credentials are never refused at connect, only by ACLs.
        match admin.list_children(&config.root).await {
            Ok(_) => {}
            Err(zk::Error::NoAuth) => return Err(config.refused(&config.root)),
            Err(e) => return Err(map_err(e)),
        }
        let half_tick = if is_ensemble(&admin).await? {
            Some(half_tick(&config).await?)
        } else {
            None
        };
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                admin: Mutex::new(admin),
                half_tick,
            }),
        })
    }

    /// Nodes left under the lock names starting with `prefix` (parents and
    /// queue nodes): zero once nothing is held or waited for.
    pub async fn nodes_under(&self, prefix: &str) -> Result<usize, Error> {
        name::check_prefix(prefix)?;
        let admin = self.inner.admin().await?;
        let flat = prefix.replace('/', "%2F");
        let children = admin
            .list_children(&self.inner.config.root)
            .await
            .map_err(map_err)?;
        let mut count = 0;
        for child in children.into_iter().filter(|c| c.starts_with(&flat)) {
            let path = format!("{}/{child}", self.inner.config.root);
            match admin.list_children(&path).await {
                Ok(queue) => count += 1 + queue.len(),
                Err(zk::Error::NoNode) => {}
                Err(e) => return Err(map_err(e)),
            }
        }
        Ok(count)
    }

    /// The queue of `name`, lowest sequence first.
    async fn queue(&self, admin: &zk::Client, name: &LockName) -> Result<Vec<String>, Error> {
        match admin.list_children(&self.inner.parent(name)).await {
            Ok(children) => Ok(session::sorted(children)),
            Err(zk::Error::NoNode) => Ok(Vec::new()),
            Err(e) => Err(map_err(e)),
        }
    }

    /// The holder node of `name` with its data and stat.
    async fn head(
        &self,
        name: &LockName,
    ) -> Result<Option<(String, Vec<u8>, zk::Stat, usize)>, Error> {
        let admin = self.inner.admin().await?;
        let queue = self.queue(&admin, name).await?;
        for node in &queue {
            let path = format!("{}/{node}", self.inner.parent(name));
            match admin.get_data(&path).await {
                Ok((data, stat)) => return Ok(Some((path, data, stat, queue.len()))),
                Err(zk::Error::NoNode) => continue, // released meanwhile
                Err(e) => return Err(map_err(e)),
            }
        }
        Ok(None)
    }
}

impl fmt::Debug for ZkBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkBackend")
            .field("url", &self.inner.config.url)
            .field("root", &self.inner.config.root)
            .finish()
    }
}

fn info_of(name: LockName, data: &[u8], stat: &zk::Stat, queue: usize) -> LockInfo {
    let data = node_data::decode(data);
    let mut info = LockInfo::new(name, data.holder, FencingToken::new(stat.czxid as u64));
    info.why = data.why;
    info.session_timeout = data.timeout;
    info.acquired_at = Some(UNIX_EPOCH + Duration::from_millis(stat.ctime.max(0) as u64));
    info.waiters = Some(queue.saturating_sub(1));
    info
}

#[async_trait]
impl Backend for ZkBackend {
    fn scheme(&self) -> &'static str {
        BACKEND
    }

    fn min_ttl(&self) -> Duration {
        MIN_TTL
    }

    fn capabilities(&self) -> Capabilities {
        ZkAdapter.capabilities()
    }

    async fn ping(&self) -> Result<(), Error> {
        self.inner
            .admin()
            .await?
            .check_stat(&self.inner.config.root)
            .await
            .map_err(map_err)?;
        Ok(())
    }

    async fn open(
        &self,
        id: SessionId,
        options: &SessionOptions,
    ) -> Result<Arc<dyn RawSession>, Error> {
        Ok(Arc::new(
            session::ZkSession::open(self.inner.clone(), id, options.ttl_value()).await?,
        ))
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>, Error> {
        Ok(self
            .head(name)
            .await?
            .map(|(_, data, stat, n)| info_of(name.clone(), &data, &stat, n)))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>, Error> {
        name::check_prefix(prefix)?;
        let flat = prefix.replace('/', "%2F");
        let mut children = self
            .inner
            .admin()
            .await?
            .list_children(&self.inner.config.root)
            .await
            .map_err(map_err)?;
        children.retain(|c| c.starts_with(&flat));
        children.sort();
        let mut out = Vec::new();
        for child in children {
            let Ok(name) = LockName::unflat(&child) else {
                continue;
            };
            if let Some(info) = self.inspect(&name).await? {
                out.push(info);
            }
        }
        Ok(out)
    }

    async fn validate(&self, name: &LockName, token: FencingToken) -> Result<bool, Error> {
        Ok(self
            .head(name)
            .await?
            .is_some_and(|(_, _, stat, _)| stat.czxid as u64 == token.get()))
    }

    async fn force_release(&self, name: &LockName) -> Result<bool, Error> {
        let Some((path, data, stat, _)) = self.head(name).await? else {
            return Ok(false);
        };
        let admin = self.inner.admin().await?;
        match admin.delete(&path, Some(stat.version)).await {
            Ok(()) => {
                tracing::info!(lock = %name, holder = %node_data::decode(&data).holder, token = stat.czxid, "force-released");
                Ok(true)
            }
            Err(zk::Error::NoNode) => Ok(false),
            Err(e) => Err(map_err(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(url: &str) -> Result<Config, Error> {
        Config::parse(&StoreUrl::parse(url)?)
    }

    #[test]
    fn parses_hosts_auth_and_root() {
        let c = parsed("zk://u:pw@a:1,b:2/apps/locks/").unwrap();
        assert_eq!(
            (c.hosts.as_str(), c.root.as_str()),
            ("a:1,b:2", "/apps/locks")
        );
        assert_eq!(c.auth, Some(("u".into(), "pw".into())));
        let c = parsed("zk://a:1").unwrap();
        assert_eq!(c.root, DEFAULT_ROOT);
        let c = parsed("zk://[::1]:2181/").unwrap();
        assert_eq!(
            (c.hosts.as_str(), c.root.as_str()),
            ("[::1]:2181", DEFAULT_ROOT)
        );
        let c = parsed("zk://u:p%2Fa%40s%3As@a:1/r").unwrap();
        assert_eq!(c.auth, Some(("u".into(), "p/a@s:s".into())));
        let c = parsed("zk://u:p@ss@a:1/r").unwrap();
        assert_eq!(c.auth, Some(("u".into(), "p@ss".into())));
    }

    #[test]
    fn refuses_bad_urls_without_the_password() {
        for (url, why) in [
            ("zk://u:hunter2@a", "host:port"),
            ("zk://u:hunter2@a:x", "port"),
            ("zk://u:hunter2@a:1/bad root", "percent-encode"),
            ("zk://u:hunter2@a:1/bad%20root", "the root must be"),
            ("zk://u:hunter2@a:1//r", "the root must be"),
            ("zk://u:hunter2@a:1/zookeeper", "not /zookeeper"),
            (
                "zk://u:hunter2@a:1?x=1",
                "unknown option \"x\" (zk:// takes no options)",
            ),
            ("zk://u:hunter2@a:1#x", "fragment"),
            ("zk://:hunter2@a:1", "empty user name"),
            ("zk://u%3Av:hunter2@a:1", "with a ':'"),
            ("zk://u@a:1", "user without password"),
            ("zk://u:hunter2@a:1,", "empty host"),
            ("zookeeper://a:1", "expected zk://"),
            ("zk://", "expected zk://"),
            ("zk:a:1", "expected zk://"),
        ] {
            dlock_conformance::unit::assert_refused(url, parsed(url), why);
        }
    }

    /// The values the conformance harness runs with (it takes them from
    /// here): a change is a change of what ZooKeeper backends promise.
    #[test]
    fn capabilities_are_the_same_for_every_url() {
        let c = ZkAdapter.capabilities();
        assert_eq!(c, Capabilities::watched_queue(Duration::from_millis(1000)));
        assert_eq!(dlock_core::Adapter::schemes(&ZkAdapter), ["zk"]);
    }

    #[test]
    fn connection_errors_are_retryable() {
        for e in [
            zk::Error::ConnectionLoss,
            zk::Error::Timeout,
            zk::Error::NoHosts,
            zk::Error::SessionMoved,
        ] {
            assert!(map_err(e.clone()).is_retryable(), "{e}");
        }
        assert!(matches!(
            map_err(zk::Error::SessionExpired),
            Error::SessionLost { .. }
        ));
        assert!(matches!(map_err(zk::Error::NoAuth), Error::Auth { .. }));
        assert!(matches!(map_err(zk::Error::AuthFailed), Error::Auth { .. }));
    }

    #[test]
    fn the_touch_gap_follows_the_drivers_ping_schedule() {
        assert_eq!(
            touch_gap(Duration::from_secs(2)),
            Duration::from_millis(400)
        );
        assert_eq!(
            touch_gap(Duration::from_secs(30)),
            Duration::from_millis(2500)
        );
    }
}
