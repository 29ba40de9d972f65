//! Lock names, validated once so every store can represent them exactly.

use std::fmt;
use std::str::FromStr;

use crate::Error;

/// The longest lock name, in bytes.
///
/// Chosen so that a name plus an adapter's prefix and suffix fits a MySQL
/// `VARCHAR` primary key, a ZooKeeper path and a Redis key with room to spare.
pub const MAX_NAME_LEN: usize = 200;

/// A validated lock name, such as `billing/invoice-run`.
///
/// Names are compared byte for byte (case-sensitive: `a` and `A` are different
/// locks) and obey rules that every store maps one-to-one onto its keys:
///
/// * 1 to [`MAX_NAME_LEN`] bytes;
/// * made of `/`-separated segments; each segment is non-empty and is not `.`
///   or `..` (so no leading, trailing or doubled `/`);
/// * segment characters are ASCII letters, digits and `-` `_` `.` `:` `@` `+`
///   `=`, nothing else: no spaces, no control characters, no NUL, no `%`, no
///   `{`/`}` (Redis hash tags), no `*`/`?` (patterns), no non-ASCII (MySQL
///   collations and ZooKeeper's forbidden code points).
///
/// `a` and `a/b` are two unrelated locks: holding one says nothing about the
/// other. Adapters whose keys form a tree (ZooKeeper, etcd) must keep them apart;
/// [`LockName::flat`] gives a one-segment spelling for that.
///
/// ```
/// use dlock_core::LockName;
/// let name = LockName::new("reports/nightly")?;
/// assert_eq!(name.as_str(), "reports/nightly");
/// assert!(LockName::new("reports//nightly").is_err());
/// assert!(LockName::new("a\0b").is_err());
/// # Ok::<(), dlock_core::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LockName(Box<str>);

impl LockName {
    /// Validates `name` and wraps it.
    ///
    /// Returns [`Error::InvalidName`] naming the first rule the name breaks.
    pub fn new(name: impl AsRef<str>) -> Result<Self, Error> {
        let name = name.as_ref();
        check(name).map_err(|reason| Error::InvalidName {
            name: printable(name),
            reason,
        })?;
        Ok(Self(name.into()))
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The `/`-separated segments.
    pub fn segments(&self) -> impl Iterator<Item = &str> {
        self.0.split('/')
    }

    /// A one-segment spelling with `/` written as `%2F`.
    ///
    /// Injective because `%` is not allowed in names, and order-preserving
    /// enough for prefix listing: `a/` prefixes map to `a%2F` prefixes. Adapters
    /// whose keys are paths use it so that `a` and `a/b` never nest.
    ///
    /// ```
    /// use dlock_core::LockName;
    /// assert_eq!(LockName::new("a/b")?.flat(), "a%2Fb");
    /// assert_eq!(LockName::unflat("a%2Fb")?.as_str(), "a/b");
    /// # Ok::<(), dlock_core::Error>(())
    /// ```
    pub fn flat(&self) -> String {
        self.0.replace('/', "%2F")
    }

    /// Inverse of [`LockName::flat`]; validates the result.
    pub fn unflat(flat: &str) -> Result<Self, Error> {
        Self::new(flat.replace("%2F", "/"))
    }
}

/// Checks a listing prefix: empty, or a string that could start a valid name.
///
/// ```
/// use dlock_core::name::check_prefix;
/// assert!(check_prefix("reports/").is_ok());
/// assert!(check_prefix("bad prefix").is_err());
/// ```
pub fn check_prefix(prefix: &str) -> Result<(), Error> {
    let bad = |reason| Error::InvalidName {
        name: printable(prefix),
        reason,
    };
    if prefix.len() > MAX_NAME_LEN {
        return Err(bad("prefix is longer than the longest name"));
    }
    if let Some(c) = prefix.chars().find(|c| *c != '/' && !allowed(*c)) {
        return Err(bad(reason_for(c)));
    }
    if prefix.starts_with('/') || prefix.contains("//") {
        return Err(bad("prefix has an empty segment"));
    }
    Ok(())
}

fn allowed(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '@' | '+' | '=')
}

