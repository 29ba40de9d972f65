//! The results of a run (serialized as `bench.json`) and their Markdown
//! rendering (the table on stdout and `bench.md`).

use std::fmt::Write as _;

use serde::Serialize;

use super::fencing::FencedWrites;
use super::holds::ManyHolds;
use super::stats::Latency;

/// Everything one `dlock bench` run measured.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    /// The command line, passwords redacted.
    pub(crate) command: String,
    /// When the run started (RFC 3339, UTC).
    pub(crate) date: String,
    /// The workload settings.
    pub(crate) settings: Settings,
    /// One entry per `--url`, in the order given.
    pub(crate) backends: Vec<BackendReport>,
}

/// The workload settings of a run.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Settings {
    /// Clients per backend.
    pub(crate) clients: usize,
    /// Measured latency cycles per backend.
    pub(crate) cycles: u64,
    /// Unmeasured cycles before them.
    pub(crate) warmup_cycles: u64,
    /// Length of each contended phase, in milliseconds.
    pub(crate) duration_ms: u64,
    /// Session TTL, in milliseconds.
    pub(crate) ttl_ms: u64,
    /// Locks one session held in phase 6 (0: skipped).
    pub(crate) holds: u64,
}

/// The results for one backend.
#[derive(Debug, Serialize)]
pub(crate) struct BackendReport {
    /// Short label: the backend's scheme (`#2`, `#3` added for repeats).
    pub(crate) backend: String,
    /// The URL, password redacted.
    pub(crate) url: String,
    /// Phase 1: one raw round trip (`Backend::ping`).
    pub(crate) baseline: Option<Latency>,
    /// Phase 2: acquire + release of a free lock.
    pub(crate) acquire_release: Option<Latency>,
    /// Phase 2's p50 divided by phase 1's.
    pub(crate) acquire_release_x_baseline: Option<f64>,
    /// Phase 2: the store's raw take + release, if its adapter has a floor.
    pub(crate) floor: Option<FloorReport>,
    /// Phase 2's p50 divided by the floor's.
    pub(crate) acquire_release_x_floor: Option<f64>,
    /// Phase 3.
    pub(crate) hot_lock: HotLock,
    /// Phase 3 on the store's own lock, if it has one.
    pub(crate) native_lock: Option<NativeReport>,
    /// Phase 4.
    pub(crate) independent: Independent,
    /// Phase 6: many locks held by one session (`None`: skipped).
    pub(crate) many_holds: Option<ManyHolds>,
    /// Phase 7: a plain write against the fenced writer's (`None`: the
    /// adapter has no fenced writer).
    pub(crate) fenced_writes: Option<FencedWrites>,
    /// Phase 8: a semaphore's throughput and planned leader failovers.
    pub(crate) primitives: super::primitives::Primitives,
    /// Phase 5: the checker's verdict over phase 3.
    pub(crate) safety: Safety,
}

/// Phase 2's floor: the fewest requests a take + release needs on the store.
#[derive(Debug, Serialize)]
pub(crate) struct FloorReport {
    /// What one raw cycle sends.
    pub(crate) operations: String,
    /// Its latency, interleaved with the pings and dlock's cycles.
    pub(crate) latency: Option<Latency>,
}

/// Phase 3 on the store's own lock.
#[derive(Debug, Serialize)]
pub(crate) struct NativeReport {
    /// Which lock (`"pg_advisory_lock"`).
    pub(crate) lock: String,
    /// The same figures as dlock's hot lock (no tokens, so no safety check).
    pub(crate) hot_lock: HotLock,
    /// dlock's hot-lock handoffs/s divided by the native lock's.
    pub(crate) dlock_handoffs_x_native: Option<f64>,
}

