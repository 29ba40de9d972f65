//! Wake-ups on PostgreSQL: a `LISTEN` connection turns other processes'
//! `pg_notify` into wake-ups of this process's waiters (invariant L2); the
//! waiters themselves register in dlock-core's [`WakeHub`].

use std::sync::Weak;
use std::time::Duration;

use dlock_core::wake::WakeHub;
use sqlx::postgres::PgListener;

async fn connect(url: &str, channel: &str) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect(url).await?;
    listener.listen(channel).await?;
    Ok(listener)
}

/// The backend's first `LISTEN`, set up before [`SqlBackend::connect`]
/// returns so that notifications work from the start; `None` (the waiters'
/// timers cover the gap while [`listen`] retries) if it fails or takes longer
/// than `within`.
///
/// [`SqlBackend::connect`]: crate::SqlBackend::connect
pub(crate) async fn first_listener(
    url: &str,
    channel: &str,
    within: Duration,
) -> Option<PgListener> {
    match tokio::time::timeout(within, connect(url, channel)).await {
        Ok(Ok(listener)) => Some(listener),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "LISTEN connection failed; retrying in the background");
            None
        }
        Err(_) => {
            tracing::warn!("LISTEN connection timed out; retrying in the background");
            None
        }
    }
}

/// Listens on the table's channel and wakes local waiters; ends when the
/// backend is dropped.
///
/// A notification wakes the longest-waiting local waiter of its lock only
/// (L6: one release, one take attempt per process; a woken waiter that loses
/// the race or goes away passes the turn on). Notifications sent while the
/// `LISTEN` connection is down are lost, so every time it is re-established
/// every local waiter is woken to look again. `first` is the listener
/// [`first_listener`] set up before the backend was handed out (when no
/// waiter can exist yet): its start wakes no one.
pub(crate) async fn listen(
    url: String,
    channel: String,
    hub: Weak<WakeHub>,
    mut first: Option<PgListener>,
) {
    const MIN_PAUSE: Duration = Duration::from_millis(50);
    const MAX_PAUSE: Duration = Duration::from_secs(1);
    let mut pause = MIN_PAUSE;
    loop {
        let fresh = first.is_some();
        let listening = async {
            if let Some(listener) = first.take() {
                return Ok(listener);
            }
            connect(&url, &channel).await
        };
        let mut listener = match listening.await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "LISTEN connection failed; retrying (waiters fall back to their timers)");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_PAUSE);
                if hub.strong_count() == 0 {
                    return;
                }
                continue;
            }
        };
        pause = MIN_PAUSE;
        // Releases while no LISTEN was in place were not heard: everyone
        // looks again (L2).
        match hub.upgrade() {
            Some(hub) if !fresh => hub.wake_everyone(),
            Some(_) => {}
            None => return,
        }
        loop {
            match listener.try_recv().await {
                Ok(Some(n)) => match hub.upgrade() {
                    Some(hub) => hub.wake_first(n.payload()),
                    None => return,
                },
                // The connection is gone (sqlx would reconnect on the next
                // call, silently): reconnect here, so the gap is noticed.
                Ok(None) => {
                    tracing::debug!("LISTEN connection closed; reconnecting");
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "LISTEN connection broke; reconnecting");
                    break;
                }
            }
        }
    }
}
