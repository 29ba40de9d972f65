//! Wake-ups on SQLite. SQLite tells no one of a commit, but every commit
//! writes to the database's files (the write-ahead log in WAL mode, which
//! this crate sets; the database file itself at a checkpoint), and the
//! operating system tells who watches them (inotify, FSEvents, ...). So a
//! release in another process, or on another connection pool of this one,
//! wakes this process's waiters within milliseconds (the writer's `fsync`,
//! then SQLite's busy-wait steps) instead of at their next poll (5 ms,
//! doubling to 100 ms).
//!
//! A write does not say which lock changed. So each backend with waiters
//! answers a commit with one read of which of the locks it waits for are
//! held, and wakes the longest-waiting waiter of each lock that is not (L6:
//! one take attempt per freed lock and backend, no herd; writes that free
//! nothing wake no one). The read takes SQLite's write lock for a moment
//! (`BEGIN IMMEDIATE`, so that it sees the commit that was written), which
//! is what this costs the writers: one short lock per commit and backend
//! with waiters. A commit's several writes are usually read once: writes
//! already counted when the read got the lock are covered by it (a
//! checkpoint's or a late event's write makes one more read). Polling
//! stays as it was: it covers a file system that reports nothing (network
//! file systems) and a watch that could not be set up (the inotify
//! limits), so this only ever makes waits shorter (L2), and never decides
//! a grant.

use std::collections::HashSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use ::notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use dlock_core::Error;
use sqlx::Row;
use tokio::sync::Notify;

use crate::dialect::Arg;
use crate::store::{Conn, map_err};
use crate::{AbortOnDrop, Inner};

/// One watch per database file in the process, shared by the backends on
/// it: a watch is an inotify instance and a thread, and a user has few
/// instances (128 by default on Linux, across all of its processes).
static WATCHES: Mutex<Vec<(PathBuf, Weak<Watch>)>> = Mutex::new(Vec::new());

/// The OS watch on one database's directory, and whom a write concerns:
/// one signal per backend that waits on the file.
struct Watch {
    _watcher: RecommendedWatcher,
    signals: Arc<Mutex<Vec<Weak<Notify>>>>,
    /// Writes seen so far (counted before the signals are given).
    writes: Arc<AtomicU64>,
}

/// One backend's share of the watch on its database's files, and its task
/// that answers writes; both end with it.
pub(crate) struct FileWake {
    _watch: Arc<Watch>,
    task: AbortOnDrop,
}

impl FileWake {
    /// Starts waking `inner`'s waiters on writes to its database file (the
    /// absolute path SQLite reports), its WAL or its rollback journal.
    pub(crate) fn start(database: &Path, inner: Weak<Inner>) -> ::notify::Result<Self> {
        let written = Arc::new(Notify::new());
        let watch = Watch::shared(database, Arc::downgrade(&written))?;
        let task = tokio::spawn(wake_on_writes(inner, written, watch.writes.clone()));
        Ok(Self {
            _watch: watch,
            task: AbortOnDrop(task),
        })
    }

    /// Whether its task has ended (its runtime shut down): the backend then
    /// starts another.
    pub(crate) fn ended(&self) -> bool {
        self.task.0.is_finished()
    }
}

impl Watch {
    /// The process's watch on `database`'s files, `signal` added to it.
    fn shared(database: &Path, signal: Weak<Notify>) -> ::notify::Result<Arc<Self>> {
        // (the same file under two spellings is one watch)
        let database =
            std::fs::canonicalize(database).or_else(|_| std::path::absolute(database))?;
        let mut watches = WATCHES.lock().unwrap();
        watches.retain(|(_, w)| w.strong_count() > 0);
        if let Some(watch) = watches
            .iter()
            .find(|(path, _)| *path == database)
            .and_then(|(_, w)| w.upgrade())
        {
            watch.signals.lock().unwrap().push(signal);
            return Ok(watch);
        }
        let watch = Arc::new(Watch::new(&database, signal)?);
        watches.push((database, Arc::downgrade(&watch)));
        Ok(watch)
    }

    fn new(database: &Path, first: Weak<Notify>) -> ::notify::Result<Self> {
        let (Some(dir), Some(file)) = (database.parent(), database.file_name()) else {
            return Err(::notify::Error::generic("the database path names no file"));
        };
        let ours = files_of(file);
        let signals = Arc::new(Mutex::new(vec![first]));
        let writes = Arc::new(AtomicU64::new(0));
        let (to_signal, counted) = (signals.clone(), writes.clone());
        let mut watcher = ::notify::recommended_watcher(move |event: ::notify::Result<Event>| {
            let concerns_us = match event {
                Ok(event) => match event.kind {
                    EventKind::Modify(_) | EventKind::Create(_) => event
                        .paths
                        .iter()
                        .any(|p| p.file_name().is_some_and(|f| ours.iter().any(|o| o == f))),
                    // Events were lost (a queue overflow asks for a rescan):
                    // one of them may have been ours.
                    EventKind::Other => true,
                    _ => false,
                },
                Err(_) => true,
            };
            if concerns_us {
                counted.fetch_add(1, Ordering::AcqRel);
                // (a permit is kept: writes during a backend's read make
                // at most one more read, not one each)
                let mut signals = to_signal.lock().unwrap();
                signals.retain(|s| s.upgrade().map(|s| s.notify_one()).is_some());
            }
        })?;
        watcher.watch(dir, RecursiveMode::NonRecursive)?;
        Ok(Self {
            _watcher: watcher,
            signals,
            writes,
        })
    }
}

