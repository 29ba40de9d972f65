//! The memory server's clock, which tests can step, skew and freeze: the
//! clock faults a real store's host can have (an NTP step, a drifting
//! oscillator, a paused VM), applied to the one clock that judges expiry.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

/// Server time: nanoseconds on the server's own time line. It starts at one
/// hour, so that stepping back never needs negative numbers.
pub(crate) type ServerTime = Duration;

const ORIGIN: Duration = Duration::from_secs(3600);

struct Anchor {
    /// Real time of the last change.
    real: Instant,
    /// Server time at `real`.
    server: Duration,
    /// Server seconds per real second (1.0 = exact; 0.0 = frozen).
    rate: f64,
}

/// The memory server's clock (see the [module docs](crate::memory)); all changes take
/// effect at once for every client of the server.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::memory::MemoryBackend;
/// let server = MemoryBackend::new();
/// server.clock().step_forward(Duration::from_secs(60)); // an NTP step
/// server.clock().set_rate(1.01);                          // runs 1 % fast
/// server.clock().freeze();                                // a paused host
/// server.clock().set_rate(1.0);                           // normal again
/// ```
pub struct ServerClock {
    anchor: Mutex<Anchor>,
    wall: SystemTime,
}

impl fmt::Debug for ServerClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = self.anchor.lock().unwrap();
        f.debug_struct("ServerClock")
            .field("rate", &a.rate)
            .finish()
    }
}

impl ServerClock {
    pub(crate) fn new() -> Self {
        Self {
            anchor: Mutex::new(Anchor {
                real: Instant::now(),
                server: ORIGIN,
                rate: 1.0,
            }),
            wall: SystemTime::now(),
        }
    }

    pub(crate) fn now(&self) -> ServerTime {
        let a = self.anchor.lock().unwrap();
        Self::at(&a, Instant::now())
    }

    fn at(a: &Anchor, real: Instant) -> Duration {
        let ran = real.saturating_duration_since(a.real).as_secs_f64() * a.rate;
        a.server.saturating_add(
            Duration::try_from_secs_f64(ran).unwrap_or(Duration::from_secs(1 << 40)),
        )
    }

    fn change(&self, f: impl FnOnce(&mut Anchor)) {
        let mut a = self.anchor.lock().unwrap();
        let real = Instant::now();
        a.server = Self::at(&a, real);
        a.real = real;
        f(&mut a);
    }

    /// Jumps the clock forward by `by`: leases due in that time expire at once.
    pub fn step_forward(&self, by: Duration) {
        self.change(|a| a.server += by);
    }

    /// Jumps the clock back by `by` (never before its start): leases last
    /// that much longer than their holders were told.
    pub fn step_back(&self, by: Duration) {
        self.change(|a| a.server = a.server.saturating_sub(by).max(Duration::from_nanos(1)));
    }

    /// Sets how fast the clock runs relative to real time (1.0 exact, 1.5
    /// fast, 0.5 slow, 0.0 frozen). Rates are kept within 0 ..= 1000; a NaN
    /// is taken as 0.
    pub fn set_rate(&self, rate: f64) {
        let rate = if rate.is_nan() {
            0.0
        } else {
            rate.clamp(0.0, 1000.0)
        };
        self.change(|a| a.rate = rate);
    }

    /// Stops the clock (`set_rate(0.0)`).
    pub fn freeze(&self) {
        self.set_rate(0.0);
    }

    /// The wall-clock time of server time `t`, for reports.
    pub(crate) fn wall(&self, t: ServerTime) -> SystemTime {
        match t.checked_sub(ORIGIN) {
            Some(after) => self.wall + after,
            None => self.wall - (ORIGIN - t),
        }
    }

    /// Real time from now until server time `t`, at the current rate (a hint
    /// for waiters; `None` if the clock is frozen).
    pub(crate) fn until(&self, t: ServerTime) -> Option<Duration> {
        let a = self.anchor.lock().unwrap();
        let left = t.saturating_sub(Self::at(&a, Instant::now()));
        Duration::try_from_secs_f64(left.as_secs_f64() / a.rate).ok()
    }
}
