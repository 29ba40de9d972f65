//! Fencing tokens across a network boundary: the `Dlock-Fence` request
//! header and the check a service makes on it.
//!
//! A holder that asks another service to write on its behalf sends its lock's
//! name and token with the request; the service checks both before it writes,
//! and passes the token on to its fenced writer (`SqlFence`, `RedisFence`, ...)
//! or to an in-process [`WriteGate`]. The header carries the lock name because
//! tokens are per name: a token of another lock says nothing about this one,
//! and a service must refuse it rather than compare it.
//!
//! ```text
//! Dlock-Fence: 42; lock=billing/invoice-run
//! ```
//!
//! The value is the token (decimal), then `; lock=` and the [`LockName`].
//! Names never contain `;`, spaces or control characters, so the value needs
//! no quoting and is what a shell job writes from the CLI's environment:
//! `curl -H "Dlock-Fence: $DLOCK_TOKEN; lock=$DLOCK_NAME" ...`.
//!
//! ```
//! use dlock_core::{FencingToken, LockName};
//! use dlock_core::fence_header::FenceHeader;
//!
//! // The holder's side (`LockGuard::fence_header` builds the same).
//! let lock = LockName::new("billing/invoice-run")?;
//! let sent = FenceHeader::new(lock.clone(), FencingToken::new(42)).to_string();
//! assert_eq!(sent, "42; lock=billing/invoice-run");
//!
//! // A service that writes through a store's fenced writer: the token of
//! // this lock, or why not.
//! let token = FenceHeader::token_for(Some(&sent), &lock)?;
//! assert_eq!(token, FencingToken::new(42));
//! let foreign = FenceHeader::token_for(Some("43; lock=other"), &lock).unwrap_err();
//! assert_eq!(foreign.http_status(), 409);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A service that is the resource's only writer checks in memory, with the
//! check and its write as one step ([`WriteGate`]):
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use dlock_core::{LockName, WriteGate};
//! use dlock_core::fence_header::{FenceHeader, FenceRefused};
//!
//! let lock = LockName::new("billing/invoice-run")?;
//! let gate = WriteGate::new(); // one per resource, shared by every route
//! let permit = FenceHeader::enter(Some("42; lock=billing/invoice-run"), &lock, &gate).await?;
//! // ... write, holding the permit ...
//! drop(permit);
//! let older = FenceHeader::enter(Some("41; lock=billing/invoice-run"), &lock, &gate).await;
//! assert!(matches!(older, Err(FenceRefused::Stale(_))));
//! # Ok(()) }
//! ```

use std::fmt;
use std::str::FromStr;

use crate::{FencingToken, GateRefused, LockName, StaleToken, WriteGate, WritePermit};

/// The header's name, in the lower case HTTP/2 requires (HTTP/1 header
/// names are case-insensitive: `Dlock-Fence` is the same header).
pub const FENCE_HEADER: &str = "dlock-fence";

/// The longest header value [`FenceHeader::parse`] reads: a token of at most
/// 20 digits, `; lock=` and a name of at most
/// [`MAX_NAME_LEN`](crate::name::MAX_NAME_LEN) bytes.
const MAX_VALUE_LEN: usize = 20 + 7 + crate::name::MAX_NAME_LEN;

/// A lock name and one of its fencing tokens, as a request carries them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceHeader {
    lock: LockName,
    token: FencingToken,
}

impl FenceHeader {
    /// The header for `token`, a grant of `lock`.
    pub fn new(lock: LockName, token: FencingToken) -> Self {
        Self { lock, token }
    }

    /// The lock the token belongs to.
    pub fn lock(&self) -> &LockName {
        &self.lock
    }

