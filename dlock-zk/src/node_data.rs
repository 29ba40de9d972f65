//! What a lock node holds: who took it, for how long a silent session keeps
//! it, and why.
//!
//! `HOLDER\tTIMEOUT_MS\nWHY`. Only `inspect` and `list` (and the
//! force-release log) decode it: ownership is checked by the node's stat,
//! never by its data. The timeout is there because ZooKeeper tells no other
//! client when it last heard from a session: it is the one figure about the
//! lock's expiry that `dlock status` can show. Nodes written before the
//! timeout was recorded read as `HOLDER\nWHY`; a dlock from before reads
//! `HOLDER\tTIMEOUT_MS` as the holder (upgrade readers first where
//! programs compare holders or leaders by id).

use std::time::Duration;

/// The data of a lock node taken by `holder`, whose session the ensemble
/// expires `timeout` after it last heard from it.
pub(crate) fn encode(holder: &str, timeout: Duration, why: Option<&str>) -> Vec<u8> {
    format!(
        "{holder}\t{}\n{}",
        timeout.as_millis(),
        why.unwrap_or_default()
    )
    .into_bytes()
}

/// What [`encode`] wrote: holder, session timeout (if recorded) and why
/// (if given).
pub(crate) struct Decoded {
    pub(crate) holder: String,
    pub(crate) timeout: Option<Duration>,
    pub(crate) why: Option<String>,
}

/// Reads a lock node's data, by this or an earlier dlock.
pub(crate) fn decode(data: &[u8]) -> Decoded {
    let text = String::from_utf8_lossy(data);
    let (first, why) = text.split_once('\n').unwrap_or((&text, ""));
    // A session id never holds a tab (only lock-name characters).
    let (holder, timeout) = match first.split_once('\t') {
        Some((holder, ms)) => (holder, ms.parse().ok().map(Duration::from_millis)),
        None => (first, None),
    };
    Decoded {
        holder: holder.to_owned(),
        timeout,
        why: (!why.is_empty()).then(|| why.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_reads_the_older_form() {
        let d = decode(&encode(
            "h:1:2:ab",
            Duration::from_millis(30_000),
            Some("a\nb"),
        ));
        assert_eq!(d.holder, "h:1:2:ab");
        assert_eq!(d.timeout, Some(Duration::from_secs(30)));
        assert_eq!(d.why.as_deref(), Some("a\nb"));
        let d = decode(&encode("h", Duration::from_millis(200), None));
        assert_eq!((d.holder.as_str(), d.why), ("h", None));
        let old = decode(b"h:1:2:ab\nwhy");
        assert_eq!(old.holder, "h:1:2:ab");
        assert_eq!(old.timeout, None);
        assert_eq!(old.why.as_deref(), Some("why"));
        assert_eq!(decode(b"h\tjunk").timeout, None);
    }
}
