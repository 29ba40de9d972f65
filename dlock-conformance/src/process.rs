//! A simulated client process that can really be paused: its own runtime on
//! its own thread, which [`Process::pause`] blocks as a SIGSTOP would. The
//! renewal task, timers and connection drivers of everything opened inside
//! stop together, and resume with a jump of the clock, exactly what a GC
//! pause or a stopped VM does to a lock holder.

use std::future::Future;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;

use tokio::runtime::{Builder, Handle};
use tokio::sync::oneshot;

/// One simulated process (see the [module docs](self)).
///
/// Objects opened through it (backends, sessions, guards) keep their
/// background work on its runtime; drop them before the process.
#[derive(Debug)]
pub struct Process {
    handle: Handle,
    paused: Arc<(Mutex<bool>, Condvar)>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Process {
    /// Starts the process's runtime thread.
    pub fn start() -> std::io::Result<Self> {
        let runtime = Builder::new_current_thread().enable_all().build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = thread::Builder::new()
            .name("dlock-process".into())
            .spawn(move || {
                runtime.block_on(async {
                    let _ = stopped.await;
                });
            })?;
        Ok(Self {
            handle,
            paused: Arc::default(),
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Runs `fut` inside the process: tasks it spawns (connection drivers,
    /// renewal) belong to the process. Blocks the calling worker thread, so
    /// the caller's runtime must be multi-threaded.
    pub fn enter<F: Future>(&self, fut: F) -> F::Output {
        tokio::task::block_in_place(|| self.handle.block_on(fut))
    }

    /// Runs `fut` as a task of the process and waits for it.
    pub async fn run<F>(&self, fut: F) -> F::Output
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match self.handle.spawn(fut).await {
            Ok(out) => out,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }

    /// Starts `fut` as a task of the process.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.handle.spawn(fut)
    }

    /// Stops the whole process until [`resume`](Self::resume): returns once
    /// it no longer runs anything.
    pub fn pause(&self) {
        *self.paused.0.lock().unwrap() = true;
        let paused = self.paused.clone();
        let (entered, wait_entered) = std::sync::mpsc::channel();
        self.handle.spawn(async move {
            let _ = entered.send(());
            // Blocking here blocks the process's only thread: everything in
            // it stops, timers included.
            let (lock, cvar) = &*paused;
            let mut stopped = lock.lock().unwrap();
            while *stopped {
                stopped = cvar.wait(stopped).unwrap();
            }
        });
        let _ = wait_entered.recv();
    }

    /// Resumes a paused process.
    pub fn resume(&self) {
        *self.paused.0.lock().unwrap() = false;
        self.paused.1.notify_all();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.resume();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Runs `fut` to its end on a thread of its own, with a runtime of its own,
/// and waits for it: for clean-ups in `Drop`, which may run inside a
/// runtime (where blocking on a future panics) or outside any. A panic in
/// `fut` is swallowed (a clean-up that fails must not hide what failed
/// before it).
pub fn run_aside<F>(fut: F)
where
    F: Future + Send + 'static,
{
    let done = thread::spawn(move || {
        let runtime = Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for a clean-up");
        runtime.block_on(fut);
    });
    let _ = done.join();
}
