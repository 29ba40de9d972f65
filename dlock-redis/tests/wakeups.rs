//! Wake-ups under churn (item 18 of "safety holes", the WakeHub
//! `has_waiters`/subscribe race): other waiters of the same channel in the
//! same process come and go — each leaving may unsubscribe the channel —
//! while a waiter subscribes. Once its first wait has returned, that waiter
//! must be subscribed: the next release wakes it through pub/sub, not at its
//! fallback poll (set far longer than the bound here).

mod common;

use std::time::Duration;

use common::{redis_url, skipped, unique};
use dlock_core::{Backend, SessionOptions};
use dlock_redis::RedisBackend;
use tokio::time::{Instant, sleep, timeout};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribed_waiter_is_woken_while_others_come_and_go() {
    if skipped(
        "redis",
        "subscribed_waiter_is_woken_while_others_come_and_go",
    ) {
        return;
    }
    const ROUNDS: usize = 30;
    let holder_backend = RedisBackend::connect(&redis_url()).await.expect("redis up");
    let backend = RedisBackend::connect(&redis_url()).await.expect("redis up");
    let ttl = Duration::from_millis(500);
    let holder = holder_backend
        .session(SessionOptions::new().ttl(ttl))
        .await
        .unwrap();
    // A missed notification shows as a wait of this long.
    let waiters = backend
        .session(
            SessionOptions::new()
                .ttl(ttl)
                .poll_fallback(Duration::from_secs(5)),
        )
        .await
        .unwrap();
    let mut slowest = Duration::ZERO;
    for round in 0..ROUNDS {
        let name = unique("churn");
        let g = holder.lock(&name).unwrap().acquire().await.unwrap();
        // Waiters that come and go on the same channel.
        let mut churn = Vec::new();
        for i in 0..4u64 {
            let lock = waiters.lock(&name).unwrap();
            churn.push(tokio::spawn(async move {
                loop {
                    let wait = Duration::from_micros(300 * (i + 1));
                    let _ = timeout(wait, lock.acquire()).await;
                }
            }));
        }
        sleep(Duration::from_millis(5)).await;
        let lock = waiters.lock(&name).unwrap();
        let waiter = tokio::spawn(async move {
            let g = lock.acquire_timeout(Duration::from_secs(10)).await;
            (g, Instant::now())
        });
        sleep(Duration::from_millis(30)).await;
        for c in &churn {
            c.abort();
        }
        for c in churn {
            let _ = c.await;
        }
        // The churners' clean-up (unsubscribes) has run by now.
        sleep(Duration::from_millis(30)).await;
        let released = Instant::now();
        g.release().await.unwrap();
        let (got, at) = waiter.await.unwrap();
        let gw = got.unwrap_or_else(|e| panic!("round {round}: {e}"));
        let took = at - released;
        slowest = slowest.max(took);
        assert!(
            took < Duration::from_millis(500),
            "round {round}: the waiter was woken {took:?} after the release (a missed \
             notification: its channel was not subscribed)"
        );
        gw.release().await.unwrap();
    }
    eprintln!("slowest wake-up over {ROUNDS} rounds: {slowest:?}");
}