    /// The token.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// Reads a header value (`42; lock=billing/invoice-run`). The error names
    /// what is wrong and shows at most the value's first bytes.
    pub fn parse(value: &str) -> Result<Self, FenceRefused> {
        let malformed = |why: &'static str| FenceRefused::Malformed {
            value: shown(value),
            why,
        };
        if value.len() > MAX_VALUE_LEN {
            return Err(malformed("longer than a token and a lock name can be"));
        }
        let (token, params) = value
            .split_once(';')
            .ok_or_else(|| malformed("expected `TOKEN; lock=NAME`"))?;
        let token = token.trim();
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_digit()) {
            return Err(malformed("the token is not a decimal number"));
        }
        let token = token
            .parse::<u64>()
            .map_err(|_| malformed("the token does not fit 64 bits"))?;
        if token == 0 {
            // Grants start at 1: a 0 is a default value sent by mistake.
            return Err(malformed("the token is 0, which no grant has"));
        }
        let name = params
            .trim()
            .strip_prefix("lock=")
            .ok_or_else(|| malformed("expected `lock=NAME` after the token"))?;
        let lock = LockName::new(name).map_err(|_| malformed("the lock name is not valid"))?;
        Ok(Self::new(lock, FencingToken::new(token)))
    }

    /// The token of a request's header `value`, once it is known to belong to
    /// `lock`: refuses a missing or malformed header and a token of another
    /// lock, without comparing any token.
    ///
    /// Use this where the token goes on to a fenced writer in a shared store
    /// (a service with several replicas: each replica's memory would be a
    /// gate of its own).
    pub fn token_for(value: Option<&str>, lock: &LockName) -> Result<FencingToken, FenceRefused> {
        let header = Self::parse(value.ok_or(FenceRefused::Missing)?)?;
        if header.lock != *lock {
            return Err(FenceRefused::WrongLock {
                expected: lock.clone(),
                got: header.lock,
            });
        }
        Ok(header.token)
    }

    /// [`token_for`](Self::token_for), then a turn at `gate`: the permit
    /// to write (the check and the write are one step while it is held),
    /// else why not. For a service that is the resource's only writer (one
    /// process; the gate is its memory).
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn enter(
        value: Option<&str>,
        lock: &LockName,
        gate: &WriteGate,
    ) -> Result<WritePermit, FenceRefused> {
        let token = Self::token_for(value, lock)?;
        gate.enter(token).await.map_err(|refused| match refused {
            GateRefused::Busy(wait) => FenceRefused::Busy(wait),
            GateRefused::Stale(stale) => FenceRefused::Stale(stale),
        })
    }
}

impl fmt::Display for FenceHeader {
    /// The header value: `TOKEN; lock=NAME`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}; lock={}", self.token, self.lock)
    }
}

impl FromStr for FenceHeader {
    type Err = FenceRefused;

    fn from_str(value: &str) -> Result<Self, FenceRefused> {
        Self::parse(value)
    }
}

/// Why a service refused a request's fence. In every case the write must not
/// happen; [`http_status`](Self::http_status) suggests the answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FenceRefused {
    /// The request carries no `Dlock-Fence` header.
    #[error("no {FENCE_HEADER} header: a fenced write needs the lock's token")]
    Missing,
    /// The header is not `TOKEN; lock=NAME`.
    #[error("malformed {FENCE_HEADER} header {value:?}: {why}")]
    Malformed {
        /// The value as received (its first bytes).
        value: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The token belongs to another lock: tokens of different names do not
    /// compare.
    #[error("{FENCE_HEADER} header names lock {got}, but this resource is guarded by {expected}")]
    WrongLock {
        /// The lock that guards the resource.
        expected: LockName,
        /// The lock the header names.
        got: LockName,
    },
    /// A newer token has been accepted: the sender is a former holder.
    #[error("{FENCE_HEADER}: {0}")]
    Stale(StaleToken),
    /// The request waited its turn at the [`WriteGate`] longer than the
    /// gate waits.
    #[error("{FENCE_HEADER}: waited {0:?} for the writers before it to finish")]
    Busy(std::time::Duration),
}

impl FenceRefused {
    /// The HTTP status that says it: 428 Precondition Required for a missing
    /// header, 400 Bad Request for a malformed one, 409 Conflict for a token
    /// of another lock or a stale one (the sender must not retry with it),
    /// 503 Service Unavailable for a gate held too long by another writer.
    pub fn http_status(&self) -> u16 {
        match self {
            FenceRefused::Missing => 428,
            FenceRefused::Malformed { .. } => 400,
            FenceRefused::WrongLock { .. } | FenceRefused::Stale(_) => 409,
            FenceRefused::Busy(_) => 503,
        }
    }
}

