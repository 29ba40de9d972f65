//! [`ZkFence`]: a lock's fencing token checked where the protected data
//! lives, when that is ZooKeeper.

use dlock_core::{FenceError, FencingToken, StaleToken};
use zookeeper_client as zk;

/// Fenced writes to ZooKeeper: your operations go into one `multi` with the
/// fence znode's update, which carries the version the check read, so the
/// server applies them only if no other token was recorded in between; an
/// older token is [`FenceError::Stale`] and nothing is written. The check is
/// a read of the fence znode before the multi (one more round trip), retried
/// if the version moved. Equal tokens are accepted, so a holder may write
/// many times.
///
/// The fence znode (one per resource, its parent must exist) is created on
/// the first write with the ACLs given to [`acls`](Self::acls) (default
/// `ANYONE_ALL`). **Never delete a fence znode**: a new one starts from no
/// token (and one deleted and re-created between a check's read and its
/// multi has the version the read saw). Give it ACLs that keep other
/// clients from deleting it. Tokens are per lock name: guard one resource
/// with one lock name on one backend.
///
/// ```no_run
/// # async fn demo(client: zookeeper_client::Client, guard: dlock_core::LockGuard) -> Result<(), dlock_core::FenceError> {
/// use dlock_zk::ZkFence;
///
/// let fence = ZkFence::new("/fences-acct-42");
/// fence
///     .commit(&client, guard.token(), |multi| multi.add_set_data("/acct/42", b"90", None))
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct ZkFence {
    path: String,
    acls: zk::Acls<'static>,
}

/// Tries before a fence whose version keeps moving is reported.
const TRIES: usize = 64;

impl ZkFence {
    /// The fence kept in the znode `path`.
    pub fn new(path: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            acls: zk::Acls::anyone_all(),
        }
    }

    /// The ACLs the fence znode is created with.
    pub fn acls(mut self, acls: zk::Acls<'static>) -> Self {
        self.acls = acls;
        self
    }

    /// The fence znode's path.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Runs the operations `ops` adds to the multi if `token` is current,
    /// and records `token`; the multi's results, after the fence's own
    /// first. `ops` may be called more than once (a retry after the fence
    /// moved).
    pub async fn commit<F>(
        &self,
        client: &zk::Client,
        token: FencingToken,
        ops: F,
    ) -> Result<Vec<zk::MultiWriteResult>, FenceError>
    where
        F: Fn(&mut zk::MultiWriter<'_>) -> Result<(), zk::Error>,
    {
        let value = token.get().to_string();
        let create = zk::CreateMode::Persistent.with_acls(self.acls);
        for _ in 0..TRIES {
            let mut multi = client.new_multi_writer();
            match client.get_data(&self.path).await {
                Ok((data, stat)) => {
                    let highest = parse(&data);
                    if highest > token.get() {
                        return Err(self.stale(token, highest));
                    }
                    multi
                        .add_set_data(&self.path, value.as_bytes(), Some(stat.version))
                        .map_err(|e| self.store_error(e))?;
                }
                Err(zk::Error::NoNode) => multi
                    .add_create(&self.path, value.as_bytes(), &create)
                    .map_err(|e| self.store_error(e))?,
                Err(e) => return Err(self.store_error(e)),
            }
            ops(&mut multi).map_err(|e| self.store_error(e))?;
            match multi.commit().await {
                Ok(results) => return Ok(results),
                // The fence moved (or appeared) since the read: look again.
                Err(zk::MultiWriteError::OperationFailed {
                    index: 0,
                    source: zk::Error::BadVersion | zk::Error::NodeExists | zk::Error::NoNode,
                }) => continue,
                Err(e) => return Err(self.store_error(e.into())),
            }
        }
        Err(self.store_error(zk::Error::BadVersion))
    }

    /// The highest token accepted so far, if any.
    pub async fn highest(&self, client: &zk::Client) -> Result<Option<FencingToken>, FenceError> {
        match client.get_data(&self.path).await {
            Ok((data, _)) => Ok(Some(FencingToken::new(parse(&data)))),
            Err(zk::Error::NoNode) => Ok(None),
            Err(e) => Err(self.store_error(e)),
        }
    }

    fn stale(&self, token: FencingToken, highest: u64) -> FenceError {
        FenceError::Stale {
            resource: self.path.clone(),
            stale: StaleToken {
                token,
                highest: FencingToken::new(highest),
            },
        }
    }

    fn store_error(&self, e: zk::Error) -> FenceError {
        FenceError::Store {
            resource: self.path.clone(),
            source: Box::new(e),
        }
    }
}

/// The token a fence znode holds (an unreadable one counts as the largest:
/// refusing is the safe side).
fn parse(data: &[u8]) -> u64 {
    std::str::from_utf8(data)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(u64::MAX)
}
