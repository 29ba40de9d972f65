//! A TCP proxy between a client and one server endpoint that does what a
//! network can: delay, hold (partition), reset, refuse, and lose replies
//! after the request took effect.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep_until};

use super::{Fault, FaultSwitch, Flow, LinkState};

/// One proxied endpoint: clients connect to [`Proxy::addr`], the proxy
/// connects to the upstream server and forwards under the current [`Fault`].
///
/// Dropping the proxy closes its listener and resets its connections.
///
/// ```no_run
/// # async fn demo() -> std::io::Result<()> {
/// use dlock_conformance::wire::{Fault, Proxy};
/// let proxy = Proxy::start("127.0.0.1:6379").await?;
/// println!("connect to {}", proxy.addr());
/// proxy.set(Fault::LOSE_REPLIES); // requests reach Redis, answers do not
/// proxy.set(Fault::Pass);          // and the connections that lost bytes are reset
/// # Ok(()) }
/// ```
pub struct Proxy {
    addr: SocketAddr,
    upstream: String,
    state: FaultSwitch,
    accepted: Arc<AtomicU64>,
    tasks: JoinSet<()>,
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy")
            .field("addr", &self.addr)
            .field("upstream", &self.upstream)
            .field("fault", &self.fault())
            .finish()
    }
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream`
    /// (`host:port`, resolved at each new connection).
    pub async fn start(upstream: &str) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = FaultSwitch::new();
        let accepted = Arc::new(AtomicU64::new(0));
        let mut tasks = JoinSet::new();
        tasks.spawn(accept_loop(
            listener,
            upstream.to_owned(),
            state.clone(),
            accepted.clone(),
        ));
        Ok(Self {
            addr,
            upstream: upstream.to_owned(),
            state,
            accepted,
            tasks,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server behind the proxy.
    pub fn upstream(&self) -> &str {
        &self.upstream
    }

    /// Sets the fault; connections see it at once.
    pub fn set(&self, fault: Fault) {
        self.state.set(fault);
    }

    /// The fault in effect.
    pub fn fault(&self) -> Fault {
        self.state.state().fault
    }

    /// Connections accepted so far (a client that reconnects shows here).
    pub fn connections(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.set(Fault::Cut);
        self.tasks.abort_all();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: String,
    state: FaultSwitch,
    accepted: Arc<AtomicU64>,
) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            incoming = listener.accept() => {
                let Ok((client, _)) = incoming else { continue };
                accepted.fetch_add(1, Ordering::Relaxed);
                let _ = client.set_nodelay(true);
                let rx = state.subscribe();
                let upstream = upstream.clone();
                conns.spawn(async move {
                    let epoch = rx.borrow().epoch;
                    serve(client, &upstream, rx, epoch).await;
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// Why a connection ends.
enum End {
    /// One side closed or failed: close the other side normally.
    Closed,
    /// The fault demands a reset (cut, a stall that ended, a stream that lost
    /// bytes).
    Reset,
}

async fn serve(client: TcpStream, upstream: &str, mut rx: watch::Receiver<LinkState>, epoch: u64) {
    let refused = rx.borrow().fault == Fault::Cut;
    if refused {
        let _ = client.set_zero_linger();
        return;
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        let _ = client.set_zero_linger();
        return;
    };
    let _ = server.set_nodelay(true);
    // Second handles on both sockets, to turn the final close into a reset.
    let sockets = [
        socket2::SockRef::from(&client).try_clone(),
        socket2::SockRef::from(&server).try_clone(),
    ];
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let mut pumps = JoinSet::new();
    pumps.spawn(pump(
        client_read,
        server_write,
        rx.clone(),
        epoch,
        Direction::ToServer,
    ));
    pumps.spawn(pump(
        server_read,
        client_write,
        rx.clone(),
        epoch,
        Direction::ToClient,
    ));
    let _ = rx.borrow_and_update();
    // Until both directions closed (a half-close lets the other carry on),
    // or one of them, or a cut, demands a reset.
    let reset = loop {
        tokio::select! {
            done = pumps.join_next() => match done {
                None => break false,
                Some(Ok(End::Reset)) => break true,
                Some(_) => {}
            },
            _ = cut(&mut rx) => break true,
        }
    };
    if reset {
        for socket in sockets.iter().flatten() {
            let _ = socket.set_linger(Some(Duration::ZERO));
        }
    }
    pumps.abort_all();
    while pumps.join_next().await.is_some() {}
}

/// Resolves when the fault turns to [`Fault::Cut`].
async fn cut(rx: &mut watch::Receiver<LinkState>) {
    loop {
        if rx.changed().await.is_err() || rx.borrow().fault == Fault::Cut {
            return;
        }
    }
}

#[derive(Clone, Copy)]
enum Direction {
    ToServer,
    ToClient,
}

/// One direction of one connection, and what it has seen of the faults.
struct Way {
    rx: watch::Receiver<LinkState>,
    /// The epoch the connection opened in.
    epoch: u64,
    dir: Direction,
    /// Held by [`Fault::StallExisting`]: reset when the stall ends.
    stalled: bool,
    /// Discarded bytes: the stream is out of step, reset when that ends.
    lost_bytes: bool,
}

impl Way {
    /// The flow now; `None` when the connection must be reset.
    fn flow(&mut self) -> Option<Flow> {
        let state = *self.rx.borrow_and_update();
        let flows = state.fault.flows(self.epoch, state.epoch)?;
        let flow = match self.dir {
            Direction::ToServer => flows.0,
            Direction::ToClient => flows.1,
        };
        let stall = state.fault == Fault::StallExisting && flow == Flow::Hold;
        if (self.stalled && !stall) || (self.lost_bytes && flow != Flow::Drop) {
            return None;
        }
        self.stalled |= stall;
        Some(flow)
    }

    /// Waits for the next change of fault; `false` if the proxy is gone.
    async fn changed(&mut self) -> bool {
        self.rx.changed().await.is_ok()
    }

    /// When a chunk that arrives now is to be delivered; `None` to drop it,
    /// `Err` to reset. Holds while the flow is [`Flow::Hold`].
    async fn arrival(&mut self) -> Result<Option<Instant>, End> {
        loop {
            match self.flow() {
                None => return Err(End::Reset),
                Some(Flow::Pass) => return Ok(Some(Instant::now())),
                Some(Flow::Delay(d)) => return Ok(Some(Instant::now() + d)),
                Some(Flow::Drop) => return Ok(None),
                Some(Flow::Hold) => {
                    if !self.changed().await {
                        return Err(End::Reset);
                    }
                }
            }
        }
    }
}

/// Forwards one direction: a reader that applies the flow to each chunk as
/// it arrives, and a writer that sends chunks when they are due.
async fn pump(
    mut from: OwnedReadHalf,
    to: OwnedWriteHalf,
    rx: watch::Receiver<LinkState>,
    epoch: u64,
    dir: Direction,
) -> End {
    let mut way = Way {
        rx,
        epoch,
        dir,
        stalled: false,
        lost_bytes: false,
    };
    let (queue, due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = Way {
        rx: way.rx.clone(),
        ..way
    };
    let mut writer = AbortOnDrop(tokio::spawn(write_when_due(to, due, writer)));
    let mut buf = vec![0u8; 16 * 1024];
    let end = loop {
        // Under a hold, read nothing: the sender's bytes wait in its socket.
        match way.flow() {
            None => break End::Reset,
            Some(Flow::Hold) => {
                if !way.changed().await {
                    break End::Reset;
                }
                continue;
            }
            Some(_) => {}
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => break End::Closed,
                Ok(n) => n,
            },
            alive = way.changed() => {
                if !alive {
                    break End::Reset;
                }
                continue;
            }
        };
        match way.arrival().await {
            Err(end) => break end,
            Ok(Some(at)) => {
                if queue.send((at, buf[..n].to_vec())).is_err() {
                    break End::Closed;
                }
            }
            Ok(None) => way.lost_bytes = true,
        }
    };
    drop(queue);
    if matches!(end, End::Closed) {
        // Let the writer deliver what is due, then pass the close on.
        let _ = (&mut writer.0).await;
    }
    end
}

async fn write_when_due(
    mut to: OwnedWriteHalf,
    mut due: mpsc::UnboundedReceiver<(Instant, Vec<u8>)>,
    mut way: Way,
) {
    while let Some((at, bytes)) = due.recv().await {
        // No timer for bytes that are due: tokio's ticks in milliseconds.
        if at > Instant::now() {
            sleep_until(at).await;
        }
        // Bytes already in flight are held by a partition that starts now.
        loop {
            match way.flow() {
                None => return,
                Some(Flow::Hold) => {
                    if !way.changed().await {
                        return;
                    }
                }
                Some(_) => break,
            }
        }
        if to.write_all(&bytes).await.is_err() {
            return;
        }
    }
    let _ = to.shutdown().await;
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
