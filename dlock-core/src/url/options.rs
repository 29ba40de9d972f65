//! Typed reading of a URL's query options, refusing unknown ones: a typo
//! such as `max_tll=5s` must be an error, never silently ignored.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use super::StoreUrl;
use crate::Error;

/// Reads a [`StoreUrl`]'s query options by name and type, and remembers
/// which were read: [`Options::finish`] refuses any other.
///
/// Each option may appear once; a value that does not parse is an
/// [`Error::InvalidUrl`] naming the option and the expected form.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::url::StoreUrl;
///
/// let url = StoreUrl::parse("redis://h?max_tll=5s")?;
/// let mut options = url.options();
/// assert_eq!(options.duration("max_ttl")?, None);
/// let e = options.finish().unwrap_err();
/// assert!(e.to_string().contains("unknown option \"max_tll\""), "{e}");
/// # Ok::<(), dlock_core::Error>(())
/// ```
#[derive(Debug)]
pub struct Options<'u> {
    url: &'u StoreUrl,
    read: Vec<bool>,
    known: Vec<String>,
}

impl<'u> Options<'u> {
    pub(super) fn new(url: &'u StoreUrl) -> Self {
        Self {
            url,
            read: vec![false; url.pairs.len()],
            known: Vec::new(),
        }
    }

    /// The decoded value of `key`, if given; marks it read.
    pub fn string(&mut self, key: &str) -> Result<Option<String>, Error> {
        self.known.push(key.to_owned());
        let mut found = None;
        for (i, pair) in self.url.pairs.iter().enumerate() {
            if pair.key == key {
                if found.is_some() {
                    return Err(self.url.invalid(format!("option {key:?} is given twice")));
                }
                self.read[i] = true;
                found = Some(pair.value.clone());
            }
        }
        Ok(found)
    }

    /// `key` parsed with [`FromStr`]; `expected` describes the form for the
    /// error (`"a whole number"`).
    pub fn parse<T: FromStr>(&mut self, key: &str, expected: &str) -> Result<Option<T>, Error> {
        self.string(key)?
            .map(|v| {
                v.parse::<T>().map_err(|_| {
                    self.url
                        .invalid(format!("{key} must be {expected}, not {v:?}"))
                })
            })
            .transpose()
    }

    /// A boolean option: `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`).
    pub fn flag(&mut self, key: &str) -> Result<Option<bool>, Error> {
        self.string(key)?
            .map(|v| match v.to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" | "on" => Ok(true),
                "false" | "0" | "no" | "off" => Ok(false),
                _ => Err(self
                    .url
                    .invalid(format!("{key} must be true or false, not {v:?}"))),
            })
            .transpose()
    }

    /// A duration option (`30s`, `1500ms`, `2m`, `1h`; see [`parse_duration`]).
    pub fn duration(&mut self, key: &str) -> Result<Option<Duration>, Error> {
        self.string(key)?
            .map(|v| {
                parse_duration(&v).ok_or_else(|| {
                    self.url.invalid(format!(
                        "{key} must be a duration such as 30s, 1500ms or 2m, not {v:?}"
                    ))
                })
            })
            .transpose()
    }

    /// A file path option (not empty).
    pub fn path(&mut self, key: &str) -> Result<Option<PathBuf>, Error> {
        match self.string(key)? {
            Some(v) if v.is_empty() => Err(self.url.invalid(format!("{key} must be a file path"))),
            other => Ok(other.map(PathBuf::from)),
        }
    }

    /// Marks `key` read without interpreting it: an option the driver
    /// understands, left in the URL handed to it.
    pub fn pass(&mut self, key: &str) {
        self.known.push(key.to_owned());
        for (i, pair) in self.url.pairs.iter().enumerate() {
            if pair.key == key {
                self.read[i] = true;
            }
        }
    }

    /// The names of the options not read so far (in order, once each).
    pub fn unread(&self) -> Vec<&'u str> {
        let mut names: Vec<&str> = Vec::new();
        for (pair, read) in self.url.pairs.iter().zip(&self.read) {
            if !read && !names.contains(&pair.key.as_str()) {
                names.push(&pair.key);
            }
        }
        names
    }

    /// Ends the reading: an option nobody asked for is an
    /// [`Error::InvalidUrl`] that names it and lists the known ones.
    pub fn finish(self) -> Result<(), Error> {
        let Some(first) = self.unread().first().copied() else {
            return Ok(());
        };
        let mut known = self.known.clone();
        known.sort();
        known.dedup();
        let known = if known.is_empty() {
            format!("{}:// takes no options", self.url.scheme())
        } else {
            format!("known: {}", known.join(", "))
        };
        Err(self
            .url
            .invalid(format!("unknown option {first:?} ({known})")))
    }
}

/// Parses a duration written as a number and a unit: `1500ms`, `30s`,
/// `1.5s`, `2m`, `1h`, or a sum such as `1m30s` (humantime's syntax). `None`
/// for anything else: a bare number has no unit and is refused.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::url::parse_duration;
/// assert_eq!(parse_duration("1500ms"), Some(Duration::from_millis(1500)));
/// assert_eq!(parse_duration("1m30s"), Some(Duration::from_secs(90)));
/// assert_eq!(parse_duration("30"), None);
/// ```
pub fn parse_duration(text: &str) -> Option<Duration> {
    if text.is_empty() || text.starts_with(|c: char| !c.is_ascii_digit()) {
        return None;
    }
    humantime::parse_duration(text).ok()
}
