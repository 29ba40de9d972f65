//! `dlock bench`: the same workloads on every backend given, in one run
//! (DESIGN.md §8), reported as a Markdown table, a JSON file and an SVG chart.
//!
//! Order of events: connect every client of every backend (so an unreachable
//! backend fails the run before anything is measured), then run the phases
//! one at a time across the backends: the latency phases round-robin (every
//! backend does one ping, one acquire+release and one raw floor cycle per
//! round; then one plain and one fenced write), the contended phases backend by backend (dlock's hot lock in
//! turns with the store's own lock under the same contention). Then close the sessions, write
//! `<out>/bench.{md,json,svg}` and print the table (or the JSON).

mod chart;
mod fencing;
mod holds;
mod phases;
mod primitives;
mod report;
mod stats;

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{self, IsTerminal};
use std::path::Path;
use std::time::{Duration, SystemTime};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use self::phases::Target;
use self::report::{BackendReport, Report, Settings};
use crate::admin::print;
use crate::cli::BenchArgs;
use crate::exit::{FAILURE, Failure};

/// Unmeasured latency rounds before the measured ones: a tenth of them,
/// between 1 and this many.
const MAX_WARMUP: u64 = 100;

/// Runs `dlock bench` on `urls`; returns the exit status.
///
/// The work runs in a task on the runtime's worker threads, as an
/// application's would: from `block_on`'s thread every wake-up (I/O, the
/// core's release task) would add a hop between threads to each sample.
pub(crate) async fn bench(urls: &[String], args: BenchArgs) -> Result<u8, Failure> {
    let urls = urls.to_vec();
    tokio::spawn(async move { measure(&urls, args).await })
        .await
        .map_err(|e| Failure::new(FAILURE, format!("the benchmark task failed: {e}")))?
}

/// [`bench()`], on a worker thread.
async fn measure(urls: &[String], args: BenchArgs) -> Result<u8, Failure> {
    let command = command_line(std::env::args_os());
    let date = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let progress = Progress::new(!args.quiet && io::stderr().is_terminal());
    let clients = usize::try_from(args.clients).unwrap_or(usize::MAX);
    let run = format!("bench/{:016x}", rand::random::<u64>());

    let mut targets = Vec::with_capacity(urls.len());
    let connecting = progress.bar(urls.len() as u64, "connecting", "");
    for (i, url) in urls.iter().enumerate() {
        connecting.set_message(dlock_core::url::redact(url));
        // A wait for the store (its restart guard) is a note: none under
        // --quiet, and never drawn over the bar.
        let say = |note: &str| {
            if !args.quiet {
                connecting.suspend(|| eprintln!("{note}"));
            }
        };
        let prefix = format!("{run}/{i}");
        targets.push(Target::connect(url, clients, args.ttl, prefix, &say).await?);
        connecting.inc(1);
    }
    connecting.finish_and_clear();
    unique_labels(&mut targets);

    let warmup = (args.cycles / 10).clamp(1, MAX_WARMUP);
    let bar = progress.bar(
        warmup + args.cycles,
        "latency",
        &format!("{} backend(s), ping + acquire/release", targets.len()),
    );
    let latency = phases::latency(&targets, warmup, args.cycles, &bar).await?;
    bar.finish();
    let bar = progress.bar(
        warmup + args.cycles,
        "fencing",
        "plain write / fenced write",
    );
    let fenced_writes = fencing::fenced_writes(&targets, warmup, args.cycles, &bar).await?;
    bar.finish();

    let phase_ms = phases::millis(args.duration);
    let mut hot = Vec::with_capacity(targets.len());
    for t in &targets {
        let bar = progress.bar(phase_ms, "hot lock", &contended(t));
        hot.push(phases::hot_lock(t, args.duration, &bar).await?);
        bar.finish();
    }
    let mut independent = Vec::with_capacity(targets.len());
    for t in &targets {
        let bar = progress.bar(phase_ms, "independent", &contended(t));
        independent.push(phases::independent(t, args.duration, &bar).await?);
        bar.finish();
    }
    let mut primitives = Vec::with_capacity(targets.len());
    for t in &targets {
        let bar = progress.bar(phase_ms, "primitives", &contended(t));
        let p = primitives::primitives(t, args.duration, args.failovers, &bar).await?;
        bar.finish();
        primitives.push(p);
    }
    let mut many = Vec::with_capacity(targets.len());
    for t in &targets {
        if args.holds == 0 {
            many.push(None);
            continue;
        }
        let holds = usize::try_from(args.holds).unwrap_or(usize::MAX);
        let bar = progress.bar(args.holds, "holds", &format!("{} ({holds} locks)", t.label));
        many.push(Some(holds::many_holds(t, holds, args.ttl, &bar).await?));
        bar.finish();
    }
    for t in &targets {
        t.close().await;
    }

    let backends = targets
        .iter()
        .zip(latency.into_iter().zip(fenced_writes).zip(primitives))
        .zip(hot.into_iter().zip(independent).zip(many))
        .map(
            |((t, ((latency, fenced_writes), primitives)), ((hot, independent), many_holds))| {
                let phases::HotLockPhase {
                    dlock: hot_lock,
                    safety,
                    native: native_lock,
                } = hot;
                let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
                    (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                    _ => None,
                };
                let take = latency.acquire_release.map(|l| l.p50_us);
                let floor = latency
                    .floor
                    .as_ref()
                    .and_then(|f| f.latency)
                    .map(|l| l.p50_us);
                let native_lock = native_lock.map(|mut n| {
                    n.dlock_handoffs_x_native = ratio(
                        Some(hot_lock.handoffs_per_s),
                        Some(n.hot_lock.handoffs_per_s),
                    );
                    n
                });
                BackendReport {
                    backend: t.label.clone(),
                    url: t.url.clone(),
                    acquire_release_x_baseline: ratio(take, latency.baseline.map(|l| l.p50_us)),
                    acquire_release_x_floor: ratio(take, floor),
                    baseline: latency.baseline,
                    acquire_release: latency.acquire_release,
                    floor: latency.floor,
                    hot_lock,
                    native_lock,
                    independent,
                    many_holds,
                    fenced_writes,
                    primitives,
                    safety,
                }
            },
        )
        .collect();
    let report = Report {
        command,
        date,
        settings: Settings {
            clients,
            cycles: args.cycles,
            warmup_cycles: warmup,
            duration_ms: phase_ms,
            ttl_ms: phases::millis(args.ttl),
            holds: args.holds,
        },
        backends,
    };

    let json = serde_json::to_string_pretty(&report)
        .map(|s| s + "\n")
        .map_err(|e| Failure::new(FAILURE, format!("cannot encode JSON: {e}")))?;
    let svg = chart::svg(&report).map_err(|e| Failure::new(FAILURE, e))?;
    write(&args.out, "bench.md", &report::markdown(&report))?;
    write(&args.out, "bench.json", &json)?;
    write(&args.out, "bench.svg", &svg)?;
    let mut stdout = report::table(&report);
    let notes = report::notes(&report);
    if !notes.is_empty() {
        stdout = format!("{stdout}\n{notes}");
    }
    print(if args.json { &json } else { &stdout })?;
    if !args.quiet {
        eprintln!(
            "dlock bench: wrote {}",
            args.out.join("bench.{md,json,svg}").display()
        );
    }

    for b in &report.backends {
        primitives::check(&b.backend, &b.primitives)?;
    }
    let failed: Vec<_> = (report.backends.iter())
        .filter(|b| !b.safety.ok())
        .map(|b| format!("{}: {}", b.backend, b.safety.verdict))
        .collect();
    if failed.is_empty() {
        Ok(0)
    } else {
        Err(Failure::new(
            FAILURE,
            format!("safety check failed: {}", failed.join("; ")),
        ))
    }
}