/// Phase 3: all clients on one lock.
#[derive(Debug, Serialize)]
pub(crate) struct HotLock {
    /// Clients contending.
    pub(crate) clients: usize,
    /// How long the phase's counted turns ran (the hot lock: this side's
    /// turns, grants up to each turn's end).
    pub(crate) seconds: f64,
    /// Successful acquisitions.
    pub(crate) grants: u64,
    /// `grants / seconds`.
    pub(crate) grants_per_s: f64,
    /// Grants that went to a different client than the previous one.
    pub(crate) handoffs: u64,
    /// `handoffs / seconds`.
    pub(crate) handoffs_per_s: f64,
    /// From a release's invocation to the next grant returning to another
    /// client.
    pub(crate) release_to_grant: Option<Latency>,
    /// Grants per client.
    pub(crate) per_client: Vec<u64>,
    /// Fewest grants of a client.
    pub(crate) min: u64,
    /// Most grants of a client.
    pub(crate) max: u64,
    /// Jain's fairness index of `per_client` (1 = perfectly even).
    pub(crate) jain: f64,
    /// Store take attempts per grant, over all clients (1 = no retries);
    /// dlock only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) take_attempts_per_grant: Option<f64>,
    /// Waits for a wake-up or timer per grant, over all clients; dlock only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) waits_per_grant: Option<f64>,
    /// Failed acquires and releases (other than the final time-out).
    pub(crate) errors: u64,
    /// The first of them.
    pub(crate) first_error: Option<String>,
}

/// Phase 4: each client on its own lock.
#[derive(Debug, Serialize)]
pub(crate) struct Independent {
    /// Clients, one lock each.
    pub(crate) clients: usize,
    /// How long the phase ran.
    pub(crate) seconds: f64,
    /// Successful acquisitions, all clients together.
    pub(crate) acquisitions: u64,
    /// `acquisitions / seconds`.
    pub(crate) per_s: f64,
    /// Failed acquires and releases.
    pub(crate) errors: u64,
    /// The first of them.
    pub(crate) first_error: Option<String>,
}

/// Phase 5: the safety checker's verdict over the hot-lock history.
#[derive(Debug, Serialize)]
pub(crate) struct Safety {
    /// `"ok"`, or what was violated.
    pub(crate) verdict: String,
    /// Writes the fenced register accepted.
    pub(crate) register_accepted: usize,
    /// Writes it refused (a stale token: a violation).
    pub(crate) register_rejections: usize,
    /// Hold intervals the history check looked at.
    pub(crate) holds_checked: usize,
}

impl Safety {
    /// Whether the verdict is "ok".
    pub(crate) fn ok(&self) -> bool {
        self.verdict == "ok"
    }
}

