//! Faults on the wire: what the cases do to one client's connections.
//!
//! A case asks the harness for a client behind a [`Link`]: one link per
//! client, with one controllable path per store node (a TCP [`Proxy`] in
//! front of each endpoint for real servers; the memory backend's own
//! [`Link`](dlock_core::memory::Link) in process). Setting a [`Fault`] on a
//! node's path does to that client what a network would: delay, partition,
//! reset, or lose the replies of requests that took effect. Other clients are
//! unaffected, so one case can partition A from a node while B reaches it.

mod proxy;

use std::any::Any;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use dlock_core::Error;
pub use dlock_core::memory::{Fault, FaultSwitch, Flow, LinkState};
pub use proxy::Proxy;

/// `H1:P1>X1:Q1,H2:P2>X2:Q2,...`: each server endpoint and the proxy in front
/// of it, in order. The value of an option that tells a driver which
/// discovers the servers (Redis Cluster's `address_map`) where to reach each
/// of them through its proxy.
///
/// ```
/// let via = ["127.0.0.1:9001".parse().unwrap()];
/// assert_eq!(
///     dlock_conformance::wire::proxy_map(&["127.0.0.1:7000"], &via),
///     "127.0.0.1:7000>127.0.0.1:9001"
/// );
/// ```
pub fn proxy_map(endpoints: &[impl fmt::Display], via: &[SocketAddr]) -> String {
    endpoints
        .iter()
        .zip(via)
        .map(|(server, proxy)| format!("{server}>{proxy}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// One client's controllable paths to the store's nodes.
pub trait Link: Send + Sync + fmt::Debug {
    /// How many nodes (paths) the link has.
    fn nodes(&self) -> usize;

    /// Sets the fault on the path to node `node` (in the harness's endpoint
    /// order).
    fn set(&self, node: usize, fault: Fault);

    /// Sets the same fault on every path.
    fn set_all(&self, fault: Fault) {
        for node in 0..self.nodes() {
            self.set(node, fault);
        }
    }

    /// Everything passes again.
    fn heal(&self) {
        self.set_all(Fault::Pass);
    }

    /// The addresses a client must connect to instead of the real endpoints
    /// (one per node), if the link is made of proxies.
    fn addrs(&self) -> Option<Vec<SocketAddr>> {
        None
    }

    /// For harnesses with links of their own kind (downcast to reach them).
    fn as_any(&self) -> &dyn Any;
}

/// A [`Link`] made of one TCP [`Proxy`] per endpoint: the default link of
/// every harness that lists its endpoints.
#[derive(Debug)]
pub struct ProxyLink {
    proxies: Vec<Proxy>,
}

impl ProxyLink {
    /// One proxy in front of each endpoint (`host:port`).
    pub async fn start(endpoints: &[String]) -> io::Result<Self> {
        let mut proxies = Vec::with_capacity(endpoints.len());
        for endpoint in endpoints {
            proxies.push(Proxy::start(endpoint).await?);
        }
        Ok(Self { proxies })
    }

    /// The proxies, in endpoint order.
    pub fn proxies(&self) -> &[Proxy] {
        &self.proxies
    }
}

impl Link for ProxyLink {
    fn nodes(&self) -> usize {
        self.proxies.len()
    }

    fn set(&self, node: usize, fault: Fault) {
        self.proxies[node].set(fault);
    }

    fn addrs(&self) -> Option<Vec<SocketAddr>> {
        Some(self.proxies.iter().map(Proxy::addr).collect())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A new [`ProxyLink`] in front of `endpoints`; `None` if there are none.
pub(crate) async fn proxy_link(endpoints: &[String]) -> Option<Result<Arc<dyn Link>, Error>> {
    if endpoints.is_empty() {
        return None;
    }
    Some(
        ProxyLink::start(endpoints)
            .await
            .map(|l| Arc::new(l) as Arc<dyn Link>)
            .map_err(|e| Error::unavailable("proxy", e)),
    )
}

/// The memory backend's in-process link as a [`Link`] with one node.
#[derive(Debug, Clone)]
pub struct MemoryLink(pub dlock_core::memory::Link);

impl Link for MemoryLink {
    fn nodes(&self) -> usize {
        1
    }

    fn set(&self, node: usize, fault: Fault) {
        assert_eq!(node, 0, "the memory backend has one node");
        self.0.set(fault);
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
