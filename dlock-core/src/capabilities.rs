//! [`Capabilities`]: what a backend promises beyond the safety invariants.
//! A leaf module: [`Backend`](crate::Backend) declares them and the adapter
//! registry and the conformance suite read them.

use std::time::Duration;

/// What a backend promises beyond the safety invariants every backend keeps
/// (S1–S9): ordering, wake-ups, what survives which fault. Applications read
/// it to choose a store; the conformance suite reads it to decide which
/// cases apply and how long to wait.
///
/// Adapters declare the worst case over the deployments their URL allows
/// (plain Redis without persistence loses locks in a restart, even if a
/// given server has an append-only file).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Waiters are granted in arrival order (L4).
    pub fair: bool,
    /// Tokens keep increasing across a restart of every server (S2).
    pub durable_tokens: bool,
    /// A release wakes a waiter through a store notification, not a poll (L2).
    pub notify_wakeup: bool,
    /// One release wakes O(1) waiters, not all of them (L6).
    pub no_herd: bool,
    /// A session survives a dropped connection re-established within its
    /// TTL.
    pub survives_reconnect: bool,
    /// A server restart can lose held locks before their holders hear of it
    /// (a store without persistence): a holder learns at its next renewal,
    /// but another client may be granted first; fencing still refuses the
    /// old holder.
    pub restart_loses_locks: bool,
    /// The URL's hosts are seeds of a store that shards names over its
    /// masters (Redis Cluster): each name lives on one master, so a client
    /// cut off from that master cannot lock the name, whatever the other
    /// hosts say. `false` for a quorum (Redlock, etcd, ZooKeeper), where a
    /// client cut off from a minority of the hosts still decides.
    pub sharded: bool,
    /// A take the client cut off in flight (its request timeout, a dropped
    /// acquire) that reaches the store only after its attempt ended (the
    /// hold released, the claim abandoned) grants nothing, also after other
    /// attempts took and released the lock in between (S5). Without it such
    /// a take holds the lock for up to one TTL after its release, on no
    /// one's behalf (per-hold expiry; fencing still orders every later
    /// grant after it).
    pub refuses_late_takes: bool,
    /// Bound on release → a waiting client's grant, from the store's
    /// notification or poll period (generous: it catches a fixed slow poll).
    pub wakeup_bound: Duration,
    /// Time after the TTL within which a crashed holder's lock can be taken
    /// (L1): how late the store may judge expiry.
    pub recovery_bound: Duration,
}

impl Default for Capabilities {
    /// The weakest promises: unfair, polled, nothing survives a restart (not
    /// even held locks), so an adapter claims each strength explicitly.
    fn default() -> Self {
        Self {
            fair: false,
            durable_tokens: false,
            notify_wakeup: false,
            no_herd: false,
            survives_reconnect: false,
            restart_loses_locks: true,
            sharded: false,
            refuses_late_takes: false,
            wakeup_bound: Duration::from_millis(250),
            recovery_bound: Duration::from_secs(1),
        }
    }
}

impl Capabilities {
    /// What a FIFO queue of keys in a replicated store that persists every
    /// write before acknowledging it promises, when each waiter watches only
    /// the key ahead of it and a session outlives its connection (etcd,
    /// ZooKeeper): held locks and tokens survive restarts, waiters are
    /// granted in order, one release wakes one waiter within 150 ms, and a
    /// take delivered after its attempt ended creates nothing.
    /// `recovery_bound` is how late the store judges a session's expiry.
    pub fn watched_queue(recovery_bound: Duration) -> Self {
        Self {
            fair: true,
            durable_tokens: true,
            notify_wakeup: true,
            no_herd: true,
            survives_reconnect: true,
            restart_loses_locks: false,
            sharded: false,
            refuses_late_takes: true,
            wakeup_bound: Duration::from_millis(150),
            recovery_bound,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What etcd and ZooKeeper backends promise (their harnesses take it
    /// from there): a change here is a change of both.
    #[test]
    fn a_watched_queue_promises_every_strength() {
        let c = Capabilities::watched_queue(Duration::from_millis(1500));
        assert!(c.fair && c.durable_tokens && c.notify_wakeup && c.no_herd);
        assert!(c.survives_reconnect && !c.restart_loses_locks);
        assert!(c.refuses_late_takes);
        assert_eq!(c.wakeup_bound, Duration::from_millis(150));
        assert_eq!(c.recovery_bound, Duration::from_millis(1500));
    }
}
