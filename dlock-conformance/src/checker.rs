//! The safety checker: a fenced register and a history of operations checked
//! for overlapping holds and grant order.

use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;
use std::time::Duration;

use dlock_core::FencingToken;
use tokio::time::Instant;

/// A register that accepts a write only if its token is at least the highest
/// it has accepted (what a fenced resource does). Counts what it refused.
///
/// ```
/// use dlock_conformance::checker::FencedRegister;
/// use dlock_core::FencingToken;
/// let reg = FencedRegister::new();
/// assert!(reg.write(0, FencingToken::new(2)));
/// assert!(!reg.write(1, FencingToken::new(1)));
/// assert_eq!(reg.rejections(), 1);
/// ```
#[derive(Debug, Default)]
pub struct FencedRegister {
    inner: Mutex<RegisterState>,
}

#[derive(Debug, Default)]
struct RegisterState {
    highest: u64,
    accepted: usize,
    rejected: Vec<(usize, u64, u64)>,
}

impl FencedRegister {
    /// An empty register.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes on behalf of `client` with `token`; true if accepted.
    pub fn write(&self, client: usize, token: FencingToken) -> bool {
        let mut st = self.inner.lock().unwrap();
        if token.get() >= st.highest {
            st.highest = token.get();
            st.accepted += 1;
            true
        } else {
            let highest = st.highest;
            st.rejected.push((client, token.get(), highest));
            false
        }
    }

    /// Writes accepted so far.
    pub fn accepted(&self) -> usize {
        self.inner.lock().unwrap().accepted
    }

    /// Writes refused so far.
    pub fn rejections(&self) -> usize {
        self.inner.lock().unwrap().rejected.len()
    }

    /// `Ok` if nothing was refused, else a description of the refusals.
    pub fn check(&self) -> Result<(), String> {
        let st = self.inner.lock().unwrap();
        if st.rejected.is_empty() {
            return Ok(());
        }
        let first: Vec<_> = st
            .rejected
            .iter()
            .take(5)
            .map(|(c, t, h)| format!("client {c} wrote with token {t} after {h}"))
            .collect();
        Err(format!(
            "fenced register refused {} write(s): {}",
            st.rejected.len(),
            first.join("; ")
        ))
    }
}

/// The operation an event belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Acquiring the lock (`ok` carries the token).
    Acquire,
    /// Releasing it (`invoke` ends the client's hold interval).
    Release,
    /// The client learned the hold was lost (`ok`; ends the interval).
    Lost,
}

/// Where in its life an operation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Started.
    Invoke,
    /// Succeeded.
    Ok,
    /// Failed with a definite answer (nothing changed).
    Fail,
    /// Outcome unknown (cancelled, reply lost).
    Unknown,
}

/// One entry of a [`History`].
#[derive(Debug, Clone, Copy)]
pub struct Event {
    /// Who.
    pub client: usize,
    /// Which operation.
    pub op: Op,
    /// Which phase.
    pub phase: Phase,
    /// The token, for `Acquire`/`Ok` and the ends of a hold.
    pub token: Option<FencingToken>,
    /// When, on the test's one monotonic clock.
    pub at: Instant,
}

/// A hold interval derived from a history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval {
    /// The holder.
    pub client: usize,
    /// Its token.
    pub token: FencingToken,
    /// When its acquire was invoked.
    pub invoked: Instant,
    /// When its acquire returned.
    pub start: Instant,
    /// When it stopped believing it held the lock (`None`: still holding).
    pub end: Option<Instant>,
}

/// A thread-safe history of lock operations, all for one lock name.
#[derive(Debug, Default)]
pub struct History {
    events: Mutex<Vec<Event>>,
}

impl History {
    /// An empty history.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records an event now.
    pub fn record(&self, client: usize, op: Op, phase: Phase, token: Option<FencingToken>) {
        self.push(Event {
            client,
            op,
            phase,
            token,
            at: Instant::now(),
        });
    }

    /// Records an event with an explicit time (for tests of the checker).
    pub fn push(&self, event: Event) {
        self.events.lock().unwrap().push(event);
    }

