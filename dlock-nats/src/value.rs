//! Lock names as KV keys, and the value a held key carries.

use bytes::Bytes;
use dlock_core::{Error, FencingToken, LockName};

use crate::SCHEME;

/// A lock name as a KV key: its bytes in hex (keys allow only `[-/_=.a-zA-Z0-9]`).
pub(crate) fn key_of(name: &LockName) -> String {
    key_prefix(name.as_str())
}

/// The start of the keys of every name that starts with `prefix`.
pub(crate) fn key_prefix(prefix: &str) -> String {
    let mut key = String::from("l.");
    for b in prefix.bytes() {
        key.push_str(&format!("{b:02x}"));
    }
    key
}

pub(crate) fn name_of(key: &str) -> Option<LockName> {
    let hex = key.strip_prefix("l.")?;
    let bytes: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect();
    LockName::new(String::from_utf8(bytes?).ok()?).ok()
}

/// The most tombstones one key keeps (the newest): a doubtful end per
/// tombstone, each kept [`Doubtful::tombstone_life`](dlock_core::backend::Doubtful::tombstone_life)
/// at most, so more is a storm of faults on one lock, and its oldest late
/// takes are then refused no more (as on MongoDB).
pub(crate) const MAX_ENDED: usize = 32;

/// The tombstone of an attempt that ended while a take of it may still be
/// on the wire (see `Inner::leave_tombstone`): its owner value, and until
/// when (ms since the epoch, by the writer's clock) it is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ended {
    pub(crate) owner: String,
    pub(crate) until_ms: u64,
}

/// Milliseconds since the epoch, by this host's clock.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A lock key's value: a hold, or (`owner` empty) a free lock that keeps
/// tombstones. Either carries the key's tombstones, so that no write that
/// frees the key empties it while one lives: a late take, written only on
/// a key with no message or on a revision long gone, then finds neither.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Value {
    pub(crate) owner: String,
    pub(crate) token: Option<FencingToken>,
    pub(crate) session: String,
    pub(crate) why: String,
    /// Tombstones of ended attempts (one line each after `why`).
    pub(crate) ended: Vec<Ended>,
}

impl Value {
    /// A free lock's value, keeping `ended`.
    pub(crate) fn free(ended: Vec<Ended>) -> Self {
        Self {
            owner: String::new(),
            token: None,
            session: String::new(),
            why: String::new(),
            ended,
        }
    }

    /// Whether this is a free lock's value (no holder).
    pub(crate) fn is_free(&self) -> bool {
        self.owner.is_empty() && self.session.is_empty()
    }

    /// The tombstones still kept at `now_ms`, the newest [`MAX_ENDED`].
    pub(crate) fn live_ended(&self, now_ms: u64) -> Vec<Ended> {
        let mut live: Vec<Ended> = (self.ended.iter())
            .filter(|e| e.until_ms > now_ms)
            .cloned()
            .collect();
        live.sort_by_key(|e| std::cmp::Reverse(e.until_ms));
        live.truncate(MAX_ENDED);
        live
    }

    pub(crate) fn encode(&self) -> Bytes {
        let token = self.token.map(|t| t.get().to_string()).unwrap_or_default();
        let mut text = format!("{}\n{token}\n{}\n{}", self.owner, self.session, self.why);
        for e in &self.ended {
            text.push_str(&format!("\n{ENDED}{} {}", e.until_ms, e.owner));
        }
        Bytes::from(text)
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, Error> {
        let text = std::str::from_utf8(bytes)
            .map_err(|_| Error::protocol(SCHEME, "a lock value is not UTF-8"))?;
        let mut parts = text.splitn(4, '\n');
        let (Some(owner), Some(token), Some(session), rest) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(Error::protocol(SCHEME, "a lock value has too few fields"));
        };
        let token = match token {
            "" => None,
            t => Some(FencingToken::new(t.parse().map_err(|_| {
                Error::protocol(SCHEME, format!("lock value token {t:?} is no number"))
            })?)),
        };
        // `why` has no newline (a claim replaces them); the lines after it
        // are tombstones. (A value of an earlier version has none.)
        let mut lines = rest.unwrap_or_default().split('\n');
        let why = lines.next().unwrap_or_default().to_owned();
        let ended = lines
            .map(|line| {
                let (until, owner) = (line.strip_prefix(ENDED))
                    .and_then(|l| l.split_once(' '))
                    .ok_or_else(|| Error::protocol(SCHEME, "a lock value has a bad tombstone"))?;
                let until_ms = until
                    .parse()
                    .map_err(|_| Error::protocol(SCHEME, "a lock value has a bad tombstone"))?;
                Ok(Ended {
                    owner: owner.to_owned(),
                    until_ms,
                })
            })
            .collect::<Result<_, Error>>()?;
        Ok(Self {
            owner: owner.to_owned(),
            token,
            session: session.to_owned(),
            why,
            ended,
        })
    }
}

/// The mark of a tombstone line.
const ENDED: &str = "ended ";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(crate) fn keys_round_trip() {
        for name in ["a", "reports/nightly", "x.y-z_1"] {
            let n = LockName::new(name).unwrap();
            assert_eq!(name_of(&key_of(&n)), Some(n));
        }
    }

    #[test]
    pub(crate) fn values_round_trip() {
        let v = Value {
            owner: "s#1".into(),
            token: Some(FencingToken::new(7)),
            session: "s".into(),
            why: "a b".into(),
            ended: Vec::new(),
        };
        assert_eq!(Value::decode(&v.encode()).unwrap(), v);
        let v = Value { token: None, ..v };
        assert_eq!(Value::decode(&v.encode()).unwrap(), v);
        let ended = vec![
            Ended {
                owner: "h:1:2:3:a b#00ff".into(),
                until_ms: 20,
            },
            Ended {
                owner: "s#2".into(),
                until_ms: 10,
            },
        ];
        let v = Value {
            ended: ended.clone(),
            ..v
        };
        assert_eq!(Value::decode(&v.encode()).unwrap(), v);
        let free = Value::free(ended);
        assert!(free.is_free() && !v.is_free());
        assert_eq!(Value::decode(&free.encode()).unwrap(), free);
        // (a line after `why` that is no tombstone)
        assert!(Value::decode(b"o\n\ns\nwhy\nended x").is_err());
    }

    #[test]
    fn only_live_tombstones_are_kept_the_newest_first() {
        let ended = (0..40)
            .map(|i| Ended {
                owner: format!("s#{i}"),
                until_ms: 100 + i,
            })
            .collect();
        let live = Value::free(ended).live_ended(104);
        assert_eq!(live.len(), MAX_ENDED);
        assert_eq!(live[0].until_ms, 139);
        assert!(live.iter().all(|e| e.until_ms > 104));
        assert_eq!(Value::free(Vec::new()).live_ended(0), Vec::new());
    }
}
