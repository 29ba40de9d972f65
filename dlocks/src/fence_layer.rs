//! A `tower` layer for services that write on behalf of a lock holder: it
//! reads the [`Dlock-Fence`](dlock_core::fence_header) header of each request
//! and lets through only requests that carry a token of the service's lock.
//!
//! Two modes:
//!
//! - [`FenceLayer::gate`]: the service is the only writer of the resource (one
//!   process). Each request takes a turn at a [`WriteGate`], which checks the
//!   token and keeps other writers out until the handler's response is
//!   ready, so that the check and the handler's write are one step: a former
//!   holder's request that passed the check cannot write after a newer
//!   holder's. Share one `WriteGate` (an `Arc`) between every route that
//!   writes the resource. A handler that stalls holds the gate (a paused
//!   client's upload, read by the handler): buffer request bodies before
//!   this layer, and bound the wait with [`WriteGate::wait_at_most`] (a
//!   request that waited longer gets 503).
//! - [`FenceLayer::token`]: the resource lives in a shared store (several
//!   replicas of the service write to it). The layer only refuses a missing,
//!   malformed or foreign header and hands the [`FencingToken`] to the handler
//!   in the request's extensions; the handler passes it to the store's fenced
//!   writer (`SqlFence`, `RedisFence`, ...), which checks it atomically with
//!   the write. A replica's memory would be a gate of its own, and prove
//!   nothing.
//!
//! The layer runs on a Tokio runtime (gate mode spawns each handler in a
//! task; `wait_at_most` needs its timers).
//!
//! A refused request gets the status [`FenceRefused::http_status`] says (428,
//! 400, 409 or 503) and the reason as its body; the handler never sees it.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::sync::Arc;
//! use dlocks::fence_layer::FenceLayer;
//! use dlocks::{FencingToken, LockName, WriteGate};
//! use tower::{Layer, ServiceExt, service_fn};
//!
//! let lock = LockName::new("reports/nightly").unwrap();
//! let gate = Arc::new(WriteGate::new());
//! let service = FenceLayer::gate(lock, gate).layer(service_fn(
//!     |req: http::Request<String>| async move {
//!         let token = req.extensions().get::<FencingToken>().copied();
//!         // ... write, knowing no newer holder has written ...
//!         Ok::<_, std::convert::Infallible>(http::Response::new(format!("{token:?}")))
//!     },
//! ));
//! let request = |token: u64| {
//!     http::Request::builder()
//!         .header("dlock-fence", format!("{token}; lock=reports/nightly"))
//!         .body(String::new())
//!         .unwrap()
//! };
//! assert_eq!(service.clone().oneshot(request(4)).await.unwrap().status(), 200);
//! assert_eq!(service.oneshot(request(3)).await.unwrap().status(), 409);
//! # }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use dlock_core::fence_header::{FENCE_HEADER, FenceHeader, FenceRefused};
use dlock_core::{FencingToken, LockName, WriteGate};
use http::{Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

/// Checks the `Dlock-Fence` header of every request; see the
/// [module](self) for the two modes.
#[derive(Debug, Clone)]
pub struct FenceLayer {
    fence: Arc<Fence>,
}

#[derive(Debug)]
struct Fence {
    lock: LockName,
    /// The gate whose turns make the check and the handler one step.
    gate: Option<Arc<WriteGate>>,
}

impl FenceLayer {
    /// For a service that is the resource's only writer: a turn at `gate`
    /// (shared by every route that writes the resource) for each request.
    pub fn gate(lock: LockName, gate: Arc<WriteGate>) -> Self {
        Self {
            fence: Arc::new(Fence {
                lock,
                gate: Some(gate),
            }),
        }
    }

    /// For a service whose handler passes the token to a fenced writer:
    /// only the header's form and lock are checked here.
    pub fn token(lock: LockName) -> Self {
        Self {
            fence: Arc::new(Fence { lock, gate: None }),
        }
    }
}

impl<S> Layer<S> for FenceLayer {
    type Service = FenceService<S>;

    fn layer(&self, inner: S) -> FenceService<S> {
        FenceService {
            inner,
            fence: self.fence.clone(),
        }
    }
}

/// The service [`FenceLayer`] wraps around a handler.
#[derive(Debug, Clone)]
pub struct FenceService<S> {
    inner: S,
    fence: Arc<Fence>,
}

/// The future of a [`FenceService`] call.
pub type FenceFuture<R, E> = Pin<Box<dyn Future<Output = Result<R, E>> + Send>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for FenceService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: From<String> + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = FenceFuture<Response<ResBody>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        // The clone that was polled ready serves this call (tower's rule).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let fence = self.fence.clone();
        Box::pin(async move {
            let mut values = req.headers().get_all(FENCE_HEADER).iter();
            let header = match (values.next(), values.next()) {
                (None, _) => None,
                (Some(_), Some(_)) => return Ok(refused(&malformed("sent more than once"))),
                (Some(value), None) => match value.to_str() {
                    Ok(value) => Some(value.to_owned()),
                    Err(_) => return Ok(refused(&malformed("not visible ASCII"))),
                },
            };
            let header = header.as_deref();
            let token = match FenceHeader::token_for(header, &fence.lock) {
                Ok(token) => token,
                Err(why) => return Ok(refused(&why)),
            };
            req.extensions_mut().insert::<FencingToken>(token);
            let Some(gate) = &fence.gate else {
                return inner.call(req).await;
            };
            let turn = match FenceHeader::enter(header, &fence.lock, gate).await {
                Ok(turn) => turn,
                Err(why) => return Ok(refused(&why)),
            };
            // The handler runs in a task that keeps the turn until it is
            // done: a request dropped mid-way (its client went away) must
            // not end the turn while the handler's write may still land.
            let handler = tokio::spawn(async move {
                let _turn = turn;
                inner.call(req).await
            });
            match handler.await {
                Ok(answer) => answer,
                Err(e) => match e.try_into_panic() {
                    Ok(panic) => std::panic::resume_unwind(panic),
                    // (the runtime is shutting down)
                    Err(_) => Ok(answer(StatusCode::SERVICE_UNAVAILABLE, "shutting down")),
                },
            }
        })
    }
}

