//! `dlock status`, `dlock list` and `dlock release --force`: looking at and
//! breaking locks from outside.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::future::Future;
use std::io::{self, Write as _};
use std::time::{Duration, SystemTime};

use dlocks::{Error, LockInfo, LockName};
use serde::Serialize;
use tokio::time::timeout;

use crate::cli::{ListArgs, ReleaseArgs, StatusArgs};
use crate::exit::{FAILURE, FREE, Failure, UNAVAILABLE};

/// The longest one admin request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// One lock as `--json` prints it (`status` and each element of `list`).
#[derive(Debug, Serialize)]
struct LockJson<'a> {
    name: &'a str,
    held: bool,
    holder: Option<&'a str>,
    token: Option<u64>,
    why: Option<&'a str>,
    acquired_at: Option<String>,
    expires_at: Option<String>,
    /// Where the store keeps the expiry to itself (ZooKeeper): it frees the
    /// lock this many milliseconds after the holder's session falls silent.
    session_timeout_ms: Option<u128>,
    waiters: Option<usize>,
}

impl<'a> LockJson<'a> {
    fn free(name: &'a LockName) -> Self {
        Self {
            name: name.as_str(),
            held: false,
            holder: None,
            token: None,
            why: None,
            acquired_at: None,
            expires_at: None,
            session_timeout_ms: None,
            waiters: None,
        }
    }

    fn held(info: &'a LockInfo) -> Self {
        Self {
            name: info.name.as_str(),
            held: true,
            holder: Some(&info.holder),
            token: Some(info.token.get()),
            why: info.why.as_deref(),
            acquired_at: info.acquired_at.map(rfc3339),
            expires_at: info.expires_at.map(rfc3339),
            session_timeout_ms: info.session_timeout.map(|t| t.as_millis()),
            waiters: info.waiters,
        }
    }
}

/// `dlock status NAME`: exit 0 if held, 1 if free.
pub(crate) async fn status(url: &str, args: StatusArgs) -> Result<u8, Failure> {
    let name = LockName::new(&args.name)?;
    let backend = crate::connect(url).await?;
    let info = request(backend.inspect(&name)).await?;
    let mut out = String::new();
    match (&info, args.json) {
        (Some(info), true) => out = json(&LockJson::held(info))?,
        (None, true) => out = json(&LockJson::free(&name))?,
        (Some(info), false) => {
            let mut line = |key: &str, value: &str| {
                let _ = writeln!(out, "{key:<12} {}", printable(value));
            };
            line("name:", info.name.as_str());
            line("holder:", &info.holder);
            line("token:", &info.token.to_string());
            if let Some(why) = &info.why {
                line("why:", why);
            }
            if let Some(t) = info.acquired_at {
                line("acquired-at:", &rfc3339(t));
            }
            if let Some(t) = info.expires_at {
                line("expires-at:", &rfc3339(t));
            } else if let Some(t) = info.session_timeout {
                line(
                    "expires:",
                    &format!(
                        "{} after the holder's session falls silent \
                         (the store tells no one when it last heard from it)",
                        seconds(t)
                    ),
                );
            }
            if let Some(n) = info.waiters {
                line("waiters:", &n.to_string());
            }
        }
        (None, false) => out = format!("{name} is free\n"),
    }
    print(&out)?;
    Ok(if info.is_some() { 0 } else { FREE })
}

/// `dlock list [PREFIX]`: a table or a JSON array of the held locks.
pub(crate) async fn list(url: &str, args: ListArgs) -> Result<u8, Failure> {
    dlock_core::name::check_prefix(&args.prefix)?;
    let backend = crate::connect(url).await?;
    let locks = request(backend.list(&args.prefix)).await?;
    let out = if args.json {
        json(&locks.iter().map(LockJson::held).collect::<Vec<_>>())?
    } else {
        table(&locks)
    };
    print(&out)?;
    Ok(0)
}

/// `dlock release --force NAME`: frees the lock whoever holds it.
pub(crate) async fn release(url: &str, args: ReleaseArgs) -> Result<u8, Failure> {
    let name = LockName::new(&args.name)?;
    if !args.force {
        return Err(Failure::usage(format!(
            "release breaks the lock whoever holds it; say `dlock release --force {name}` \
             (a `dlock run` holder releases its lock itself when its command exits)"
        )));
    }
    let backend = crate::connect(url).await?;
    // Only for the message: who is about to lose it.
    let before = request(backend.inspect(&name)).await.ok().flatten();
    let was_held = request(backend.force_release(&name)).await?;
    let out = match (was_held, before) {
        (true, Some(info)) => format!(
            "released {name} (was held by {} with token {})\n",
            printable(&info.holder),
            info.token
        ),
        (true, None) => format!("released {name}\n"),
        (false, _) => format!("{name} was not held\n"),
    };
    print(&out)?;
    Ok(0)
}

