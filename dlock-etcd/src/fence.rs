//! [`EtcdFence`]: a lock's fencing token checked where the protected data
//! lives, when that is etcd.

use dlock_core::{FenceError, FencingToken, StaleToken};
use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp, TxnOpResponse, TxnResponse};

/// Fenced writes to etcd: your operations go into one transaction whose
/// compare refuses them if a newer token than yours is recorded in the
/// resource's *fence key*, and which records your token otherwise, atomically
/// on the server. An older token is [`FenceError::Stale`] and nothing is
/// written. Equal tokens are accepted, so a holder may write many times.
///
/// The fence key holds the token as 20 decimal digits (etcd compares values
/// as bytes, so fixed width makes byte order numeric order). Tokens are per
/// lock name: guard one resource with one lock name on one backend.
///
/// ```no_run
/// # async fn demo(mut client: etcd_client::Client, guard: dlock_core::LockGuard) -> Result<(), dlock_core::FenceError> {
/// use dlock_etcd::EtcdFence;
/// use etcd_client::TxnOp;
///
/// let fence = EtcdFence::new("/fences/acct/42");
/// fence
///     .commit(&mut client, guard.token(), [TxnOp::put("/acct/42/balance", "90", None)])
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdFence {
    key: String,
}

/// `token` as the fence key's value.
fn encode(token: FencingToken) -> String {
    format!("{:020}", token.get())
}

impl EtcdFence {
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

    /// The transaction: if the recorded token is newer than `token`, read
    /// it (and write nothing); else record `token` and run `ops`. A missing
    /// fence key compares false (etcd), so the first write goes through.
    /// [`commit`](Self::commit) sends it and reads the answer.
    ///
    /// **If you send it yourself, `succeeded() == true` means refused**
    /// (the compare is "a newer token is recorded"; etcd has no `<=`), and
    /// your ops went in the else branch. The fence's put takes one of the
    /// transaction's operations (etcd allows 128 by default), and your ops
    /// may not touch the fence key (etcd refuses a key twice in one txn).
    pub fn txn(&self, token: FencingToken, ops: impl Into<Vec<TxnOp>>) -> Txn {
        let mut writes = vec![TxnOp::put(self.key.as_str(), encode(token), None)];
        writes.extend(ops.into());
        Txn::new()
            .when([Compare::value(
                self.key.as_str(),
                CompareOp::Greater,
                encode(token),
            )])
            .and_then([TxnOp::get(self.key.as_str(), None)])
            .or_else(writes)
    }

    /// Runs `ops` if `token` is current (see [`txn`](Self::txn)); the
    /// transaction's answer, whose op responses start with the fence's own
    /// put.
    pub async fn commit(
        &self,
        client: &mut Client,
        token: FencingToken,
        ops: impl Into<Vec<TxnOp>>,
    ) -> Result<TxnResponse, FenceError> {
        let response = client
            .txn(self.txn(token, ops))
            .await
            .map_err(|e| self.store_error(e))?;
        if !response.succeeded() {
            return Ok(response);
        }
        let highest = response
            .op_responses()
            .into_iter()
            .find_map(|r| match r {
                TxnOpResponse::Get(get) => get.kvs().first().map(|kv| kv.value().to_vec()),
                _ => None,
            })
            .and_then(|v| String::from_utf8(v).ok()?.parse().ok())
            .map_or(token, FencingToken::new);
        Err(FenceError::Stale {
            resource: self.key.clone(),
            stale: StaleToken { token, highest },
        })
    }

    /// The highest token accepted so far, if any.
    pub async fn highest(&self, client: &mut Client) -> Result<Option<FencingToken>, FenceError> {
        let got = client
            .get(self.key.as_str(), None)
            .await
            .map_err(|e| self.store_error(e))?;
        Ok(got
            .kvs()
            .first()
            .and_then(|kv| std::str::from_utf8(kv.value()).ok()?.parse().ok())
            .map(FencingToken::new))
    }

    fn store_error(&self, e: etcd_client::Error) -> FenceError {
        FenceError::Store {
            resource: self.key.clone(),
            source: Box::new(e),
        }
    }
}