/// The message of a contended phase's bar.
fn contended(t: &Target) -> String {
    format!("{} ({} clients)", t.label, t.clients())
}

/// Makes repeated labels unique: `postgres`, `postgres#2`, ...
fn unique_labels(targets: &mut [Target]) {
    let mut seen: HashMap<String, usize> = HashMap::new();
    for t in targets {
        let n = seen.entry(t.label.clone()).or_default();
        *n += 1;
        if *n > 1 {
            t.label = format!("{}#{n}", t.label);
        }
    }
}

/// A command line (`args` as `std::env::args_os` gives them) as one
/// shell-quoted line, with `dlock` for the program and every password
/// redacted.
pub(crate) fn command_line(args: impl IntoIterator<Item = OsString>) -> String {
    std::iter::once("dlock".to_owned())
        .chain(
            args.into_iter()
                .skip(1)
                .map(|a| shell_quote(&redact_arg(&a.to_string_lossy()))),
        )
        .collect::<Vec<_>>()
        .join(" ")
}

/// An argument with any password hidden: a whole URL, or the value of
/// `--flag=URL`. (Plain words are not URLs and pass unchanged.)
fn redact_arg(arg: &str) -> String {
    match arg.split_once('=') {
        Some((flag, value)) if flag.starts_with("--") && !flag.contains(':') => {
            format!("{flag}={}", dlock_core::url::redact(value))
        }
        _ => dlock_core::url::redact(arg),
    }
}

/// `word` as a POSIX shell would need it: bare if it is plain, else in
/// single quotes.
fn shell_quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=@%+,".contains(c));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Writes `dir/file`, creating `dir`.
fn write(dir: &Path, file: &str, text: &str) -> Result<(), Failure> {
    let path = dir.join(file);
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&path, text))
        .map_err(|e| Failure::new(FAILURE, format!("cannot write {}: {e}", path.display())))
}

/// Progress bars on stderr, or none (`--quiet`, or stderr not a terminal).
struct Progress {
    /// Whether bars are drawn at all.
    visible: bool,
}

impl Progress {
    /// Bars that are drawn if `visible`.
    fn new(visible: bool) -> Self {
        Self { visible }
    }

    /// A bar of `len` steps labelled `phase` and `message`.
    fn bar(&self, len: u64, phase: &str, message: &str) -> ProgressBar {
        if !self.visible {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template(
            "{prefix:>12} {msg:<32} [{bar:30}] {percent:>3}% {elapsed:>4}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(phase.to_owned());
        bar.set_message(message.to_owned());
        bar.enable_steady_tick(Duration::from_millis(250));
        bar
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("--url"), "--url");
        assert_eq!(shell_quote("memory://"), "memory://");
        assert_eq!(
            shell_quote("redlock://h1,h2?max_ttl=30s"),
            "'redlock://h1,h2?max_ttl=30s'"
        );
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn command_line_hides_passwords() {
        let args = [
            "/x/target/release/dlock",
            "bench",
            "--url",
            "postgres://app:s3cret@db/x",
            "--url=mysql://u:pw@h/d",
        ]
        .map(OsString::from);
        assert_eq!(
            command_line(args),
            "dlock bench --url 'postgres://app:***@db/x' '--url=mysql://u:***@h/d'"
        );
    }
}
