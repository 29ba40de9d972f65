//! The `dlock torture` table: Markdown for people, JSON for tools.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use dlock_conformance::checker::Audit;
use serde_json::{Value, json};

use super::Profile;
use crate::cli::TortureArgs;

/// The outcome of one profile on one backend.
pub(crate) struct Row {
    pub(crate) backend: String,
    pub(crate) profile: Profile,
    /// Why the profile did not run, if it did not.
    pub(crate) skipped: Option<&'static str>,
    pub(crate) acquisitions: u64,
    pub(crate) seconds: f64,
    pub(crate) writes_accepted: u64,
    pub(crate) stale_writes_refused: u64,
    pub(crate) audit: Audit,
    pub(crate) lost_signals: u64,
    pub(crate) errors: u64,
    pub(crate) sessions_replaced: u64,
    pub(crate) faults: u64,
    pub(crate) max_unavailable: Duration,
    pub(crate) p50_unavailable: Duration,
    pub(crate) first_error: Option<String>,
    /// The first failed server command of the nemesis, if any.
    pub(crate) first_server_error: Option<String>,
    /// Why the servers could not be brought back after the profile.
    pub(crate) servers_left_down: Option<String>,
    /// Why the profile could not start (its clients' first sessions).
    pub(crate) not_started: Option<String>,
}

impl Row {
    pub(crate) fn skipped(backend: &str, profile: Profile, why: &'static str) -> Self {
        Self {
            backend: backend.to_owned(),
            profile,
            skipped: Some(why),
            acquisitions: 0,
            seconds: 0.0,
            writes_accepted: 0,
            stale_writes_refused: 0,
            audit: Audit::default(),
            lost_signals: 0,
            errors: 0,
            sessions_replaced: 0,
            faults: 0,
            max_unavailable: Duration::ZERO,
            p50_unavailable: Duration::ZERO,
            first_error: None,
            first_server_error: None,
            servers_left_down: None,
            not_started: None,
        }
    }

    /// A profile whose clients could not open their first sessions: a
    /// failed row, so that the other profiles' rows are still reported.
    pub(crate) fn not_started(backend: &str, profile: Profile, why: String) -> Self {
        Self {
            skipped: None,
            not_started: Some(why),
            ..Self::skipped(backend, profile, "")
        }
    }

    /// Tokens out of grant order or reused: the register could not have
    /// told a newer holder from an older one (S2).
    fn register_violations(&self) -> usize {
        self.audit.out_of_order + self.audit.reused_tokens
    }

    /// What is wrong with this row, if anything.
    pub(crate) fn verdict(&self, target: u64) -> Result<&'static str, String> {
        if let Some(why) = self.skipped {
            return Ok(why);
        }
        if let Some(why) = &self.not_started {
            return Err(format!("the clients could not start: {why}"));
        }
        if let Some(why) = &self.servers_left_down {
            return Err(format!("the servers could not be brought back: {why}"));
        }
        if self.register_violations() > 0 {
            return Err(format!(
                "{} tokens out of grant order, {} reused (S2)",
                self.audit.out_of_order, self.audit.reused_tokens
            ));
        }
        if self.audit.overlaps > 0 {
            return match self.profile.overlaps_by_design(&self.backend) {
                Some(why) => Ok(why),
                None => Err(format!("{} overlapping holds (S1/S4)", self.audit.overlaps)),
            };
        }
        if self.acquisitions < target {
            return Err(format!(
                "only {} of {target} acquisitions before the time limit",
                self.acquisitions
            ));
        }
        Ok("ok")
    }

    /// One progress line.
    pub(crate) fn summary(&self) -> String {
        if let Some(why) = &self.not_started {
            return format!("  {}: could not start: {why}", self.profile.name());
        }
        let line = match self.skipped {
            Some(why) => format!("  {}: skipped ({why})", self.profile.name()),
            None => format!(
                "  {}: {} acquisitions in {:.1} s, {} faults, {} overlaps, {} register violations, \
                 {} stale writes refused, {} lost, max unavailable {:?}",
                self.profile.name(),
                self.acquisitions,
                self.seconds,
                self.faults,
                self.audit.overlaps,
                self.register_violations(),
                self.stale_writes_refused,
                self.lost_signals,
                self.max_unavailable
            ),
        };
        // (what a profile cut short by the time limit saw first)
        match &self.first_error {
            Some(e) if self.skipped.is_none() => {
                format!("{line}, {} errors (first: {e})", self.errors)
            }
            _ => line,
        }
    }
}