    /// All events so far, in time order.
    pub fn events(&self) -> Vec<Event> {
        let mut events = self.events.lock().unwrap().clone();
        events.sort_by_key(|e| e.at);
        events
    }

    /// The hold intervals: from an acquire's `Ok` to the same client's next
    /// `Release`/`Invoke` or `Lost`/`Ok`, whichever comes first.
    pub fn intervals(&self) -> Vec<Interval> {
        let mut open: HashMap<usize, (Instant, Option<Interval>)> = HashMap::new();
        let mut done = Vec::new();
        for e in self.events() {
            match (e.op, e.phase) {
                (Op::Acquire, Phase::Invoke) => {
                    let entry = open.entry(e.client).or_insert((e.at, None));
                    entry.0 = e.at;
                }
                (Op::Acquire, Phase::Ok) => {
                    let entry = open.entry(e.client).or_insert((e.at, None));
                    if let Some(prev) = entry.1.take() {
                        done.push(prev); // reacquired without a recorded end
                    }
                    entry.1 = Some(Interval {
                        client: e.client,
                        token: e.token.unwrap_or(FencingToken::new(0)),
                        invoked: entry.0,
                        start: e.at,
                        end: None,
                    });
                }
                (Op::Release, Phase::Invoke) | (Op::Lost, Phase::Ok) => {
                    if let Some((_, Some(mut iv))) = open.remove(&e.client) {
                        iv.end = Some(e.at);
                        done.push(iv);
                    }
                }
                _ => {}
            }
        }
        done.extend(open.into_values().filter_map(|(_, iv)| iv));
        done.sort_by_key(|iv| iv.start);
        done
    }

    /// Checks mutual exclusion (S1) and grant order (S2) over the history.
    pub fn check(&self) -> Result<Summary, Violation> {
        let intervals = self.intervals();
        check_overlap(&intervals)?;
        check_grant_order(&intervals)?;
        let mut tokens: Vec<_> = intervals.iter().map(|iv| iv.token).collect();
        tokens.sort();
        if let Some(w) = tokens.windows(2).find(|w| w[0] == w[1]) {
            return Err(Violation::ReusedToken(w[0]));
        }
        Ok(Summary {
            holds: intervals.len(),
        })
    }
}

/// What a passing check saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// Hold intervals checked.
    pub holds: usize,
}

/// A safety violation found in a history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// Two hold intervals overlap (S1).
    Overlap(Box<[Interval; 2]>),
    /// A acquired before B was invoked, yet B's token is not larger (S2).
    GrantOrder(Box<[Interval; 2]>),
    /// A token was handed out twice (S2).
    ReusedToken(FencingToken),
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::Overlap(pair) => {
                let [a, b] = &**pair;
                let overlap = a
                    .end
                    .map_or(Duration::MAX, |e| e.saturating_duration_since(b.start));
                write!(
                    f,
                    "S1 violated: client {} (token {}) and client {} (token {}) held at once for {overlap:?}",
                    a.client, a.token, b.client, b.token
                )
            }
            Violation::GrantOrder(pair) => {
                let [a, b] = &**pair;
                write!(
                    f,
                    "S2 violated: client {} got token {} before client {} asked, yet client {} got token {}",
                    a.client, a.token, b.client, b.client, b.token
                )
            }
            Violation::ReusedToken(t) => write!(f, "S2 violated: token {t} was issued twice"),
        }
    }
}

impl std::error::Error for Violation {}

/// Counts of what a long history broke (the soak reports counts; the cases
/// stop at the first violation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Audit {
    /// Hold intervals.
    pub holds: usize,
    /// Intervals that overlap an earlier one (S1).
    pub overlaps: usize,
    /// Intervals whose token is not larger than that of a hold that started
    /// before they were invoked (S2).
    pub out_of_order: usize,
    /// Tokens issued more than once (S2).
    pub reused_tokens: usize,
}

