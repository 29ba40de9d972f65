//! The fault profiles of `dlock torture` and the nemesis that plays them.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use dlock_conformance::wire::Fault;
use rand::Rng;
use tokio::time::{Instant, sleep};

use super::{Client, Deployment, Shared};

/// One fault profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Profile {
    /// No faults: the baseline.
    None,
    /// Requests and replies of one client delayed by up to TTL/4.
    Delays,
    /// One client's replies lost (the requests take effect).
    LostReplies,
    /// One client cut off (nothing passes, connections stay open) for up to
    /// twice the TTL.
    Partitions,
    /// One client's connections reset and refused for a moment.
    Resets,
    /// One client's connections go silently dead; new ones work.
    DeadConnections,
    /// One client's open connections stall with their bytes kept, then
    /// deliver them: requests it gave up on and retried elsewhere reach the
    /// store late, after the attempt ended (S5).
    LateRequests,
    /// A random minority of the store's nodes cut off from one client.
    MinorityPartitions,
    /// One client process stopped (SIGSTOP-like) past the TTL.
    ClientPauses,
    /// One store node stopped (SIGSTOP) for about the TTL.
    ServerPauses,
    /// One store node killed (SIGKILL) and started again with its data.
    ServerRestarts,
    /// The store's clock jumps forward past the TTL (memory backend only).
    ClockJumps,
}

const ALL: [Profile; 12] = [
    Profile::None,
    Profile::Delays,
    Profile::LostReplies,
    Profile::Partitions,
    Profile::Resets,
    Profile::DeadConnections,
    Profile::LateRequests,
    Profile::MinorityPartitions,
    Profile::ClientPauses,
    Profile::ServerPauses,
    Profile::ServerRestarts,
    Profile::ClockJumps,
];

impl Profile {
    /// The profile's name on the command line and in the table.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Profile::None => "none",
            Profile::Delays => "delays",
            Profile::LostReplies => "lost-replies",
            Profile::Partitions => "partitions",
            Profile::Resets => "resets",
            Profile::DeadConnections => "dead-connections",
            Profile::LateRequests => "late-requests",
            Profile::MinorityPartitions => "minority-partitions",
            Profile::ClientPauses => "client-pauses",
            Profile::ServerPauses => "server-pauses",
            Profile::ServerRestarts => "server-restarts",
            Profile::ClockJumps => "clock-jumps",
        }
    }

    /// `all`, or names separated by commas.
    pub(crate) fn parse_list(list: &str) -> Result<Vec<Profile>, String> {
        if list == "all" {
            return Ok(ALL.to_vec());
        }
        list.split(',')
            .map(|name| {
                ALL.iter()
                    .copied()
                    .find(|p| p.name() == name.trim())
                    .ok_or_else(|| {
                        let known: Vec<_> = ALL.iter().map(|p| p.name()).collect();
                        format!(
                            "unknown fault profile {name:?} (known: all, {})",
                            known.join(", ")
                        )
                    })
            })
            .collect()
    }

    /// Whether the profile can run on `deployment`, or why not.
    pub(crate) fn applies(self, deployment: &Deployment) -> Result<(), &'static str> {
        let needs_links = !matches!(
            self,
            Profile::None
                | Profile::ClientPauses
                | Profile::ServerPauses
                | Profile::ServerRestarts
                | Profile::ClockJumps
        );
        if needs_links && !deployment.has_links() {
            return Err("no network between client and store (an embedded database)");
        }
        match self {
            Profile::MinorityPartitions if deployment.endpoints.len() < 3 => {
                Err("fewer than three nodes: no minority to cut off")
            }
            Profile::MinorityPartitions if deployment.is_sharded() => {
                Err("names are sharded over the nodes (Redis Cluster): no quorum of them decides")
            }
            Profile::ServerPauses | Profile::ServerRestarts if deployment.servers().is_none() => {
                Err("no --servers given for this URL")
            }
            Profile::ClockJumps if !deployment.is_memory() => {
                Err("the store's clock cannot be stepped from here (memory:// only)")
            }
            _ => Ok(()),
        }
    }

    /// Overlapping holds this profile causes by design (clock faults are
    /// outside S4; a store without persistence forgets locks on a restart),
    /// with the reason; fencing must still refuse the stale holder.
    pub(crate) fn overlaps_by_design(self, url: &str) -> Option<&'static str> {
        // (a Redis Cluster without the restart guard: a failover can lose
        // a lock, its replication being asynchronous; with the guard, a
        // restarted or promoted Redis grants nothing for max_ttl)
        let forgets = [
            "redis",
            "rediss",
            "redis+cluster",
            "rediss+cluster",
            "memory",
        ]
        .iter()
        .any(|s| url.starts_with(&format!("{s}://")))
            && !url.contains("restart_guard=true");
        match self {
            Profile::ClockJumps => Some("a store clock that jumps ends leases early (outside S4)"),
            Profile::ServerRestarts if forgets => {
                Some("a restart without persistence forgets held locks")
            }
            // JetStream acknowledges writes its file store has not written
            // yet: a killed nats-server comes back without them.
            Profile::ServerRestarts if url.starts_with("nats://") => {
                Some("a killed nats-server loses its last acknowledged writes")
            }
            _ => None,
        }
    }
}