/// The human table of `list`: NAME, TOKEN, HOLDER, EXPIRES, WHY.
fn table(locks: &[LockInfo]) -> String {
    if locks.is_empty() {
        return "no locks held\n".to_owned();
    }
    let header = ["NAME", "TOKEN", "HOLDER", "EXPIRES", "WHY"].map(String::from);
    let rows: Vec<[String; 5]> = locks
        .iter()
        .map(|l| {
            [
                l.name.to_string(),
                l.token.to_string(),
                printable(&l.holder).into_owned(),
                expires_cell(l),
                l.why
                    .as_deref()
                    .map_or(Cow::Borrowed("-"), printable)
                    .into_owned(),
            ]
        })
        .collect();
    let mut widths = [0; 5];
    for row in std::iter::once(&header).chain(&rows) {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let mut line = String::new();
        for (i, (cell, w)) in row.iter().zip(widths).enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<w$}  ");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// `list`'s EXPIRES: the time, or `silent+T` where the store frees the lock
/// T after the holder's session falls silent but keeps when that was to
/// itself, or `-`.
fn expires_cell(info: &LockInfo) -> String {
    match (info.expires_at, info.session_timeout) {
        (Some(t), _) => rfc3339(t),
        (None, Some(t)) => format!("silent+{}", seconds(t)),
        (None, None) => "-".to_owned(),
    }
}

/// A duration as one word of seconds, to the millisecond: `30s`, `1.5s`
/// (a table cell that splits on whitespace stays one cell).
fn seconds(d: Duration) -> String {
    let ms = d.as_millis();
    let (whole, frac) = (ms / 1000, ms % 1000);
    if frac == 0 {
        format!("{whole}s")
    } else {
        format!("{whole}.{}s", format!("{frac:03}").trim_end_matches('0'))
    }
}

/// RFC 3339 with milliseconds, UTC.
fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// Store-provided text with control characters escaped, safe for a terminal.
fn printable(text: &str) -> Cow<'_, str> {
    if text.chars().any(char::is_control) {
        Cow::Owned(
            text.chars()
                .map(|c| {
                    if c.is_control() {
                        c.escape_default().to_string()
                    } else {
                        c.to_string()
                    }
                })
                .collect(),
        )
    } else {
        Cow::Borrowed(text)
    }
}

/// Pretty JSON plus a newline.
fn json(value: &impl Serialize) -> Result<String, Failure> {
    serde_json::to_string_pretty(value)
        .map(|s| s + "\n")
        .map_err(|e| Failure::new(FAILURE, format!("cannot encode JSON: {e}")))
}

/// Writes to stdout; a closed pipe (`dlock list | head -1`) is not an error.
pub(crate) fn print(text: &str) -> Result<(), Failure> {
    let mut stdout = io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => Err(Failure::new(
            FAILURE,
            format!("cannot write to stdout: {e}"),
        )),
        _ => Ok(()),
    }
}

/// Bounds one admin request by [`REQUEST_TIMEOUT`].
async fn request<T>(fut: impl Future<Output = Result<T, Error>>) -> Result<T, Failure> {
    match timeout(REQUEST_TIMEOUT, fut).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(Failure::new(
            UNAVAILABLE,
            format!(
                "the backend did not answer within {}",
                humantime::format_duration(REQUEST_TIMEOUT)
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlocks::FencingToken;

    #[test]
    fn seconds_are_one_word() {
        assert_eq!(seconds(Duration::from_secs(30)), "30s");
        assert_eq!(seconds(Duration::from_millis(1500)), "1.5s");
        assert_eq!(seconds(Duration::from_millis(200)), "0.2s");
        assert_eq!(seconds(Duration::from_millis(1234)), "1.234s");
        assert_eq!(seconds(Duration::from_millis(90_050)), "90.05s");
    }

    #[test]
    fn table_is_aligned_and_escaped() {
        let mut a = LockInfo::new(
            LockName::new("a").unwrap(),
            "host:1:2:x",
            FencingToken::new(7),
        );
        a.why = Some("two\nlines".into());
        let b = LockInfo::new(
            LockName::new("reports/nightly").unwrap(),
            "h:2",
            FencingToken::new(12345),
        );
        let text = table(&[a, b]);
        let lines: Vec<_> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(
            lines[0].starts_with("NAME             TOKEN  HOLDER"),
            "{text}"
        );
        assert!(lines[1].ends_with("two\\nlines"), "{text}");
        let col = lines[0].find("HOLDER").unwrap();
        assert_eq!(lines[1].find("host"), Some(col), "{text}");
        assert_eq!(lines[2].find("h:2"), Some(col), "{text}");
        assert_eq!(table(&[]), "no locks held\n");
    }
}
