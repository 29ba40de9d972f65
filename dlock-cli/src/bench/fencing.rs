//! Phase 7: what fencing the data costs. On each store whose adapter has a
//! fenced writer, one small write of the protected data without fencing and
//! the same write through the fenced writer (`SqlFence`, `RedisFence`, ...),
//! alternating write by write and backend by backend, so that noise hits
//! both alike; the ratio of their medians is what the fence adds.

use std::time::Duration;

use dlock_core::floor::FencedWrite;
use dlocks::{Error, FencingToken};
use indicatif::ProgressBar;
use serde::Serialize;
use tokio::time::{Instant, timeout};

use super::phases::Target;
use super::stats::{self, Latency};
use crate::exit::Failure;

/// The longest one write may take.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Phase 7's figures for one backend.
#[derive(Debug, Serialize)]
pub(crate) struct FencedWrites {
    /// What the two writes send.
    pub(crate) operations: String,
    /// The write without fencing.
    pub(crate) plain: Option<Latency>,
    /// The same write through the fenced writer.
    pub(crate) fenced: Option<Latency>,
    /// `fenced.p50 / plain.p50`.
    pub(crate) fenced_x_plain: Option<f64>,
    /// The first failure, which ended the measure on this backend.
    pub(crate) error: Option<String>,
}

/// One backend's measure in progress.
struct Measure<'a> {
    writer: &'a dyn FencedWrite,
    plain: hdrhistogram::Histogram<u64>,
    fenced: hdrhistogram::Histogram<u64>,
    error: Option<String>,
}

/// Phase 7 on every target that has a fenced writer (`None` for the
/// others): `warmup + cycles` rounds of one plain and one fenced write per
/// target, the order alternating from round to round. The bar counts rounds.
pub(crate) async fn fenced_writes(
    targets: &[Target],
    warmup: u64,
    cycles: u64,
    bar: &ProgressBar,
) -> Result<Vec<Option<FencedWrites>>, Failure> {
    let key = |t: &Target| t.lock_name("fenced");
    let mut measures = Vec::with_capacity(targets.len());
    for t in targets {
        let Some(writer) = t.floor().and_then(|f| f.fenced_write()) else {
            measures.push(None);
            continue;
        };
        let error = within(writer.prepare(&key(t)?)).await.err();
        measures.push(Some(Measure {
            writer,
            plain: stats::histogram(),
            fenced: stats::histogram(),
            error,
        }));
    }
    for round in 0..warmup + cycles {
        for (t, measure) in targets.iter().zip(&mut measures) {
            let Some(m) = measure.as_mut().filter(|m| m.error.is_none()) else {
                continue;
            };
            let key = key(t)?;
            // Tokens increase, so every fenced write is accepted.
            let token = FencingToken::new(round + 1);
            let mut took = [Duration::ZERO; 2];
            for step in 0..2 {
                let fenced = (step + round) % 2 == 1;
                let write = async {
                    let start = Instant::now();
                    if fenced {
                        m.writer.fenced(&key, token, round).await?;
                    } else {
                        m.writer.plain(&key, round).await?;
                    }
                    Ok(start.elapsed())
                };
                match within(write).await {
                    Ok(d) => took[usize::from(fenced)] = d,
                    Err(e) => {
                        m.error = Some(e);
                        break;
                    }
                }
            }
            if round >= warmup && m.error.is_none() {
                stats::record(&mut m.plain, took[0]);
                stats::record(&mut m.fenced, took[1]);
            }
        }
        bar.inc(1);
    }
    let mut reports = Vec::with_capacity(targets.len());
    for (t, measure) in targets.iter().zip(measures) {
        let Some(m) = measure else {
            reports.push(None);
            continue;
        };
        // The run's keys are its own: gone afterwards (a failure to remove
        // them is reported, not fatal).
        let removed = within(m.writer.remove(&key(t)?)).await;
        let plain = Latency::of(&m.plain);
        let fenced = Latency::of(&m.fenced);
        let fenced_x_plain = match (&plain, &fenced) {
            (Some(p), Some(f)) if p.p50_us > 0.0 => Some(f.p50_us / p.p50_us),
            _ => None,
        };
        reports.push(Some(FencedWrites {
            operations: m.writer.operations().to_owned(),
            plain,
            fenced,
            fenced_x_plain,
            error: m
                .error
                .or(removed.err().map(|e| format!("removing the keys: {e}"))),
        }));
    }
    Ok(reports)
}

/// `op` within [`WRITE_TIMEOUT`]; its error as text.
async fn within<T>(op: impl Future<Output = Result<T, Error>>) -> Result<T, String> {
    match timeout(WRITE_TIMEOUT, op).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "no answer within {}",
            humantime::format_duration(WRITE_TIMEOUT)
        )),
    }
}