/// Plays one profile against the clients and servers of one run.
pub(crate) struct Nemesis<'a> {
    profile: Profile,
    deployment: &'a Deployment,
    clients: &'a [Client],
    shared: Arc<Shared>,
    ttl: Duration,
}

impl<'a> Nemesis<'a> {
    pub(crate) fn new(
        profile: Profile,
        deployment: &'a Deployment,
        clients: &'a [Client],
        shared: Arc<Shared>,
        ttl: Duration,
    ) -> Self {
        Self {
            profile,
            deployment,
            clients,
            shared,
            ttl,
        }
    }

    /// Faults until the clients have their acquisitions and at least
    /// `min_faults` faults were injected (or `max_time` passed); returns how
    /// many faults it injected.
    pub(crate) async fn run(&self, max_time: Duration, min_faults: u64) -> u64 {
        let until = Instant::now() + max_time;
        let min_faults = if self.profile == Profile::None {
            0
        } else {
            min_faults
        };
        let mut faults = 0;
        loop {
            let enough = self.done() && faults >= min_faults;
            if enough || Instant::now() >= until {
                return faults;
            }
            self.quiet(self.ttl / 2, self.ttl).await;
            if Instant::now() >= until || (self.done() && faults >= min_faults) {
                return faults;
            }
            if self.profile != Profile::None && self.one_fault().await {
                faults += 1;
            }
        }
    }

    /// Whether the clients have their acquisitions.
    fn done(&self) -> bool {
        self.shared.acquisitions.load(Ordering::Relaxed) >= self.shared.target
    }

    /// Sleeps a random time in `from ..= to`.
    async fn quiet(&self, from: Duration, to: Duration) {
        sleep(between(from, to)).await;
    }

    /// The current holder half of the time, else a random client.
    fn victim(&self) -> &Client {
        let n = self.clients.len();
        let holder = self.shared.holder.load(Ordering::Relaxed) as usize;
        let i = if holder < n && rand::rng().random_bool(0.5) {
            holder
        } else {
            rand::rng().random_range(0..n)
        };
        &self.clients[i]
    }