/// A backend's answer to writes: after each (or each burst), reads which
/// of the locks its waiters wait for are held, and wakes the first waiter
/// of every other one. Ends when the backend is gone.
async fn wake_on_writes(inner: Weak<Inner>, written: Arc<Notify>, writes: Arc<AtomicU64>) {
    // The writes the last read covered: every write counted before a read
    // got the write lock belongs to a transaction that had ended (writes to
    // the database's files need that lock), so the read saw it, for every
    // lock waited for then (the read lists them after it has the lock: a
    // waiter that came while the read waited for the lock is read too).
    let mut covered = 0;
    loop {
        written.notified().await;
        if writes.load(Ordering::Acquire) <= covered {
            continue; // a later write of a commit already read
        }
        let Some(inner) = inner.upgrade() else { return };
        if inner.hub.keys().is_empty() {
            continue;
        }
        match free_among_waited(&inner, &writes).await {
            Ok((free, seen)) => {
                covered = seen;
                for name in free {
                    inner.hub.wake_first(&name);
                }
            }
            // (the waiters' polls look in their time)
            Err(e) => {
                tracing::debug!(backend = "sqlite", error = %e, "reading the locks after a write failed")
            }
        }
    }
}

/// Which of the locks waited for now are free, read once the write that
/// woke the task has committed: a write to the WAL comes before the
/// commit's `fsync` and before readers can see it, so the read waits for
/// the writer's lock first (`BEGIN IMMEDIATE`, bounded by the busy
/// timeout) and then lets it go without writing (`ROLLBACK`). Red without
/// it: a waiter woken by a release's WAL write read the lock still held
/// and slept to its poll. The locks are listed, and the count of `writes`
/// taken, once the lock is held; both are returned.
async fn free_among_waited(inner: &Inner, writes: &AtomicU64) -> Result<(Vec<String>, u64), Error> {
    let Some(sql) = &inner.sql.held_among else {
        return Ok((Vec::new(), writes.load(Ordering::Acquire)));
    };
    let mut conn = Conn::get(inner).await?;
    // (a connection cut off while it may hold the lock is closed, which
    // lets the lock go, never handed back)
    conn.mark_locked();
    let read = async {
        conn.execute_raw("BEGIN IMMEDIATE").await?;
        let seen = writes.load(Ordering::Acquire);
        let waited = inner.hub.keys();
        let listed = serde_json::to_string(&waited).expect("strings encode");
        let rows = conn.fetch_all(sql.bind(&[Arg::Text(&listed)])).await;
        conn.execute_raw("ROLLBACK").await?;
        rows.map(|rows| (rows, waited, seen))
    }
    .await
    .map_err(|e| map_err("sqlite", e))?;
    conn.mark_unlocked();
    let (rows, waited, seen) = read;
    let held: HashSet<String> = rows
        .iter()
        .map(|row| row.try_get::<String, _>(0))
        .collect::<Result<_, _>>()
        .map_err(|e| map_err("sqlite", e))?;
    let free = waited.into_iter().filter(|n| !held.contains(n)).collect();
    Ok((free, seen))
}

/// The files a commit to `file` writes: the database, its WAL and its
/// rollback journal (the shared-memory index is written through `mmap`,
/// which no watch reports).
fn files_of(file: &std::ffi::OsStr) -> [OsString; 3] {
    let with = |suffix: &str| {
        let mut name = file.to_owned();
        name.push(suffix);
        name
    };
    [file.to_owned(), with("-wal"), with("-journal")]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use sqlx::Connection;

    fn temp_dir() -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("dlock-file-wake-{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A commit on a connection of its own (as another process's would be)
    /// signals the watch; a watch with nothing written signals nothing.
    #[tokio::test]
    async fn a_commit_elsewhere_signals_the_watch() {
        let dir = temp_dir();
        let db = dir.join("locks.db");
        let url = format!("sqlite://{}?mode=rwc", db.display());
        let mut other = sqlx::SqliteConnection::connect(&url).await.unwrap();
        sqlx::query("PRAGMA journal_mode = WAL")
            .execute(&mut other)
            .await
            .unwrap();
        sqlx::query("CREATE TABLE t (x INTEGER)")
            .execute(&mut other)
            .await
            .unwrap();

        let written = Arc::new(Notify::new());
        let _watch = Watch::shared(&db, Arc::downgrade(&written)).unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(100), written.notified())
                .await
                .is_err(),
            "signalled without a write"
        );
        sqlx::query("INSERT INTO t VALUES (1)")
            .execute(&mut other)
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(5), written.notified())
            .await
            .expect("signalled by the commit");
        drop(other);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Two backends on one file share one watch, under any spelling of
    /// its path; it stops with the last of them.
    #[test]
    fn one_watch_per_file() {
        let dir = temp_dir();
        let db = dir.join("shared.db");
        std::fs::write(&db, b"").unwrap();
        let (one, two) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let a = Watch::shared(&db, Arc::downgrade(&one)).unwrap();
        let b = Watch::shared(&dir.join(".").join("shared.db"), Arc::downgrade(&two)).unwrap();
        assert!(Arc::ptr_eq(&a, &b), "two watches for one file");
        assert_eq!(a.signals.lock().unwrap().len(), 2);
        let watch = Arc::downgrade(&a);
        drop((a, b));
        assert!(watch.upgrade().is_none(), "the watch outlived its backends");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_files_of_a_database() {
        let names = files_of(std::ffi::OsStr::new("dlock.db"));
        assert_eq!(
            names,
            ["dlock.db", "dlock.db-wal", "dlock.db-journal"].map(OsString::from)
        );
    }
}