/// Every row of one run, with the settings that produced it.
pub(crate) struct Table {
    args: TortureArgs,
    command: String,
    rows: Vec<Row>,
}

impl Table {
    pub(crate) fn new(args: TortureArgs, command: String) -> Self {
        Self {
            args,
            command,
            rows: Vec::new(),
        }
    }

    pub(crate) fn push(&mut self, row: Row) {
        self.rows.push(row);
    }

    /// Whether any row fails its checks.
    pub(crate) fn failed(&self) -> bool {
        self.rows
            .iter()
            .any(|r| r.verdict(self.args.acquisitions).is_err())
    }

    pub(crate) fn markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "`{}` ({} clients on one lock, TTL {}, {} acquisitions per profile)\n",
            self.command,
            self.args.clients,
            humantime::format_duration(self.args.ttl),
            self.args.acquisitions
        );
        out.push_str(
            "| backend | profile | acquisitions | acq/s | faults | register violations | overlaps | stale writes refused | lost signals | max / p50 unavailable after a loss | errors | verdict |\n\
             |---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|\n",
        );
        for r in &self.rows {
            let verdict = match r.verdict(self.args.acquisitions) {
                Ok(v) => v.to_owned(),
                Err(e) => format!("**FAILED**: {e}"),
            };
            if r.skipped.is_some() {
                let _ = writeln!(
                    out,
                    "| {} | {} | – | – | – | – | – | – | – | – | – | not run: {verdict} |",
                    r.backend,
                    r.profile.name()
                );
                continue;
            }
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} / {} | {} | {verdict} |",
                r.backend,
                r.profile.name(),
                r.acquisitions,
                r.acquisitions as f64 / r.seconds.max(1e-9),
                r.faults,
                r.register_violations(),
                r.audit.overlaps,
                r.stale_writes_refused,
                r.lost_signals,
                ms(r.max_unavailable),
                ms(r.p50_unavailable),
                r.errors,
            );
        }
        out
    }

    pub(crate) fn json(&self) -> Value {
        let rows: Vec<Value> = self
            .rows
            .iter()
            .map(|r| {
                json!({
                    "backend": r.backend,
                    "profile": r.profile.name(),
                    "skipped": r.skipped,
                    "acquisitions": r.acquisitions,
                    "seconds": r.seconds,
                    "faults": r.faults,
                    "writes_accepted": r.writes_accepted,
                    "stale_writes_refused": r.stale_writes_refused,
                    "holds": r.audit.holds,
                    "overlaps": r.audit.overlaps,
                    "tokens_out_of_order": r.audit.out_of_order,
                    "tokens_reused": r.audit.reused_tokens,
                    "lost_signals": r.lost_signals,
                    "errors": r.errors,
                    "first_error": r.first_error,
                    "first_server_error": r.first_server_error,
                    "servers_left_down": r.servers_left_down,
                    "not_started": r.not_started,
                    "sessions_replaced": r.sessions_replaced,
                    "max_unavailable_ms": r.max_unavailable.as_secs_f64() * 1e3,
                    "p50_unavailable_ms": r.p50_unavailable.as_secs_f64() * 1e3,
                    "verdict": match r.verdict(self.args.acquisitions) {
                        Ok(v) => v.to_owned(),
                        Err(e) => format!("FAILED: {e}"),
                    },
                })
            })
            .collect();
        json!({
            "command": self.command,
            "clients": self.args.clients,
            "ttl_ms": self.args.ttl.as_millis() as u64,
            "acquisitions_per_profile": self.args.acquisitions,
            "rows": rows,
        })
    }

    /// Writes `torture.md` and `torture.json` into `dir`.
    pub(crate) fn write(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("torture.md"), self.markdown())?;
        std::fs::write(
            dir.join("torture.json"),
            serde_json::to_string_pretty(&self.json()).unwrap_or_default(),
        )
    }
}

fn ms(d: Duration) -> String {
    if d.is_zero() {
        "–".to_owned()
    } else {
        format!("{} ms", d.as_millis())
    }
}
