//! The clock local validity deadlines live on (invariant S4).
//!
//! Tokio's clock is `CLOCK_MONOTONIC`, which stops while the host or VM is
//! suspended, while the store's TTLs keep running: a holder whose laptop
//! slept through its TTL would still believe it holds the lock. Deadlines
//! are therefore kept on *monotonic time plus the time spent suspended since
//! the process started* (`CLOCK_BOOTTIME − CLOCK_MONOTONIC` on Linux): a
//! tokio [`Instant`] shifted forward by every suspend, so the arithmetic and
//! the types stay tokio's. Elsewhere (no `CLOCK_BOOTTIME`), the shift is zero.
//!
//! Tokio's timers cannot see a suspend either, so [`sleep_until`] sleeps in
//! slices of at most [`SLICE`] and re-reads the clock: a deadline that passed
//! during a suspend is noticed within one slice of waking up.

use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;

/// The longest a deadline sleep trusts tokio's timer before looking again.
pub(crate) const SLICE: Duration = Duration::from_millis(500);

/// Now, on the deadline clock.
pub(crate) fn now() -> Instant {
    Instant::now() + suspended()
}

/// Sleeps until `deadline` on the deadline clock has passed.
pub(crate) async fn sleep_until(deadline: Instant) {
    loop {
        let now = now();
        if now >= deadline {
            return;
        }
        tokio::time::sleep((deadline - now).min(SLICE)).await;
    }
}

/// Time spent suspended since the first call in this process.
fn suspended() -> Duration {
    static START: OnceLock<Duration> = OnceLock::new();
    let offset = boot_minus_monotonic();
    let start = *START.get_or_init(|| offset);
    offset.saturating_sub(start) + test_hook::extra()
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn boot_minus_monotonic() -> Duration {
    use rustix::time::{ClockId, clock_gettime};
    let at = |id| {
        let t = clock_gettime(id);
        Duration::new(
            t.tv_sec.max(0) as u64,
            t.tv_nsec.clamp(0, 999_999_999) as u32,
        )
    };
    // Monotonic first: a suspend between the two readings then makes the
    // difference larger (deadlines pass sooner: safe), never smaller.
    let mono = at(ClockId::Monotonic);
    let boot = at(ClockId::Boottime);
    boot.saturating_sub(mono)
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn boot_minus_monotonic() -> Duration {
    Duration::ZERO
}

/// A way for tests to simulate a suspend: time that the deadline clock
/// counts and tokio's does not.
pub(crate) mod test_hook {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    static EXTRA_NANOS: AtomicU64 = AtomicU64::new(0);

    pub(crate) fn extra() -> Duration {
        Duration::from_nanos(EXTRA_NANOS.load(Ordering::Relaxed))
    }

    /// Adds `d` of simulated suspend (process-wide).
    #[cfg(test)]
    pub(crate) fn suspend(d: Duration) {
        EXTRA_NANOS.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryBackend;
    use crate::{Backend, LostReason, SessionOptions};

    /// S4 across a suspend: the machine sleeps through the TTL (tokio's
    /// clock does not move, the store's does). The hold must be invalid at
    /// once after waking, and `lost()` must fire within one slice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_suspend_past_the_ttl_loses_the_hold() {
        let server = MemoryBackend::new();
        let ttl = Duration::from_secs(5);
        let session = server
            .session(SessionOptions::new().ttl(ttl))
            .await
            .unwrap();
        let guard = session.lock("suspend").unwrap().acquire().await.unwrap();
        let lost = guard.lost();
        let watcher = tokio::spawn(async move { (lost.await, Instant::now()) });
        assert!(guard.is_held());
        // The machine sleeps for 2 TTLs: the store's clock runs on.
        test_hook::suspend(ttl * 2);
        server.clock().step_forward(ttl * 2);
        let woke = Instant::now();
        assert!(
            !guard.is_held(),
            "is_held() is true after a suspend longer than the TTL"
        );
        let (reason, at) = tokio::time::timeout(SLICE * 3, watcher)
            .await
            .expect("lost() did not fire after the suspend")
            .unwrap();
        assert_eq!(reason, LostReason::Expired);
        assert!(
            at - woke <= SLICE * 2,
            "lost() fired {:?} after waking",
            at - woke
        );
    }
}