impl Audit {
    /// Audits `intervals`.
    pub fn of(intervals: &[Interval]) -> Self {
        let mut sorted = intervals.to_vec();
        sorted.sort_by_key(|iv| iv.start);
        // Overlaps: an interval starting before the furthest end so far.
        let mut furthest: Option<Option<Instant>> = None;
        let mut overlaps = 0;
        for iv in &sorted {
            if let Some(end) = furthest
                && end.is_none_or(|end| iv.start < end)
            {
                overlaps += 1;
            }
            furthest = Some(match (furthest, iv.end) {
                (None, e) => e,
                (Some(None), _) | (_, None) => None,
                (Some(Some(a)), Some(b)) => Some(a.max(b)),
            });
        }
        let mut highest = Vec::with_capacity(sorted.len());
        for iv in &sorted {
            let best = highest
                .last()
                .map_or(iv.token, |&h: &FencingToken| h.max(iv.token));
            highest.push(best);
        }
        let out_of_order = sorted
            .iter()
            .filter(|b| {
                let n = sorted.partition_point(|a| a.start < b.invoked);
                n > 0 && highest[n - 1] >= b.token
            })
            .count();
        let mut tokens: Vec<_> = sorted.iter().map(|iv| iv.token).collect();
        tokens.sort();
        let reused_tokens = tokens.windows(2).filter(|w| w[0] == w[1]).count();
        Self {
            holds: sorted.len(),
            overlaps,
            out_of_order,
            reused_tokens,
        }
    }
}

/// Fails if any two intervals overlap (sorted by start).
pub fn check_overlap(intervals: &[Interval]) -> Result<(), Violation> {
    let mut sorted = intervals.to_vec();
    sorted.sort_by_key(|iv| iv.start);
    // Without overlap every start is at or after every earlier end, so the
    // furthest end so far is simply the previous interval's.
    let mut previous: Option<Interval> = None;
    for iv in sorted {
        if let Some(prev) = previous
            && prev.end.is_none_or(|end| iv.start < end)
        {
            return Err(Violation::Overlap(Box::new([prev, iv])));
        }
        previous = Some(iv);
    }
    Ok(())
}