/// The Markdown tables: one row per backend; then, if any backend has a
/// lock of its own, dlock's hot lock next to it.
pub(crate) fn table(report: &Report) -> String {
    let mut out = String::from(
        "| backend | baseline p50 | acquire+release p50 / p99 (×baseline) \
         | raw floor p50 / p99 (acquire+release ×floor) | hot-lock handoffs/s \
         | release→grant p50 / p99 | fairness min/max, Jain | independent acq/s | safety |\n\
         |---|--:|--:|--:|--:|--:|--:|--:|---|\n",
    );
    for b in &report.backends {
        let acquire = match (&b.acquire_release, b.acquire_release_x_baseline) {
            (Some(l), Some(x)) => format!("{} ({x:.1}×)", p50_p99(l)),
            (Some(l), None) => p50_p99(l),
            _ => "-".to_owned(),
        };
        let floor = match (
            b.floor.as_ref().and_then(|f| f.latency.as_ref()),
            b.acquire_release_x_floor,
        ) {
            (Some(l), Some(x)) => format!("{} ({x:.2}×)", p50_p99(l)),
            (Some(l), None) => p50_p99(l),
            _ => "-".to_owned(),
        };
        let h = &b.hot_lock;
        let safety = if b.safety.ok() {
            "ok".to_owned()
        } else {
            "**violation** (below)".to_owned()
        };
        let _ = writeln!(
            out,
            "| {} | {} | {acquire} | {floor} | {} | {} | {} | {} | {safety} |",
            b.backend,
            b.baseline
                .as_ref()
                .map_or_else(|| "-".to_owned(), |l| us(l.p50_us)),
            rate(h.handoffs_per_s),
            handoff(h),
            fairness(h),
            rate(b.independent.per_s),
        );
    }
    if report.backends.iter().any(|b| b.native_lock.is_some()) {
        out.push_str(
            "\n| backend | hot lock | handoffs/s (dlock ÷ native) | release→grant p50 / p99 \
             | fairness min/max, Jain | grants/s |\n|---|---|--:|--:|--:|--:|\n",
        );
        for b in &report.backends {
            let Some(n) = &b.native_lock else { continue };
            let ratio = n
                .dlock_handoffs_x_native
                .map_or_else(String::new, |x| format!(" ({x:.2}×)"));
            for (lock, h, ratio) in [
                ("dlock", &b.hot_lock, ratio.as_str()),
                (n.lock.as_str(), &n.hot_lock, ""),
            ] {
                let _ = writeln!(
                    out,
                    "| {} | {lock} | {}{ratio} | {} | {} | {} |",
                    b.backend,
                    rate(h.handoffs_per_s),
                    handoff(h),
                    fairness(h),
                    rate(h.grants_per_s),
                );
            }
        }
    }
    if report.backends.iter().any(|b| b.many_holds.is_some()) {
        out.push_str(
            "\n| backend | locks held by one session | acquired in | renewal round of one p50 \
             | of all p50 (÷ one) | client memory per held lock |\n|---|--:|--:|--:|--:|--:|\n",
        );
        for b in &report.backends {
            let Some(m) = &b.many_holds else { continue };
            let all = match (&m.renew_all, m.renew_all_x_one) {
                (Some(l), Some(x)) => format!("{} ({x:.1}×)", us(l.p50_us)),
                (Some(l), None) => us(l.p50_us),
                _ => "-".to_owned(),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {:.2} s | {} | {all} | {} |",
                b.backend,
                m.holds,
                m.acquire_s,
                m.renew_one
                    .as_ref()
                    .map_or_else(|| "-".to_owned(), |l| us(l.p50_us)),
                m.heap_bytes_per_hold
                    .map_or_else(|| "-".to_owned(), |b| format!("{:.2} KiB", b / 1024.0)),
            );
        }
    }
    if report.backends.iter().any(|b| b.fenced_writes.is_some()) {
        out.push_str(
            "\n| backend | plain write, against the fenced writer | plain p50 / p99 \
             | fenced p50 / p99 (× plain) |\n|---|---|--:|--:|\n",
        );
        for b in &report.backends {
            let Some(f) = &b.fenced_writes else { continue };
            let fenced = match (&f.fenced, f.fenced_x_plain) {
                (Some(l), Some(x)) => format!("{} ({x:.2}×)", p50_p99(l)),
                (Some(l), None) => p50_p99(l),
                _ => "-".to_owned(),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {fenced} |",
                b.backend,
                f.operations,
                f.plain.as_ref().map_or_else(|| "-".to_owned(), p50_p99),
            );
        }
    }
    out.push_str(
        "\n| backend | semaphore permits / clients | permit grants/s | most held at once \
         | planned failover (resign → next leader) p50 / p99 |\n|---|--:|--:|--:|--:|\n",
    );
    for b in &report.backends {
        let p = &b.primitives;
        let _ = writeln!(
            out,
            "| {} | {} / {} | {:.0} | {} | {} |",
            b.backend,
            p.permits,
            report.settings.clients,
            p.permit_grants_per_s,
            p.most_held,
            p.failover.as_ref().map_or_else(|| "-".to_owned(), p50_p99),
        );
    }
    out
}

/// `p50 / p99` of a latency.
fn p50_p99(l: &Latency) -> String {
    format!("{} / {}", us(l.p50_us), us(l.p99_us))
}

/// The release→grant cell of a contended phase.
fn handoff(h: &HotLock) -> String {
    h.release_to_grant
        .as_ref()
        .map_or_else(|| "-".to_owned(), p50_p99)
}

/// The fairness cell of a contended phase.
fn fairness(h: &HotLock) -> String {
    format!("{}/{}, {:.2}", h.min, h.max, h.jain)
}

/// Lines under the table for what the table cannot show: violations and
/// errors. Empty when there is nothing to say.
pub(crate) fn notes(report: &Report) -> String {
    let mut out = String::new();
    for b in &report.backends {
        if !b.safety.ok() {
            let _ = writeln!(out, "- {}: safety: {}", b.backend, b.safety.verdict);
        }
        let native = b.native_lock.as_ref().map(|n| &n.hot_lock);
        for (phase, errors, first) in [
            ("hot lock", b.hot_lock.errors, &b.hot_lock.first_error),
            (
                "native lock",
                native.map_or(0, |h| h.errors),
                &native.and_then(|h| h.first_error.clone()),
            ),
            (
                "independent locks",
                b.independent.errors,
                &b.independent.first_error,
            ),
            (
                "many holds",
                u64::from(b.many_holds.as_ref().is_some_and(|m| m.error.is_some())),
                &b.many_holds.as_ref().and_then(|m| m.error.clone()),
            ),
            (
                "fenced writes",
                u64::from(b.fenced_writes.as_ref().is_some_and(|f| f.error.is_some())),
                &b.fenced_writes.as_ref().and_then(|f| f.error.clone()),
            ),
            (
                "primitives",
                u64::from(b.primitives.error.is_some()),
                &b.primitives.error,
            ),
        ] {
            if errors > 0 {
                let _ = writeln!(
                    out,
                    "- {}: {errors} error(s) in the {phase} phase; first: {}",
                    b.backend,
                    first.as_deref().unwrap_or("?")
                );
            }
        }
    }
    out
}

