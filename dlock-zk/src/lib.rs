//! dlock on ZooKeeper: `zk://[user:password@]h1:p1,h2:p2,h3:p3[/root]`.
//!
//! # How it works
//!
//! * **Session = the ZooKeeper session**, with the session timeout negotiated
//!   from the TTL (the session runs with what the ensemble granted). A
//!   renewal round is one multi-read of the session's lock nodes: it proves
//!   the session alive as of when it was sent (S4) and that each node still
//!   exists with its token. `Disconnected` is a suspension: the holder keeps
//!   its locks only until its local deadline; a reconnection within the
//!   session keeps them. `Expired` loses the session and every lock (`lost()`
//!   fires; open a new session).
//! * **Take**: an `EPHEMERAL_SEQUENTIAL` node `<root>/<name>/<guid>-lock-`,
//!   where `<name>` is one path segment ([`LockName::flat`], so `a` and `a/b`
//!   never nest) and `guid` = session id + attempt id ("protected" mode:
//!   after a connection loss during the create, the attempt finds its own
//!   node by the guid instead of creating a second one). The lowest sequence
//!   holds; a waiter sets an exists-watch on its predecessor only (no herd)
//!   and then re-checks. Fair: FIFO by sequence. A cancelled or timed-out
//!   waiter deletes its node.
//! * **Token** = the own node's `czxid` (the zxid that created it): global,
//!   strictly increasing, durable. Not the sequence suffix, which belongs to
//!   the parent and restarts if the parent is recreated.
//! * The lock's parent node is a *container* node, deleted by ZooKeeper once
//!   empty; a release also deletes it at once when it is empty, so 10,000
//!   names leave nothing behind.
//! * `user:password@` authenticates with the `digest` scheme, and the nodes
//!   dlock creates then carry the `CREATOR_ALL` ACL (only that user may touch
//!   them); without credentials they are open to anyone (`ANYONE_ALL`).
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

mod session;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use async_trait::async_trait;
use dlock_core::backend::RawSession;
use dlock_core::url::redact;
use dlock_core::{
    Backend, Error, FencingToken, LockInfo, LockName, SessionId, SessionOptions, name,
};
use zookeeper_client as zk;

const BACKEND: &str = "zk";

/// The smallest TTL dlock asks ZooKeeper for; the ensemble may raise it to its
/// `minSessionTimeout` (2 × tickTime) and the session then uses that.
pub const MIN_TTL: Duration = Duration::from_millis(200);

/// The root node unless the URL has a path.
pub const DEFAULT_ROOT: &str = "/dlock";

/// Maps a driver error to the core error by meaning.
pub(crate) fn map_err(e: zk::Error) -> Error {
    use zk::Error as E;
    match e {
        E::SessionExpired => Error::SessionLost {
            session: "zookeeper session expired".into(),
        },
        E::ConnectionLoss | E::Timeout | E::NoHosts | E::Throttled | E::SessionMoved => {
            Error::unavailable(BACKEND, e)
        }
        E::UnmarshalError { .. } | E::MarshallingError | E::UnexpectedError(_) => {
            Error::protocol(BACKEND, e.to_string())
        }
        other => Error::backend(BACKEND, other),
    }
}

/// A parsed `zk://` URL.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) hosts: String,
    pub(crate) root: String,
    pub(crate) auth: Option<(String, String)>,
    shown: String,
}