/// Fails if an acquisition that returned before another was invoked has a
/// token that is not smaller.
pub fn check_grant_order(intervals: &[Interval]) -> Result<(), Violation> {
    let mut by_start = intervals.to_vec();
    by_start.sort_by_key(|iv| iv.start);
    // prefix_max[i]: the interval with the highest token among by_start[..=i].
    let mut prefix_max: Vec<Interval> = Vec::with_capacity(by_start.len());
    for iv in &by_start {
        let best = match prefix_max.last() {
            Some(prev) if prev.token >= iv.token => *prev,
            _ => *iv,
        };
        prefix_max.push(best);
    }
    for b in &by_start {
        // Intervals that started strictly before b was invoked.
        let n = by_start.partition_point(|a| a.start < b.invoked);
        if n == 0 {
            continue;
        }
        let a = prefix_max[n - 1];
        if a.token >= b.token {
            return Err(Violation::GrantOrder(Box::new([a, *b])));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audit_counts_what_check_finds() {
        let base = Instant::now();
        let h = History::new();
        hold(&h, base, 0, 1, 0, Some(10));
        hold(&h, base, 1, 2, 5, Some(20)); // overlaps 0
        hold(&h, base, 2, 2, 30, Some(40)); // reuses token 2, out of order
        hold(&h, base, 3, 5, 50, Some(60));
        let audit = Audit::of(&h.intervals());
        assert_eq!(
            audit,
            Audit {
                holds: 4,
                overlaps: 1,
                out_of_order: 1,
                reused_tokens: 1
            }
        );
        assert!(h.check().is_err());
    }

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    fn hold(h: &History, base: Instant, client: usize, token: u64, from: u64, to: Option<u64>) {
        h.push(Event {
            client,
            op: Op::Acquire,
            phase: Phase::Invoke,
            token: None,
            at: at(base, from),
        });
        h.push(Event {
            client,
            op: Op::Acquire,
            phase: Phase::Ok,
            token: Some(FencingToken::new(token)),
            at: at(base, from + 1),
        });
        if let Some(to) = to {
            h.push(Event {
                client,
                op: Op::Release,
                phase: Phase::Invoke,
                token: None,
                at: at(base, to),
            });
        }
    }

    #[test]
    fn accepts_a_clean_history() {
        let base = Instant::now();
        let h = History::new();
        hold(&h, base, 0, 1, 0, Some(10));
        hold(&h, base, 1, 2, 11, Some(20));
        hold(&h, base, 0, 3, 21, None);
        assert_eq!(h.check().unwrap().holds, 3);
    }

    #[test]
    fn finds_overlapping_holds() {
        let base = Instant::now();
        let h = History::new();
        hold(&h, base, 0, 1, 0, Some(10));
        hold(&h, base, 1, 2, 5, Some(20));
        assert!(
            matches!(h.check(), Err(Violation::Overlap(..))),
            "{:?}",
            h.check()
        );
    }

    #[test]
    fn finds_overlap_with_an_open_hold() {
        let base = Instant::now();
        let h = History::new();
        hold(&h, base, 0, 1, 0, None);
        hold(&h, base, 1, 2, 50, Some(60));
        assert!(matches!(h.check(), Err(Violation::Overlap(..))));
    }

    #[test]
    fn finds_overlap_hidden_behind_a_short_hold() {
        // A long hold, a short one inside it, then one after the short one
        // ended but before the long one did.
        let intervals = [Interval {
            client: 0,
            token: FencingToken::new(1),
            invoked: at(Instant::now(), 0),
            start: at(Instant::now(), 0),
            end: None,
        }];
        assert!(check_overlap(&intervals).is_ok());
        let base = Instant::now();
        let h = History::new();
        hold(&h, base, 0, 1, 0, Some(100));
        hold(&h, base, 1, 2, 10, Some(20));
        hold(&h, base, 2, 3, 30, Some(40));
        assert!(matches!(h.check(), Err(Violation::Overlap(..))));
    }

    #[test]
    fn lost_ends_an_interval() {
        let base = Instant::now();
        let h = History::new();
        hold(&h, base, 0, 1, 0, None);
        h.push(Event {
            client: 0,
            op: Op::Lost,
            phase: Phase::Ok,
            token: None,
            at: at(base, 10),
        });
        hold(&h, base, 1, 2, 11, Some(20));
        assert!(h.check().is_ok());
    }

    #[test]
    fn finds_stale_tokens_in_grant_order() {
        let base = Instant::now();
        let h = History::new();
        hold(&h, base, 0, 5, 0, Some(10));
        hold(&h, base, 1, 4, 11, Some(20)); // later grant, smaller token
        assert!(matches!(h.check(), Err(Violation::GrantOrder(..))));
    }

    #[test]
    fn finds_reused_tokens() {
        let base = Instant::now();
        let h = History::new();
        hold(&h, base, 0, 5, 0, Some(10));
        // Invoked before the first returned, so grant order cannot tell.
        h.push(Event {
            client: 1,
            op: Op::Acquire,
            phase: Phase::Invoke,
            token: None,
            at: at(base, 0),
        });
        h.push(Event {
            client: 1,
            op: Op::Acquire,
            phase: Phase::Ok,
            token: Some(FencingToken::new(5)),
            at: at(base, 11),
        });
        h.push(Event {
            client: 1,
            op: Op::Release,
            phase: Phase::Invoke,
            token: None,
            at: at(base, 12),
        });
        assert_eq!(h.check(), Err(Violation::ReusedToken(FencingToken::new(5))));
    }

    #[test]
    fn register_refuses_older_tokens() {
        let r = FencedRegister::new();
        assert!(r.write(0, FencingToken::new(3)));
        assert!(r.write(0, FencingToken::new(3)));
        assert!(!r.write(1, FencingToken::new(2)));
        assert_eq!((r.accepted(), r.rejections()), (2, 1));
        assert!(r.check().unwrap_err().contains("token 2 after 3"));
    }
}