    /// Plays one fault; whether it was injected (a server command that
    /// failed injected none, so a profile whose commands all fail reports
    /// no faults instead of passing as if it had run).
    async fn one_fault(&self) -> bool {
        let t = self.ttl;
        match self.profile {
            Profile::None => return false,
            Profile::Delays => {
                let client = self.victim();
                let fault = Fault::delay(
                    between(Duration::ZERO, t / 4),
                    between(Duration::ZERO, t / 4),
                );
                client.link.set_all(fault);
                self.quiet(t / 2, t).await;
                client.link.heal();
            }
            Profile::LostReplies => self.link_fault(Fault::LOSE_REPLIES, t / 5, t).await,
            Profile::Partitions => self.link_fault(Fault::BLACKHOLE, t / 2, t * 2).await,
            Profile::Resets => {
                self.link_fault(Fault::Cut, Duration::from_millis(10), t / 3)
                    .await
            }
            Profile::DeadConnections => self.link_fault(Fault::StallExisting, t, t * 2).await,
            Profile::LateRequests => self.link_fault(Fault::HoldExisting, t / 2, t * 2).await,
            Profile::MinorityPartitions => {
                let client = self.victim();
                let nodes = client.link.nodes();
                let minority = (nodes - 1) / 2;
                let first = rand::rng().random_range(0..nodes);
                for k in 0..minority {
                    client.link.set((first + k) % nodes, Fault::BLACKHOLE);
                }
                self.quiet(t / 2, t * 2).await;
                client.link.heal();
            }
            Profile::ClientPauses => {
                let client = self.victim();
                client.process.pause();
                sleep(between(t, t * 2)).await;
                client.process.resume();
            }
            Profile::ServerPauses => {
                if let Some(servers) = self.deployment.servers() {
                    let node = rand::rng().random_range(0..servers.nodes());
                    let paused = self.note(servers.pause(node).await);
                    sleep(between(t / 2, t * 3 / 2)).await;
                    // Resumed whatever the pause answered: one that failed part
                    // of the way may still have stopped some of the node's
                    // processes, and a stopped server outlives this run.
                    self.note(servers.resume(node).await);
                    return paused;
                }
            }
            Profile::ServerRestarts => {
                if let Some(servers) = self.deployment.servers() {
                    let node = rand::rng().random_range(0..servers.nodes());
                    let killed = self.note(servers.kill(node).await);
                    if servers.nodes() > 1 {
                        self.note(servers.start(node).await);
                    } else {
                        self.note(servers.start_all().await);
                    }
                    return killed;
                }
            }
            Profile::ClockJumps => {
                if let Some(servers) = self.deployment.servers() {
                    return matches!(servers.step_clock(0, t * 2).await, Some(Ok(())));
                }
            }
        }
        true
    }

    /// Keeps the first failure of a server command for the report; whether
    /// the command succeeded.
    fn note(&self, result: Result<(), dlock_conformance::Failure>) -> bool {
        if let Err(e) = &result {
            let mut first = self.shared.first_server_error.lock().unwrap();
            first.get_or_insert(e.to_string());
        }
        result.is_ok()
    }

    /// Brings every server back after the profile: resumed, and started
    /// (tried three times, a second apart), so that a failed restart does not
    /// leave a server down for whatever runs next on this machine; the
    /// error if it stays down.
    pub(crate) async fn restore(&self) -> Result<(), String> {
        let Some(servers) = self.deployment.servers() else {
            return Ok(());
        };
        if !matches!(
            self.profile,
            Profile::ServerPauses | Profile::ServerRestarts
        ) {
            return Ok(());
        }
        for node in 0..servers.nodes() {
            // (fails for a node that is not running; the start below says why)
            let _ = servers.resume(node).await;
        }
        let mut last = String::new();
        for attempt in 0..3 {
            if attempt > 0 {
                sleep(Duration::from_secs(1)).await;
            }
            match servers.start_all().await {
                Ok(()) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
        }
        Err(last)
    }

    async fn link_fault(&self, fault: Fault, from: Duration, to: Duration) {
        let client = self.victim();
        client.link.set_all(fault);
        self.quiet(from, to).await;
        client.link.heal();
    }
}

/// A random duration in `from ..= to`.
pub(crate) fn between(from: Duration, to: Duration) -> Duration {
    if to <= from {
        return from;
    }
    let span = (to - from).as_secs_f64();
    from + Duration::from_secs_f64(rand::rng().random_range(0.0..=span))
}
