//! The metrics of `dlock_core::telemetry`, asserted after a scripted run on
//! memory:// with a recorder installed (its own test binary: the recorder is
//! global to the process).

use std::collections::HashMap;
use std::time::Duration;

use dlock_core::memory::MemoryBackend;
use dlock_core::telemetry::names;
use dlock_core::{Backend, Error, LostReason, SessionOptions};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// Every metric as `name{label=value,...}` (labels sorted) -> value, summed
/// over every snapshot so far (a snapshot hands out what changed since the
/// last one).
struct Meter {
    snapshotter: Snapshotter,
    seen: HashMap<String, DebugValue>,
}

impl Meter {
    fn read(&mut self) -> &HashMap<String, DebugValue> {
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let (_, key) = key.into_parts();
            let mut labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            let name = format!("{}{{{}}}", key.name(), labels.join(","));
            let merged = match (self.seen.remove(&name), value) {
                (Some(DebugValue::Counter(a)), DebugValue::Counter(b)) => {
                    DebugValue::Counter(a + b)
                }
                (Some(DebugValue::Gauge(a)), DebugValue::Gauge(b)) => DebugValue::Gauge(a + b),
                (Some(DebugValue::Histogram(mut a)), DebugValue::Histogram(b)) => {
                    a.extend(b);
                    DebugValue::Histogram(a)
                }
                (_, value) => value,
            };
            self.seen.insert(name, merged);
        }
        &self.seen
    }
}

fn counter(m: &HashMap<String, DebugValue>, key: &str) -> u64 {
    match m.get(key) {
        Some(DebugValue::Counter(n)) => *n,
        None => 0,
        other => panic!("{key}: {other:?}"),
    }
}

fn gauge(m: &HashMap<String, DebugValue>, key: &str) -> f64 {
    match m.get(key) {
        Some(DebugValue::Gauge(v)) => v.into_inner(),
        other => panic!("{key}: {other:?}"),
    }
}

fn samples(m: &HashMap<String, DebugValue>, key: &str) -> Vec<f64> {
    match m.get(key) {
        Some(DebugValue::Histogram(v)) => v.iter().map(|x| x.into_inner()).collect(),
        None => Vec::new(),
        other => panic!("{key}: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scripted_run_is_counted() {
    let recorder = DebuggingRecorder::new();
    let mut meter = Meter {
        snapshotter: recorder.snapshotter(),
        seen: HashMap::new(),
    };
    recorder
        .install()
        .expect("the only recorder of this test binary");

    let backend = MemoryBackend::new();
    let ttl = Duration::from_millis(400);
    let options = SessionOptions::new().ttl(ttl);
    let a = backend.session(options.clone()).await.unwrap();
    let b = backend.session(options).await.unwrap();
    let m = meter.read();
    assert_eq!(gauge(m, "dlock_sessions_open{backend=memory}"), 2.0);

    // granted, busy, timeout; a hold that outlives a few renewals, released.
    let held = a.lock("job").unwrap().acquire().await.unwrap();
    assert!(
        b.lock("job")
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none()
    );
    let timed = b
        .lock("job")
        .unwrap()
        .acquire_timeout(Duration::from_millis(50))
        .await;
    assert!(matches!(timed, Err(Error::Timeout { .. })), "{timed:?}");
    tokio::time::sleep(ttl * 2).await;
    held.release().await.unwrap();

    // A hold force-released by an admin: lost at the next renewal (revoked).
    let doomed = b.lock("doomed").unwrap().acquire().await.unwrap();
    let name = dlock_core::LockName::new("doomed").unwrap();
    assert!(backend.force_release(&name).await.unwrap());
    assert_eq!(
        tokio::time::timeout(ttl * 3, doomed.lost()).await.unwrap(),
        LostReason::Revoked
    );
    drop(doomed);
    a.close().await.unwrap();

    let m = meter.read();
    let acquires = |outcome: &str| {
        counter(
            m,
            &format!(
                "{}{{backend=memory,outcome={outcome}}}",
                names::ACQUIRE_TOTAL
            ),
        )
    };
    assert_eq!(
        (
            acquires("granted"),
            acquires("busy"),
            acquires("timeout"),
            acquires("error")
        ),
        (2, 1, 1, 0),
        "{m:#?}"
    );
    let waits = samples(
        m,
        &format!("{}{{backend=memory,outcome=timeout}}", names::ACQUIRE_WAIT),
    );
    assert_eq!(waits.len(), 1);
    assert!(waits[0] >= 0.05 && waits[0] < 5.0, "{waits:?}");
    // Two holds ended: the released one after at least two TTLs.
    let holds = samples(m, &format!("{}{{backend=memory}}", names::HOLD));
    assert_eq!(holds.len(), 2, "{m:#?}");
    assert!(
        holds.iter().any(|h| *h >= (ttl * 2).as_secs_f64()),
        "{holds:?}"
    );
    assert_eq!(
        counter(
            m,
            &format!("{}{{backend=memory,cause=revoked}}", names::LOST_TOTAL)
        ),
        1,
        "{m:#?}"
    );
    assert_eq!(
        counter(
            m,
            &format!("{}{{backend=memory,cause=expired}}", names::LOST_TOTAL)
        ),
        0
    );
    // Renewals ran (a third of the TTL apart by default) and each landed
    // with time to spare before the local deadline.
    let renewals = samples(m, &format!("{}{{backend=memory}}", names::RENEWAL));
    assert!(renewals.len() >= 3, "{renewals:?}");
    let lags = samples(m, &format!("{}{{backend=memory}}", names::RENEWAL_LAG));
    assert!(!lags.is_empty(), "{m:#?}");
    assert!(
        lags.iter().all(|l| *l > 0.0 && *l <= ttl.as_secs_f64()),
        "{lags:?}"
    );
    assert_eq!(gauge(m, "dlock_sessions_open{backend=memory}"), 1.0);
    b.close().await.unwrap();
    let m = meter.read();
    assert_eq!(gauge(m, "dlock_sessions_open{backend=memory}"), 0.0);
}
