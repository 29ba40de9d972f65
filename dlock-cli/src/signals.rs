//! The termination signals dlock catches (so that it outlives its command)
//! and forwards.

use std::io;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};

/// SIGHUP, SIGINT, SIGQUIT and SIGTERM, caught from [`Signals::install`] on:
/// they no longer end dlock by default.
#[derive(Debug)]
pub(crate) struct Signals {
    hangup: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
    quit: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    /// Starts catching the signals. Needs a Tokio runtime.
    pub(crate) fn install() -> io::Result<Self> {
        Ok(Self {
            hangup: signal(SignalKind::hangup())?,
            interrupt: signal(SignalKind::interrupt())?,
            quit: signal(SignalKind::quit())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    /// The next signal received.
    ///
    /// # Cancel safety
    /// Cancel safe: a signal not yet returned stays pending.
    pub(crate) async fn recv(&mut self) -> Signal {
        tokio::select! {
            Some(()) = self.interrupt.recv() => Signal::SIGINT,
            Some(()) = self.terminate.recv() => Signal::SIGTERM,
            Some(()) = self.hangup.recv() => Signal::SIGHUP,
            Some(()) = self.quit.recv() => Signal::SIGQUIT,
            else => std::future::pending().await,
        }
    }
}

/// Sends `sig` to the process `pid`, or with `group` to its process group
/// (the command and everything it started, under `run --leader`); a
/// process already gone is not an error.
pub(crate) fn send(pid: u32, sig: Signal, group: bool) {
    let Ok(raw) = i32::try_from(pid) else {
        return;
    };
    let target = if group {
        Pid::from_raw(-raw)
    } else {
        Pid::from_raw(raw)
    };
    if let Err(e) = kill(target, sig) {
        tracing::debug!(pid, group, signal = %sig, error = %e, "could not signal the command");
    }
}
