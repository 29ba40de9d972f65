//! The "8 clients on one lock" measurement shared by the adapters' examples
//! (included with `#[path]`): each client loops acquire → release on one lock
//! for a fixed time; reports handoffs/s, release→next-grant latency (grants
//! to a *different* client, from the moment the release was invoked) and
//! per-client acquisition counts.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A boxed error that crosses tasks.
pub(crate) type BoxErr = Box<dyn std::error::Error + Send + Sync>;

/// Releases what an acquire took.
pub(crate) type Releaser =
    Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = Result<(), BoxErr>> + Send>> + Send>;

/// Wraps a release future as a [`Releaser`].
pub(crate) fn releaser<F>(release: F) -> Releaser
where
    F: Future<Output = Result<(), BoxErr>> + Send + 'static,
{
    Box::new(move || Box::pin(release))
}

/// Runs every client's acquire → release loop on one lock for `duration`;
/// returns "handoffs/s | p50 | p99 | counts" for a Markdown row.
pub(crate) async fn hot_lock<F, Fut>(duration: Duration, clients: Vec<F>) -> String
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = Result<Releaser, BoxErr>> + Send,
{
    let last_release: Arc<Mutex<Option<(usize, Instant)>>> = Arc::default();
    let latencies: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let end = Instant::now() + duration;
    let mut tasks = Vec::new();
    for (i, acquire) in clients.into_iter().enumerate() {
        let (last_release, latencies) = (last_release.clone(), latencies.clone());
        tasks.push(tokio::spawn(async move {
            let mut count = 0usize;
            while Instant::now() < end {
                let release = acquire()
                    .await
                    .unwrap_or_else(|e| panic!("acquire failed: {e}"));
                let granted = Instant::now();
                if let Some((who, at)) = *last_release.lock().unwrap()
                    && who != i
                {
                    latencies.lock().unwrap().push(granted - at);
                }
                count += 1;
                *last_release.lock().unwrap() = Some((i, Instant::now()));
                release().await.expect("release");
            }
            count
        }));
    }
    let mut counts = Vec::new();
    for t in tasks {
        counts.push(t.await.expect("client task"));
    }
    let total: usize = counts.iter().sum();
    let mut lat = latencies.lock().unwrap().clone();
    let (p50, p99) = if lat.is_empty() {
        (Duration::ZERO, Duration::ZERO)
    } else {
        percentiles(&mut lat)
    };
    format!(
        "{:.0} | {} | {} | {counts:?}",
        total as f64 / duration.as_secs_f64(),
        us(p50),
        us(p99)
    )
}

/// Median and 99th percentile.
pub(crate) fn percentiles(v: &mut [Duration]) -> (Duration, Duration) {
    v.sort();
    (v[v.len() / 2], v[(v.len() * 99) / 100])
}

/// Microseconds, rounded.
pub(crate) fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}
