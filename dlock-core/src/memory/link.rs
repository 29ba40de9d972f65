//! Faults on the path between a client and its store: the vocabulary shared
//! by the memory backend's [`Link`] and the conformance suite's TCP proxy.
//!
//! A memory client reaches its in-process server through a [`Link`]; every
//! primitive is a request that crosses it, is applied by the server, and a
//! reply that crosses back. Setting a [`Fault`] on the link does to those
//! calls what a network does to a TCP connection: delays, partitions, resets,
//! and replies lost after the request took effect.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{Instant, sleep_until};

use crate::Error;

/// What happens to bytes (or a request, or a reply) going one way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Forwarded at once.
    Pass,
    /// Forwarded after this long.
    Delay(Duration),
    /// Held back until the fault changes, then forwarded under the new fault
    /// (a partition: TCP retransmits once it heals).
    Hold,
    /// Discarded. A connection that lost bytes is reset when the fault
    /// changes, since its stream is out of step.
    Drop,
}

/// The state of one link (one client's connection(s) to one node).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Everything passes.
    Pass,
    /// Each direction on its own.
    Flows {
        /// Client to server: requests.
        to_server: Flow,
        /// Server to client: replies and notifications.
        to_client: Flow,
    },
    /// Connections open now go silently dead (nothing passes either way, and
    /// they are reset when the fault changes); new connections work.
    StallExisting,
    /// Connections open now stall with nothing lost (their packets wait on a
    /// path that stopped carrying them, while new connections route around
    /// it); when the fault changes they carry on under the new one, so what
    /// they sent arrives then, late: after the client gave up on it and
    /// retried elsewhere.
    HoldExisting,
    /// Every connection is reset and new ones are refused.
    Cut,
}

impl Fault {
    /// Nothing passes either way; connections stay open (a partition).
    pub const BLACKHOLE: Fault = Fault::Flows {
        to_server: Flow::Hold,
        to_client: Flow::Hold,
    };

    /// Requests reach the server, no byte of any answer reaches the client.
    pub const LOSE_REPLIES: Fault = Fault::Flows {
        to_server: Flow::Pass,
        to_client: Flow::Drop,
    };

    /// Requests and replies each delayed.
    pub const fn delay(to_server: Duration, to_client: Duration) -> Fault {
        Fault::Flows {
            to_server: Flow::Delay(to_server),
            to_client: Flow::Delay(to_client),
        }
    }

    /// The flows a connection opened in `epoch` sees while this fault, set in
    /// `set_in`, is in effect; `None` when it must be reset or refused.
    pub fn flows(self, conn_epoch: u64, set_in: u64) -> Option<(Flow, Flow)> {
        match self {
            Fault::Pass => Some((Flow::Pass, Flow::Pass)),
            Fault::Flows {
                to_server,
                to_client,
            } => Some((to_server, to_client)),
            Fault::StallExisting if conn_epoch < set_in => Some((Flow::Hold, Flow::Hold)),
            Fault::HoldExisting if conn_epoch < set_in => Some((Flow::Hold, Flow::Hold)),
            Fault::StallExisting | Fault::HoldExisting => Some((Flow::Pass, Flow::Pass)),
            Fault::Cut => None,
        }
    }
}

/// A fault and the epoch it was set in: connections (or calls) that started
/// before that epoch are "existing" for [`Fault::StallExisting`] and
/// [`Fault::HoldExisting`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkState {
    /// The fault in effect.
    pub fault: Fault,
    /// Incremented by every change.
    pub epoch: u64,
}

/// The switch that sets a link's [`Fault`]: every change bumps the epoch,
/// and the connections (or calls) that subscribed see it at once. Shared by
/// the memory [`Link`] and the conformance suite's TCP proxy.
#[derive(Debug, Clone)]
pub struct FaultSwitch(Arc<watch::Sender<LinkState>>);

impl Default for FaultSwitch {
    fn default() -> Self {
        Self::new()
    }
}

impl FaultSwitch {
    /// A switch at [`Fault::Pass`], epoch 0.
    pub fn new() -> Self {
        Self(Arc::new(watch::Sender::new(LinkState {
            fault: Fault::Pass,
            epoch: 0,
        })))
    }

    /// Sets the fault, in a new epoch.
    pub fn set(&self, fault: Fault) {
        self.0.send_modify(|s| {
            s.fault = fault;
            s.epoch += 1;
        });
    }

    /// The fault and epoch in effect.
    pub fn state(&self) -> LinkState {
        *self.0.borrow()
    }

    /// A receiver that sees every change from now on.
    pub fn subscribe(&self) -> watch::Receiver<LinkState> {
        self.0.subscribe()
    }
}

/// One memory client's link to its server (see the [module docs](crate::memory)).
///
/// ```
/// # async fn demo() -> Result<(), dlock_core::Error> {
/// use dlock_core::{Backend, SessionOptions};
/// use dlock_core::memory::{Fault, MemoryBackend};
/// let server = MemoryBackend::new();
/// let (client, link) = server.linked();
/// let session = client.session(SessionOptions::new()).await?;
/// link.set(Fault::Cut);
/// assert!(session.lock("x")?.try_acquire().await.is_err());
/// link.set(Fault::Pass);
/// assert!(session.lock("x")?.try_acquire().await?.is_some());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Link {
    state: FaultSwitch,
    calls: Arc<AtomicU64>,
    /// The epoch the client's current connection opened in. A call that is
    /// cut off or fails makes the client open a new one (as drivers do), so
    /// a [`Fault::StallExisting`] hangs calls until they time out once.
    opened: Arc<AtomicU64>,
}

