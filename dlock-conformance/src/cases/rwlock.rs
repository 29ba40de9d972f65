//! Read-write locks (`Session::rwlock`, issue 17 item 3): written once in
//! the core on each store's locks, proved here on every store. S7 for
//! read-write locks: never a writer together with anyone else; writes are
//! fenced in order, after the reads before them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use dlock_core::{Error, LockName};
use tokio::task::JoinSet;

use super::{ensure, joined, passed};
use crate::checker::{FencedRegister, History, Op, Phase};
use crate::{Ctx, Failure, Harness, Outcome};

/// S7, S2: readers and writers of one lock (4 reader places) round after
/// round. A writer is never granted while anyone reads or writes, a reader
/// never while someone writes (counted by the clients, grant to release);
/// readers do hold together; writers' tokens follow their grant order
/// (fenced register and history check) and exceed the token of every read
/// that ended before the write was granted.
pub async fn rwlock_excludes_writers(h: &dyn Harness) -> Outcome {
    const READERS: usize = 4;
    const WRITERS: usize = 2;
    const ROUNDS: usize = 5;
    let ctx = Ctx::new(h, "rwlock_excludes_writers");
    let name = ctx.name("rw");
    let (reading, writing) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let most_readers = Arc::new(AtomicUsize::new(0));
    // The largest token of a read that has ended (set before its release).
    let reads_done = Arc::new(AtomicU64::new(0));
    let (register, history) = (Arc::new(FencedRegister::new()), Arc::new(History::new()));
    let wait = (ctx.caps.ttl * 20).max(Duration::from_secs(60));
    let admin = ctx.admin().await?;
    let mut tasks = JoinSet::new();
    for client in 0..READERS + WRITERS {
        let session = ctx.client().await?;
        let lock = session.rwlock_with(&name, READERS)?;
        let admin = admin.clone();
        let name = name.clone();
        let (reading, writing, most_readers, reads_done, register, history) = (
            reading.clone(),
            writing.clone(),
            most_readers.clone(),
            reads_done.clone(),
            register.clone(),
            history.clone(),
        );
        tasks.spawn(async move {
            for _ in 0..ROUNDS {
                if client < READERS {
                    let read = lock
                        .read_timeout(wait)
                        .await
                        .map_err(|e| Failure(format!("waited {wait:?} to read: {e}")))?;
                    let now = reading.fetch_add(1, Ordering::SeqCst) + 1;
                    most_readers.fetch_max(now, Ordering::SeqCst);
                    let writers = writing.load(Ordering::SeqCst);
                    ensure!(writers == 0, "a read was granted while {writers} wrote");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    reading.fetch_sub(1, Ordering::SeqCst);
                    reads_done.fetch_max(read.token().get(), Ordering::SeqCst);
                    read.release().await?;
                } else {
                    history.record(client, Op::Acquire, Phase::Invoke, None);
                    let write = match lock.write_timeout(wait).await {
                        Ok(write) => write,
                        Err(e) => {
                            let held = dlock_core::semaphore::holders(&*admin, &name).await;
                            let queue = admin
                                .inspect(&LockName::new(format!("{name}/queue"))?)
                                .await;
                            return Err(Failure(format!(
                                "waited {wait:?} to write: {e}; held: {held:?}; queue: {queue:?}"
                            )));
                        }
                    };
                    let token = write.token();
                    history.record(client, Op::Acquire, Phase::Ok, Some(token));
                    let before = writing.fetch_add(1, Ordering::SeqCst);
                    let readers = reading.load(Ordering::SeqCst);
                    ensure!(
                        before == 0 && readers == 0,
                        "a write was granted while {before} wrote and {readers} read"
                    );
                    let done = reads_done.load(Ordering::SeqCst);
                    ensure!(
                        token.get() > done,
                        "write token {token} is not above the ended read's {done}"
                    );
                    register.write(client, token);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    register.write(client, token);
                    writing.fetch_sub(1, Ordering::SeqCst);
                    history.record(client, Op::Release, Phase::Invoke, None);
                    write.release().await?;
                    history.record(client, Op::Release, Phase::Ok, None);
                }
            }
            session.close().await?;
            Ok::<_, Failure>(())
        });
    }
    super::join_all(tasks, "client task").await?;
    register.check()?;
    let writes = history.check()?.holds;
    ensure!(
        writes == WRITERS * ROUNDS,
        "expected {} writes, the history has {writes}",
        WRITERS * ROUNDS
    );
    // Readers do share: two reads through the line, each waiting for the
    // other to be granted before it gives back.
    let together = Arc::new(tokio::sync::Barrier::new(2));
    let mut pair = JoinSet::new();
    for _ in 0..2 {
        let session = ctx.client().await?;
        let (lock, together) = (session.rwlock_with(&name, READERS)?, together.clone());
        let t = ctx.caps.ttl;
        pair.spawn(async move {
            let read = lock.read_timeout(t * 10).await?;
            let met = tokio::time::timeout(t * 4, together.wait()).await;
            read.release().await?;
            drop(session);
            ensure!(
                met.is_ok(),
                "two reads of a free read-write lock were not held together"
            );
            Ok::<_, Failure>(())
        });
    }
    super::join_all(pair, "reader task").await?;
    passed()
}