/// A header that cannot be read at all.
fn malformed(why: &'static str) -> FenceRefused {
    FenceRefused::Malformed {
        value: String::new(),
        why,
    }
}

fn refused<B: From<String>>(why: &FenceRefused) -> Response<B> {
    let status = StatusCode::from_u16(why.http_status()).unwrap_or(StatusCode::CONFLICT);
    answer(status, &why.to_string())
}

/// A response of `status` with `text` as its body.
fn answer<B: From<String>>(status: StatusCode, text: &str) -> Response<B> {
    let mut response = Response::new(B::from(format!("{text}\n")));
    *response.status_mut() = status;
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;
    use std::sync::Mutex as StdMutex;
    use std::time::Duration;
    use tower::{ServiceExt, service_fn};

    fn request(header: Option<&[u8]>) -> Request<String> {
        let mut builder = Request::builder();
        if let Some(value) = header {
            builder = builder.header(FENCE_HEADER, value);
        }
        builder.body(String::new()).unwrap()
    }

    fn lock() -> LockName {
        LockName::new("reports/nightly").unwrap()
    }

    /// A handler that records the tokens it wrote, in order, after a pause
    /// the request names in its body (a slow write).
    fn recording(
        written: Arc<StdMutex<Vec<u64>>>,
    ) -> impl Service<
        Request<String>,
        Response = Response<String>,
        Error = Infallible,
        Future = impl Future + Send,
    > + Clone
    + Send
    + 'static {
        service_fn(move |req: Request<String>| {
            let written = written.clone();
            async move {
                let token = req.extensions().get::<FencingToken>().map(|t| t.get());
                let pause: u64 = req.body().parse().unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(pause)).await;
                written.lock().unwrap().extend(token);
                Ok::<_, Infallible>(Response::new(String::new()))
            }
        })
    }

    #[tokio::test]
    async fn refused_requests_never_reach_the_handler() {
        let written = Arc::new(StdMutex::new(Vec::new()));
        let gated = FenceLayer::gate(lock(), Arc::new(WriteGate::new()));
        let service = gated.layer(recording(written.clone()));
        for (header, status) in [
            (None, 428),
            (Some(&b"x"[..]), 400),
            (Some(&b"7; lock=\xff"[..]), 400),
            (Some(&b"7; lock=other"[..]), 409),
            (Some(&b"7; lock=reports/nightly"[..]), 200),
            (Some(&b"6; lock=reports/nightly"[..]), 409),
            (Some(&b"7; lock=reports/nightly"[..]), 200),
        ] {
            let response = service.clone().oneshot(request(header)).await.unwrap();
            assert_eq!(response.status(), status, "{header:?}: {}", response.body());
            if status != 200 {
                assert!(
                    response.body().contains("dlock-fence"),
                    "{}",
                    response.body()
                );
            }
        }
        // Two headers, or a value that is not text past its first bytes: 400.
        let twice = Request::builder()
            .header(FENCE_HEADER, "7; lock=reports/nightly")
            .header(FENCE_HEADER, "8; lock=reports/nightly")
            .body(String::new())
            .unwrap();
        let late_byte = [b"7; lock=reports/nightly".repeat(3), vec![0xff]].concat();
        for req in [twice, request(Some(&late_byte))] {
            let response = service.clone().oneshot(req).await.unwrap();
            assert_eq!(response.status(), 400, "{}", response.body());
        }
        assert_eq!(*written.lock().unwrap(), [7, 7]);
    }

    #[tokio::test]
    async fn token_mode_hands_the_token_on_without_a_gate() {
        let written = Arc::new(StdMutex::new(Vec::new()));
        let service = FenceLayer::token(lock()).layer(recording(written.clone()));
        for token in [5, 3] {
            let value = format!("{token}; lock=reports/nightly");
            let response = service
                .clone()
                .oneshot(request(Some(value.as_bytes())))
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
        }
        let missing = service.oneshot(request(None)).await.unwrap();
        assert_eq!(missing.status(), 428);
        // No comparison here: the store's fenced writer refuses the 3.
        assert_eq!(*written.lock().unwrap(), [5, 3]);
    }

    /// A former holder's request that passed the gate is still writing when
    /// the new holder's request arrives: the new one waits, so the resource
    /// never sees an older token after a newer one.
    #[tokio::test]
    async fn a_slow_stale_write_cannot_land_after_a_newer_one() {
        let written = Arc::new(StdMutex::new(Vec::new()));
        let gated = FenceLayer::gate(lock(), Arc::new(WriteGate::new()));
        let service = gated.layer(recording(written.clone()));
        let slow = |token: u64, pause: u64| {
            let header = format!("{token}; lock=reports/nightly");
            let req = Request::builder()
                .header(FENCE_HEADER, header)
                .body(pause.to_string())
                .unwrap();
            service.clone().oneshot(req)
        };
        let old = tokio::spawn(slow(1, 200));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let new = slow(2, 0).await.unwrap();
        assert_eq!(new.status(), 200);
        assert_eq!(old.await.unwrap().unwrap().status(), 200);
        assert_eq!(*written.lock().unwrap(), [1, 2]);
    }

    /// A request dropped while its handler writes (the client went away)
    /// keeps its turn until the handler is done: the next holder's request
    /// writes after it, not in between.
    #[tokio::test]
    async fn a_dropped_request_keeps_its_turn_until_its_handler_is_done() {
        let written = Arc::new(StdMutex::new(Vec::new()));
        let gated = FenceLayer::gate(lock(), Arc::new(WriteGate::new()));
        let service = gated.layer(recording(written.clone()));
        let req = |token: u64, pause: u64| {
            Request::builder()
                .header(FENCE_HEADER, format!("{token}; lock=reports/nightly"))
                .body(pause.to_string())
                .unwrap()
        };
        let dropped = tokio::spawn(service.clone().oneshot(req(1, 200)));
        tokio::time::sleep(Duration::from_millis(50)).await;
        dropped.abort();
        let newer = service.clone().oneshot(req(2, 0)).await.unwrap();
        assert_eq!(newer.status(), 200);
        assert_eq!(*written.lock().unwrap(), [1, 2]);
    }
}