impl Default for Link {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Link")
            .field("fault", &self.fault())
            .finish()
    }
}

fn reset() -> Error {
    Error::unavailable(super::server::BACKEND, "connection reset (link fault)")
}

impl Link {
    /// A healthy link.
    pub fn new() -> Self {
        Self {
            state: FaultSwitch::new(),
            calls: Arc::default(),
            opened: Arc::default(),
        }
    }

    /// Sets the fault; calls in flight see it at their next step.
    pub fn set(&self, fault: Fault) {
        self.state.set(fault);
    }

    /// The fault in effect.
    pub fn fault(&self) -> Fault {
        self.state.state().fault
    }

    /// Calls that crossed the link to the server (requests applied).
    pub fn delivered(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Runs `apply` on the server as a request crossing this link (once
    /// `admitted` lets it in: a paused or stopped server), and brings its
    /// reply back across it. The request travels on its own, as bytes on a
    /// wire do: if the caller gives up, a delayed or held request still
    /// arrives (and takes effect) later.
    pub(crate) async fn call<T: Send + 'static>(
        &self,
        admitted: impl Future<Output = Result<(), Error>> + Send + 'static,
        apply: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Error> {
        let mut rx = self.state.subscribe();
        let conn = self.opened.load(Ordering::Acquire);
        let mut reconnect = Reconnect {
            link: self,
            armed: true,
        };
        let (sent, arrived) = tokio::sync::oneshot::channel();
        let link = self.clone();
        tokio::spawn(async move {
            let mut rx = link.state.subscribe();
            let result = async {
                cross(&mut rx, conn, |flows| flows.0).await?;
                admitted.await?;
                let out = apply();
                link.calls.fetch_add(1, Ordering::Relaxed);
                Ok(out)
            }
            .await;
            let _ = sent.send(result);
        });
        let out = arrived.await.map_err(|_| reset())??;
        cross(&mut rx, conn, |flows| flows.1).await?;
        reconnect.armed = false;
        Ok(out)
    }

    /// Waits until a notification sent now has crossed the link: `Ok(true)`
    /// if it got through (after any delay), `Ok(false)` if it was lost, `Err`
    /// if the connection was reset.
    pub(crate) async fn notification(&self) -> Result<bool, Error> {
        let mut rx = self.state.subscribe();
        // Notifications travel on the client's current connection.
        let conn = self.opened.load(Ordering::Acquire);
        match crossing(&mut rx, conn, |flows| flows.1).await? {
            Crossing::At(at) => {
                arrive(at).await;
                Ok(true)
            }
            Crossing::Lost => Ok(false),
        }
    }
}

/// Opens a new connection for the next call unless the call completed.
struct Reconnect<'a> {
    link: &'a Link,
    armed: bool,
}

impl Drop for Reconnect<'_> {
    fn drop(&mut self) {
        if self.armed {
            let now = self.link.state.state().epoch;
            self.link.opened.store(now, Ordering::Release);
        }
    }
}

/// Waits until `at`; at once (no timer, which ticks in milliseconds) when
/// nothing delays the message.
async fn arrive(at: Instant) {
    if at > Instant::now() {
        sleep_until(at).await;
    }
}

enum Crossing {
    /// Arrives at this time.
    At(Instant),
    /// Discarded.
    Lost,
}

/// Carries one message across; a lost one leaves its caller hanging until
/// the fault changes, then fails as a reset connection would.
async fn cross(
    rx: &mut watch::Receiver<LinkState>,
    started: u64,
    direction: impl Fn((Flow, Flow)) -> Flow,
) -> Result<(), Error> {
    match crossing(rx, started, direction).await? {
        Crossing::At(at) => {
            arrive(at).await;
            Ok(())
        }
        Crossing::Lost => {
            let _ = rx.changed().await;
            Err(reset())
        }
    }
}

/// Waits until one direction lets a message through (held messages wait for
/// the fault to change) and says when it arrives.
async fn crossing(
    rx: &mut watch::Receiver<LinkState>,
    started: u64,
    direction: impl Fn((Flow, Flow)) -> Flow,
) -> Result<Crossing, Error> {
    loop {
        let state = *rx.borrow_and_update();
        let Some(flows) = state.fault.flows(started, state.epoch) else {
            return Err(reset());
        };
        match direction(flows) {
            Flow::Pass => return Ok(Crossing::At(Instant::now())),
            Flow::Delay(d) => return Ok(Crossing::At(Instant::now() + d)),
            Flow::Drop => return Ok(Crossing::Lost),
            Flow::Hold => {
                // A stalled connection is reset when the stall ends.
                let stalled = state.fault == Fault::StallExisting;
                if rx.changed().await.is_err() || stalled {
                    return Err(reset());
                }
            }
        }
    }
}