/// The whole `bench.md`: command, date, settings, table, column notes.
pub(crate) fn markdown(report: &Report) -> String {
    let s = &report.settings;
    let mut out = format!(
        "# dlock bench\n\n\
         - command: `{}`\n\
         - date: {}\n\
         - settings: {} clients per backend (each its own connection and session), \
         {} latency cycles (+{} warm-up), {} per contended phase, session TTL {}\n\n",
        report.command,
        report.date,
        s.clients,
        s.cycles,
        s.warmup_cycles,
        ms(s.duration_ms),
        ms(s.ttl_ms),
    );
    out.push_str(&table(report));
    let notes = notes(report);
    if !notes.is_empty() {
        out.push('\n');
        out.push_str(&notes);
    }
    out.push_str(
        "\nbaseline: one raw round trip (`Backend::ping`: PING, `SELECT 1`). \
         acquire+release: a free lock, alternating with the pings cycle by cycle. \
         raw floor: the fewest requests a take + release needs on the same driver \
         (the adapter's `Floor`: e.g. SET NX PX + compare-and-DEL, an upsert + DELETE), \
         interleaved with both. \
         hot lock: all clients acquire, write a fenced register and release one lock; \
         a handoff is a grant to a different client than the previous holder, and \
         release→grant runs from the release's call to that grant's return. \
         fairness: fewest/most grants of a client and Jain's index (1 = even). \
         native: the store's own lock (pg_advisory_lock, GET_LOCK, etcd's lock service, \
         the ZooKeeper recipe) under the same contention, in turns with dlock's hot lock \
         (A B B A A B B A after an uncounted warm-up turn of each, each side the \
         phase's duration in all, grants and handoffs counted within a turn), so that \
         drift over the phase hits both. \
         independent: each client on its own lock. safety: fenced-register refusals \
         and the history check (overlapping holds, grant order) over dlock's hot-lock turns. \
         locks held by one session: one renewal round (what the renewal task sends each \
         period) of one hold and of all of them, and the client's live heap growth per held \
         lock. fenced writes: one small write of the protected data as a user would send it, \
         and the same write through the store's fenced writer (SqlFence, RedisFence, \
         EtcdFence, ZkFence, MongoFence) with an increasing token, alternating; the ratio \
         of their medians is what fencing the data adds. \
         primitives: every client takes and gives back permits of one semaphore with half as \
         many permits as clients (the most held at once must not exceed the permits), then \
         planned leader failovers between two clients: the time from the leader's `resign()` \
         call to the waiting candidate's grant (a crashed leader's failover is bounded by \
         the TTL plus the store's recovery bound instead: conformance case \
         `election_failover`).\n",
    );
    out
}

/// A latency given in microseconds, in a readable unit.
pub(crate) fn us(micros: f64) -> String {
    if micros < 10.0 {
        format!("{micros:.1} µs")
    } else if micros < 1_000.0 {
        format!("{micros:.0} µs")
    } else if micros < 10_000.0 {
        format!("{:.2} ms", micros / 1_000.0)
    } else {
        format!("{:.1} ms", micros / 1_000.0)
    }
}

/// A rate per second: whole numbers with thousands separators from 100 on.
pub(crate) fn rate(per_s: f64) -> String {
    if per_s < 100.0 {
        return format!("{per_s:.1}");
    }
    let digits = format!("{per_s:.0}");
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Milliseconds as humantime prints them (`10s`, `300ms`).
fn ms(millis: u64) -> String {
    humantime::format_duration(std::time::Duration::from_millis(millis)).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(us(0.42), "0.4 µs");
        assert_eq!(us(412.4), "412 µs");
        assert_eq!(us(2153.0), "2.15 ms");
        assert_eq!(us(12_345.0), "12.3 ms");
        assert_eq!(rate(42.26), "42.3");
        assert_eq!(rate(1234.4), "1,234");
        assert_eq!(rate(123_456_789.0), "123,456,789");
        assert_eq!(ms(300), "300ms");
    }
}
