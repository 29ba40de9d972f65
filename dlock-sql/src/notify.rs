//! Wake-ups on PostgreSQL: a `LISTEN` connection turns other processes'
//! `pg_notify` into wake-ups of this process's waiters (invariant L2); the
//! waiters themselves register in dlock-core's [`WakeHub`].

use std::sync::Weak;

use dlock_core::wake::WakeHub;

/// Listens on the table's channel and wakes local waiters; ends when the
/// backend is dropped.
#[cfg(feature = "postgres")]
pub(crate) async fn listen(url: String, channel: String, hub: Weak<WakeHub>) {
    use sqlx::postgres::PgListener;
    use std::time::Duration;
    loop {
        let mut listener = match PgListener::connect(&url).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "LISTEN connection failed; retrying (waiters fall back to polling)");
                tokio::time::sleep(Duration::from_secs(1)).await;
                if hub.strong_count() == 0 {
                    return;
                }
                continue;
            }
        };
        if let Err(e) = listener.listen(&channel).await {
            tracing::warn!(error = %e, "LISTEN failed; retrying");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        loop {
            match listener.try_recv().await {
                Ok(Some(n)) => match hub.upgrade() {
                    Some(hub) => hub.wake_all(n.payload()),
                    None => return,
                },
                // Connection lost: notifications in the gap are covered by
                // the waiters' fallback timers.
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "LISTEN connection broke; reconnecting");
                    break;
                }
            }
        }
    }
}