fn reason_for(c: char) -> &'static str {
    match c {
        '\0' => "contains a NUL character",
        c if c.is_control() => "contains a control character",
        ' ' => "contains a space",
        c if !c.is_ascii() => "contains a non-ASCII character",
        _ => "contains a character outside [A-Za-z0-9-_.:@+=/]",
    }
}

fn check(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("is empty");
    }
    if name.len() > MAX_NAME_LEN {
        return Err("is longer than 200 bytes");
    }
    if let Some(c) = name.chars().find(|c| *c != '/' && !allowed(*c)) {
        return Err(reason_for(c));
    }
    for segment in name.split('/') {
        match segment {
            "" => return Err("has an empty segment (leading, trailing or doubled '/')"),
            "." | ".." => return Err("has a '.' or '..' segment"),
            _ => {}
        }
    }
    Ok(())
}

/// The name as it may be shown in an error: control characters escaped, cut short.
fn printable(name: &str) -> String {
    let mut out: String = name.chars().take(64).flat_map(char::escape_debug).collect();
    if name.chars().count() > 64 {
        out.push('…');
    }
    out
}

impl fmt::Debug for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for LockName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl FromStr for LockName {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Self::new(s)
    }
}

/// Anything that names a lock: `&str`, `String`, or an already validated
/// [`LockName`]. Used by [`Session::lock`](crate::Session::lock).
pub trait IntoLockName {
    /// Validates (if needed) and converts.
    fn into_lock_name(self) -> Result<LockName, Error>;
}

impl IntoLockName for LockName {
    fn into_lock_name(self) -> Result<LockName, Error> {
        Ok(self)
    }
}

impl IntoLockName for &LockName {
    fn into_lock_name(self) -> Result<LockName, Error> {
        Ok(self.clone())
    }
}

impl IntoLockName for &str {
    fn into_lock_name(self) -> Result<LockName, Error> {
        LockName::new(self)
    }
}

impl IntoLockName for String {
    fn into_lock_name(self) -> Result<LockName, Error> {
        LockName::new(self)
    }
}

impl IntoLockName for &String {
    fn into_lock_name(self) -> Result<LockName, Error> {
        LockName::new(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_good_names() {
        for n in [
            "a",
            "A",
            "a/b",
            "reports/nightly-2024.01",
            "x:y@z+1=2",
            "..a",
            "a.",
            &"x".repeat(200),
        ] {
            assert!(LockName::new(n).is_ok(), "{n:?} should be valid");
        }
    }

    #[test]
    fn rejects_bad_names_with_reasons() {
        let cases = [
            ("", "is empty"),
            ("a\0b", "contains a NUL character"),
            ("a\nb", "contains a control character"),
            ("a b", "contains a space"),
            ("é", "contains a non-ASCII character"),
            ("a{b}", "contains a character outside"),
            ("a%2Fb", "contains a character outside"),
            ("/a", "empty segment"),
            ("a/", "empty segment"),
            ("a//b", "empty segment"),
            ("a/./b", "'.' or '..'"),
            ("..", "'.' or '..'"),
        ];
        for (name, want) in cases {
            match LockName::new(name) {
                Err(Error::InvalidName { reason, .. }) => {
                    assert!(reason.contains(want), "{name:?}: {reason} !~ {want}")
                }
                other => panic!("{name:?}: expected InvalidName, got {other:?}"),
            }
        }
        assert!(LockName::new("x".repeat(201)).is_err());
    }

    #[test]
    fn case_sensitive_and_distinct_from_children() {
        assert_ne!(LockName::new("a").unwrap(), LockName::new("A").unwrap());
        let a = LockName::new("a").unwrap();
        let ab = LockName::new("a/b").unwrap();
        assert_ne!(a.flat(), ab.flat());
        assert!(!ab.flat().starts_with(&format!("{}/", a.flat())));
    }

    #[test]
    fn flat_round_trips() {
        for n in ["a", "a/b/c", "x:y/z"] {
            let name = LockName::new(n).unwrap();
            assert_eq!(LockName::unflat(&name.flat()).unwrap(), name);
        }
    }

    #[test]
    fn error_text_escapes_control_characters() {
        let err = LockName::new("a\0b").unwrap_err().to_string();
        assert!(err.contains("a\\0b"), "{err}");
    }
}