/// At most the first 64 bytes of `value`, for an error message.
fn shown(value: &str) -> String {
    let mut end = value.len().min(64);
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    value[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lock(name: &str) -> LockName {
        LockName::new(name).unwrap()
    }

    #[test]
    fn a_header_reads_back_as_written() {
        for (name, token) in [
            ("a", 1),
            ("billing/invoice-run", 42),
            ("x:y@z+1=2", u64::MAX),
        ] {
            let header = FenceHeader::new(lock(name), FencingToken::new(token));
            assert_eq!(header.to_string().parse::<FenceHeader>(), Ok(header));
        }
        // Spaces around the parts are a sender's formatting, not a new name.
        let header = FenceHeader::parse(" 7 ;  lock=a/b ").unwrap();
        assert_eq!((header.token().get(), header.lock().as_str()), (7, "a/b"));
    }

    #[test]
    fn malformed_values_say_what_is_wrong() {
        for (value, why) in [
            ("", "expected `TOKEN; lock=NAME`"),
            ("42", "expected `TOKEN; lock=NAME`"),
            ("-1; lock=a", "the token is not a decimal number"),
            ("+1; lock=a", "the token is not a decimal number"),
            ("0x2a; lock=a", "the token is not a decimal number"),
            ("; lock=a", "the token is not a decimal number"),
            (
                "18446744073709551616; lock=a",
                "the token does not fit 64 bits",
            ),
            ("0; lock=a", "the token is 0, which no grant has"),
            ("42; name=a", "expected `lock=NAME` after the token"),
            ("42; lock=", "the lock name is not valid"),
            ("42; lock=a//b", "the lock name is not valid"),
            ("42; lock=a; lock=b", "the lock name is not valid"),
        ] {
            match FenceHeader::parse(value) {
                Err(FenceRefused::Malformed { why: got, .. }) => assert_eq!(got, why, "{value:?}"),
                other => panic!("{value:?}: {other:?}"),
            }
        }
        let long = format!("1; lock={}", "a".repeat(300));
        let err = FenceHeader::parse(&long).unwrap_err();
        assert!(err.to_string().len() < 200, "{err}");
    }

    #[tokio::test]
    async fn the_check_refuses_missing_foreign_and_stale_tokens() {
        let (guarded, gate) = (lock("orders"), WriteGate::new());
        let token = |p: Result<WritePermit, FenceRefused>| p.map(|p| p.token());
        let enter = |v: Option<&'static str>| FenceHeader::enter(v, &guarded, &gate);
        assert_eq!(token(enter(None).await), Err(FenceRefused::Missing));
        assert_eq!(
            token(enter(Some("5; lock=orders")).await),
            Ok(FencingToken::new(5))
        );
        assert_eq!(
            token(enter(Some("5; lock=orders")).await),
            Ok(FencingToken::new(5))
        );
        assert_eq!(
            token(enter(Some("9; lock=invoices")).await),
            Err(FenceRefused::WrongLock {
                expected: lock("orders"),
                got: lock("invoices")
            })
        );
        // A foreign token is refused before the gate sees it: it did not
        // raise the gate, so the next token of this lock still passes.
        assert_eq!(
            token(enter(Some("6; lock=orders")).await),
            Ok(FencingToken::new(6))
        );
        let stale = token(enter(Some("5; lock=orders")).await).unwrap_err();
        assert_eq!(
            stale,
            FenceRefused::Stale(StaleToken {
                token: FencingToken::new(5),
                highest: FencingToken::new(6)
            })
        );
        let statuses: Vec<u16> = [
            FenceRefused::Missing,
            FenceHeader::parse("x").unwrap_err(),
            token(enter(Some("1; lock=other")).await).unwrap_err(),
            stale,
            FenceRefused::Busy(std::time::Duration::from_secs(1)),
        ]
        .iter()
        .map(FenceRefused::http_status)
        .collect();
        assert_eq!(statuses, [428, 400, 409, 409, 503]);
    }
}