/// L1, S7 (writer preference): while A reads, writer W waits at the head
/// of the line; reader B, coming after W, waits too (a stream of readers
/// cannot starve a writer). When A finishes, W writes, alone; B reads
/// after W. A writer that gives up waiting leaves nothing held.
pub async fn rwlock_writer_preference(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "rwlock_writer_preference");
    let t = ctx.caps.ttl;
    let name = ctx.name("rw");
    let (a, b, w) = (
        ctx.client().await?,
        ctx.client().await?,
        ctx.client().await?,
    );
    let read_a = a.rwlock_with(&name, 4)?.read().await?;
    // A writer that times out takes nothing with it.
    let lock_w = w.rwlock_with(&name, 4)?;
    let started = tokio::time::Instant::now();
    match lock_w.write_timeout(t / 4).await {
        Err(Error::Timeout { .. }) => {}
        Ok(_) => return Err(Failure("a write was granted while A read".into())),
        Err(e) => return Err(e.into()),
    }
    // Every place A does not hold is free again: B takes all three at once.
    let lock_b = b.rwlock_with(&name, 4)?;
    super::given_back(
        &ctx,
        &w,
        "a timed-out writer left the readers' places taken",
        started.elapsed(),
        t / 4,
        || async {
            let mut probes = Vec::new();
            for _ in 0..3 {
                match lock_b.try_read().await? {
                    Some(probe) => probes.push(probe),
                    None => break,
                }
            }
            let all = probes.len() == 3;
            for probe in probes {
                probe.release().await?;
            }
            Ok(all)
        },
    )
    .await?;
    // (the timed-out attempt's place in line is given back in the background)
    let (admin, queue) = (ctx.admin().await?, LockName::new(format!("{name}/queue"))?);
    super::eventually(
        t * 2,
        "the timed-out writer's place in line to be free",
        || {
            let (admin, queue) = (admin.clone(), queue.clone());
            async move { Ok(admin.inspect(&queue).await?.is_none()) }
        },
    )
    .await?;
    let writer = tokio::spawn(async move { lock_w.write_timeout(t * 4).await });
    // W reaches the head of the line (it holds the line's lock) and claims
    // the free places.
    let w_id = w.id().as_str().to_owned();
    super::eventually(t, "W to hold the line", || {
        let (admin, queue, w_id) = (admin.clone(), queue.clone(), w_id.clone());
        async move {
            Ok(admin
                .inspect(&queue)
                .await?
                .is_some_and(|i| i.holder.starts_with(&w_id)))
        }
    })
    .await?;
    tokio::time::sleep(t / 10).await;
    ensure!(
        lock_b.read_timeout(t / 4).await.is_err(),
        "B read while a writer waited ahead of it"
    );
    let reader_b = tokio::spawn({
        let lock_b = lock_b.clone();
        async move { lock_b.read_timeout(t * 8).await }
    });
    tokio::time::sleep(t / 10).await;
    ensure!(!writer.is_finished(), "W wrote while A read");
    ensure!(
        admin
            .inspect(&queue)
            .await?
            .is_some_and(|i| i.holder.starts_with(&w_id)),
        "W left the line while it waited for A's place"
    );
    let read_token = read_a.token();
    read_a.release().await?;
    let write = joined(t * 4, "W's write after A's read", writer)
        .await?
        .map_err(|e| Failure(format!("W never wrote: {e}")))?;
    ensure!(
        write.token() > read_token,
        "write token {} after the read's {read_token}",
        write.token()
    );
    tokio::time::sleep(t / 10).await;
    ensure!(!reader_b.is_finished(), "B read while W wrote");
    write.release().await?;
    let read_b = joined(t * 8, "B's read after W's write", reader_b)
        .await?
        .map_err(|e| Failure(format!("B never read after W: {e}")))?;
    read_b.release().await?;
    passed()
}