impl Config {
    fn parse(url: &str) -> Result<Self, Error> {
        let bad = |reason: &str| Error::invalid_url(url, reason);
        let rest = url
            .strip_prefix("zk://")
            .ok_or_else(|| bad("expected zk://host:port[,host:port...][/root]"))?;
        if rest.contains('?') {
            return Err(bad("zk URLs take no query options"));
        }
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let auth = match userinfo {
            None => None,
            Some(u) => {
                let (user, password) = u
                    .split_once(':')
                    .ok_or_else(|| bad("user without password"))?;
                if user.is_empty() {
                    return Err(bad("empty user name"));
                }
                Some((user.to_owned(), password.to_owned()))
            }
        };
        for host in hosts.split(',') {
            let (h, port) = host
                .rsplit_once(':')
                .ok_or_else(|| bad("every host needs a port"))?;
            if h.is_empty() || port.parse::<u16>().is_err() {
                return Err(bad("every host must be host:port"));
            }
        }
        let root = path.trim_end_matches('/');
        let root = if root.is_empty() { DEFAULT_ROOT } else { root };
        let root_ok = root.len() <= 128
            && root[1..].split('/').all(|s| {
                !s.is_empty()
                    && s != "zookeeper"
                    && s.chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            });
        if !root_ok {
            return Err(bad(
                "the root must be /-separated segments of [A-Za-z0-9-_.] (not /zookeeper)",
            ));
        }
        Ok(Self {
            hosts: hosts.to_owned(),
            root: root.to_owned(),
            auth,
            shown: redact(url),
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
            .with_connection_timeout(Duration::from_secs(5));
        if let Some((user, password)) = &self.auth {
            connector = connector.with_auth("digest", format!("{user}:{password}").as_bytes());
        }
        tokio::time::timeout(Duration::from_secs(10), connector.connect(&self.hosts))
            .await
            .map_err(|_| Error::unavailable(BACKEND, "connect timed out"))?
            .map_err(map_err)
    }
}

/// The shared state of a backend: the configuration and an admin session.
pub(crate) struct Inner {
    pub(crate) config: Config,
    admin: zk::Client,
}

impl Inner {
    /// `<root>/<flat name>`: the parent of one lock's queue nodes.
    pub(crate) fn parent(&self, name: &LockName) -> String {
        format!("{}/{}", self.config.root, name.flat())
    }
}

/// A lock service on a ZooKeeper ensemble (see the [crate docs](crate)).
#[derive(Clone)]
pub struct ZkBackend {
    inner: Arc<Inner>,
}

impl ZkBackend {
    /// Connects (one admin session for `inspect`, `list` and
    /// `force_release`) and creates the root node if needed.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let config = Config::parse(url)?;
        let admin = config.connect(Duration::from_secs(10)).await?;
        let persistent = zk::CreateMode::Persistent.with_acls(config.acls());
        admin
            .mkdir(&config.root, &persistent)
            .await
            .map_err(map_err)?;
        Ok(Self {
            inner: Arc::new(Inner { config, admin }),
        })
    }

    /// Nodes left under the lock names starting with `prefix` (parents and
    /// queue nodes): zero once nothing is held or waited for.
    pub async fn nodes_under(&self, prefix: &str) -> Result<usize, Error> {
        name::check_prefix(prefix)?;
        let flat = prefix.replace('/', "%2F");
        let children = self
            .inner
            .admin
            .list_children(&self.inner.config.root)
            .await
            .map_err(map_err)?;
        let mut count = 0;
        for child in children.into_iter().filter(|c| c.starts_with(&flat)) {
            let path = format!("{}/{child}", self.inner.config.root);
            match self.inner.admin.list_children(&path).await {
                Ok(queue) => count += 1 + queue.len(),
                Err(zk::Error::NoNode) => {}
                Err(e) => return Err(map_err(e)),
            }
        }
        Ok(count)
    }

    /// The queue of `name`, lowest sequence first.
    async fn queue(&self, name: &LockName) -> Result<Vec<String>, Error> {
        match self
            .inner
            .admin
            .list_children(&self.inner.parent(name))
            .await
        {
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
        let queue = self.queue(name).await?;
        for node in &queue {
            let path = format!("{}/{node}", self.inner.parent(name));
            match self.inner.admin.get_data(&path).await {
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
            .field("url", &self.inner.config.shown)
            .field("root", &self.inner.config.root)
            .finish()
    }
}

fn info_of(name: LockName, data: &[u8], stat: &zk::Stat, queue: usize) -> LockInfo {
    let text = String::from_utf8_lossy(data);
    let (holder, why) = text.split_once('\n').unwrap_or((&text, ""));
    let mut info = LockInfo::new(name, holder, FencingToken::new(stat.czxid as u64));
    info.why = (!why.is_empty()).then(|| why.to_owned());
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

    async fn ping(&self) -> Result<(), Error> {
        self.inner
            .admin
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
            .admin
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
        match self.inner.admin.delete(&path, Some(stat.version)).await {
            Ok(()) => {
                tracing::info!(lock = %name, holder = %String::from_utf8_lossy(&data).lines().next().unwrap_or(""), token = stat.czxid, "force-released");
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

    #[test]
    fn parses_hosts_auth_and_root() {
        let c = Config::parse("zk://u:pw@a:1,b:2/apps/locks/").unwrap();
        assert_eq!(
            (c.hosts.as_str(), c.root.as_str()),
            ("a:1,b:2", "/apps/locks")
        );
        assert_eq!(c.auth, Some(("u".into(), "pw".into())));
        let c = Config::parse("zk://a:1").unwrap();
        assert_eq!(c.root, DEFAULT_ROOT);
    }

    #[test]
    fn refuses_bad_urls_without_the_password() {
        for url in [
            "zk://u:hunter2@a",
            "zk://u:hunter2@a:1/bad root",
            "zk://u:hunter2@a:1/zookeeper",
            "zk://u:hunter2@a:1?x=1",
            "zk://:hunter2@a:1",
            "zookeeper://a:1",
            "zk://",
        ] {
            let e = Config::parse(url)
                .err()
                .unwrap_or_else(|| panic!("{url} accepted"));
            assert!(matches!(e, Error::InvalidUrl { .. }), "{url}: {e:?}");
            assert!(!e.to_string().contains("hunter2"), "{e}");
        }
    }
}
