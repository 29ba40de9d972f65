//! Summaries of measurements: latency percentiles (hdrhistogram), the
//! handoffs of a hot lock's history, and Jain's fairness index.

use std::time::Duration;

use dlock_conformance::checker::{Event, Op, Phase};
use hdrhistogram::Histogram;
use serde::Serialize;

/// The largest latency recorded exactly; longer ones count as this.
const MAX_RECORDED: Duration = Duration::from_secs(3600);

/// A latency histogram in nanoseconds, 3 significant digits.
pub(crate) fn histogram() -> Histogram<u64> {
    let max = u64::try_from(MAX_RECORDED.as_nanos()).unwrap_or(u64::MAX);
    Histogram::new_with_bounds(1, max, 3).expect("valid histogram bounds")
}

/// Records `d` (clamped to the histogram's range) in `h`.
pub(crate) fn record(h: &mut Histogram<u64>, d: Duration) {
    h.saturating_record(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1));
}

/// Percentiles of one latency distribution, in microseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Latency {
    /// Number of samples.
    pub(crate) samples: u64,
    /// Median.
    pub(crate) p50_us: f64,
    /// 99th percentile.
    pub(crate) p99_us: f64,
    /// Mean.
    pub(crate) mean_us: f64,
    /// Largest sample.
    pub(crate) max_us: f64,
}

impl Latency {
    /// The summary of `h`; `None` if it has no samples.
    pub(crate) fn of(h: &Histogram<u64>) -> Option<Self> {
        if h.is_empty() {
            return None;
        }
        let us = |ns: u64| ns as f64 / 1_000.0;
        Some(Self {
            samples: h.len(),
            p50_us: us(h.value_at_quantile(0.5)),
            p99_us: us(h.value_at_quantile(0.99)),
            mean_us: h.mean() / 1_000.0,
            max_us: us(h.max()),
        })
    }
}

/// Release→next-grant latencies of one lock's history.
///
/// Walks the events in time order: a release's invocation is paired with the
/// next grant (acquire `Ok`) that follows it; the pair is a *handoff* if that
/// grant went to a different client (a client that takes the lock straight
/// back is not one). Returns the latencies of the handoffs, in grant order.
pub(crate) fn handoffs(events: &[Event]) -> Vec<Duration> {
    let mut pending = None;
    let mut out = Vec::new();
    for e in events {
        match (e.op, e.phase) {
            (Op::Release, Phase::Invoke) => pending = Some((e.client, e.at)),
            (Op::Acquire, Phase::Ok) => {
                if let Some((client, released)) = pending.take()
                    && client != e.client
                {
                    out.push(e.at.saturating_duration_since(released));
                }
            }
            _ => {}
        }
    }
    out
}

/// Jain's fairness index of `counts`: `(Σx)² / (n·Σx²)`, 1 when all are equal,
/// `1/n` when one client got everything; 1 for no acquisitions at all.
pub(crate) fn jain(counts: &[u64]) -> f64 {
    let sum: f64 = counts.iter().map(|&c| c as f64).sum();
    let squares: f64 = counts.iter().map(|&c| (c as f64) * (c as f64)).sum();
    if squares == 0.0 {
        return 1.0;
    }
    sum * sum / (counts.len() as f64 * squares)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlocks::FencingToken;
    use tokio::time::Instant;

    fn event(client: usize, op: Op, phase: Phase, at: Instant) -> Event {
        Event {
            client,
            op,
            phase,
            token: (op == Op::Acquire && phase == Phase::Ok).then(|| FencingToken::new(1)),
            at,
        }
    }

    #[test]
    fn handoffs_pair_a_release_with_the_next_grant_to_another_client() {
        let t = Instant::now();
        let ms = |n| t + Duration::from_millis(n);
        let events = [
            event(0, Op::Acquire, Phase::Ok, ms(0)),
            event(1, Op::Acquire, Phase::Invoke, ms(1)),
            event(0, Op::Release, Phase::Invoke, ms(10)),
            event(1, Op::Acquire, Phase::Ok, ms(13)), // handoff: 3 ms
            event(1, Op::Release, Phase::Invoke, ms(20)),
            event(1, Op::Acquire, Phase::Ok, ms(21)), // took it back: none
            event(1, Op::Release, Phase::Invoke, ms(30)),
            event(2, Op::Acquire, Phase::Ok, ms(35)), // handoff: 5 ms
        ];
        assert_eq!(
            handoffs(&events),
            [Duration::from_millis(3), Duration::from_millis(5)]
        );
    }

    #[test]
    fn a_native_history_without_tokens_counts_only_grants_to_another_client() {
        let t = Instant::now();
        let ms = |n| t + Duration::from_millis(n);
        let native = |client, op, phase, at| Event {
            token: None,
            ..event(client, op, phase, at)
        };
        let events = [
            native(0, Op::Acquire, Phase::Ok, ms(0)),
            native(0, Op::Release, Phase::Invoke, ms(1)),
            native(0, Op::Acquire, Phase::Ok, ms(2)), // same client: none
            native(0, Op::Release, Phase::Invoke, ms(3)),
            native(1, Op::Acquire, Phase::Ok, ms(7)), // handoff: 4 ms
            native(1, Op::Release, Phase::Invoke, ms(8)),
            native(2, Op::Acquire, Phase::Invoke, ms(8)),
            native(1, Op::Acquire, Phase::Ok, ms(9)), // same client: none
        ];
        assert_eq!(handoffs(&events), [Duration::from_millis(4)]);
    }

    #[test]
    fn jain_index() {
        assert!((jain(&[1, 3]) - 0.8).abs() < 1e-9); // 16 / (2 · 10)
        assert!((jain(&[5, 5, 5, 5]) - 1.0).abs() < 1e-9);
        assert!((jain(&[8, 0, 0, 0]) - 0.25).abs() < 1e-9);
        assert!((jain(&[0, 0]) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn latency_percentiles() {
        let mut h = histogram();
        assert!(Latency::of(&h).is_none());
        for us in 1..=100 {
            record(&mut h, Duration::from_micros(us));
        }
        let l = Latency::of(&h).unwrap();
        assert_eq!(l.samples, 100);
        assert!((l.p50_us - 50.0).abs() < 0.1, "{l:?}");
        assert!((l.p99_us - 99.0).abs() < 0.1, "{l:?}");
    }
}
