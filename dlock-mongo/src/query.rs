//! Every filter, update, pipeline and index the adapter sends, built by pure
//! functions so their exact BSON is unit-tested without a server.
//!
//! Expiry is always judged by `$$NOW`, the server's clock at the moment the
//! operation runs (invariant S6). `$$NOW` exists only in aggregation
//! expressions, so filters test it inside `$expr` and updates that need it are
//! pipelines. **MongoDB refuses `$expr` in the filter of an upsert** (error
//! 224, "`$expr` is not allowed in the query predicate for an upsert"), so the
//! take filters on `_id` alone and makes the free-or-expired decision inside
//! its update pipeline (see [`take_update`]).
//!
//! Strings that come from users (reasons) or from the process (session and
//! owner ids) are wrapped in `$literal` wherever they land in an expression, so
//! a reason such as `"$token"` is stored as text, never read as a field path.

use std::time::Duration;

use dlock_core::LockName;
use mongodb::IndexModel;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::options::IndexOptions;

/// `state` of a held lock (the seeds' 2; their 1, "being acquired", is not
/// needed: the take is one atomic step).
pub(crate) const STATE_HELD: i32 = 2;
/// `state` of a free lock.
pub(crate) const STATE_FREE: i32 = 0;

/// How long dead `sessions` documents stay before the TTL index sweeps them:
/// the seeds' 4 days.
pub const SESSION_SWEEP: Duration = Duration::from_secs(4 * 24 * 60 * 60);

/// The Unix epoch: `expiresAt` of a free lock.
pub(crate) fn epoch() -> DateTime {
    DateTime::from_millis(0)
}

/// `expiresAt`, with a missing field counted as the epoch (long expired).
fn expires_at() -> Bson {
    Bson::Document(doc! { "$ifNull": ["$expiresAt", epoch()] })
}

/// Expression: the document's hold has expired (or never existed).
pub(crate) fn is_expired() -> Document {
    doc! { "$lte": [expires_at(), "$$NOW"] }
}

/// Expression: the document's hold is live by the server's clock.
pub(crate) fn is_live() -> Document {
    doc! { "$gt": [expires_at(), "$$NOW"] }
}

/// Expression: milliseconds until the hold expires (negative if it has).
pub(crate) fn remaining_ms() -> Document {
    doc! { "$subtract": [expires_at(), "$$NOW"] }
}

/// An aggregation-expression string that is never read as a field path.
fn literal(s: &str) -> Document {
    doc! { "$literal": s }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// What one take writes: who takes and for how long.
#[derive(Debug, Clone)]
pub(crate) struct TakeSpec<'a> {
    pub(crate) session: &'a str,
    /// This attempt's owner id (`who`).
    pub(crate) owner: &'a str,
    pub(crate) why: Option<&'a str>,
    /// This try's id (`ts`, as in the seeds): tells a fresh grant from a
    /// retry that finds its own earlier grant.
    pub(crate) ts: ObjectId,
    pub(crate) ttl: Duration,
}

/// The take's filter: the lock document, nothing else (an upsert filter may
/// not use `$expr`).
pub(crate) fn take_filter(name: &LockName) -> Document {
    doc! { "_id": name.as_str() }
}

/// The take's update: one pipeline stage that replaces the document with
/// itself plus the new holder **if** it is free or expired by `$$NOW` (and
/// the attempt has not ended: [`tombstone_update`]);
/// extends it to `$$NOW + ttl` (keeping the token) if this attempt already
/// holds it — a retry after a lost reply, whose validity the core counts from
/// the retry — and leaves it untouched (a server-side no-op, no oplog entry)
/// if someone else holds it.
///
/// On a fresh lock the pipeline runs on `{_id: name}` (inserted just before), whose missing
/// `expiresAt` counts as expired, so the same stage creates the document with
/// token 1. The token is `$token + 1` on the kept document (S2). The previous
/// holder's fields are copied to `prev` so that a takeover of an expired hold
/// can be logged from the reply (the seeds' "forcefully taking over").
pub(crate) fn take_update(spec: &TakeSpec<'_>) -> Vec<Document> {
    let why = match spec.why {
        Some(why) => Bson::Document(literal(why)),
        None => Bson::Null,
    };
    let holder = doc! {
        "state": STATE_HELD,
        "session": literal(spec.session),
        "who": literal(spec.owner),
        "why": why,
        "when": "$$NOW",
        "ts": spec.ts,
        "token": { "$add": [{ "$ifNull": ["$token", 0_i64] }, 1_i64] },
        "expiresAt": { "$add": ["$$NOW", ms(spec.ttl)] },
        "prev": {
            "state": "$state",
            "session": "$session",
            "who": "$who",
            "why": "$why",
            "token": "$token",
            "expiresAt": "$expiresAt",
        },
    };
    vec![doc! {
        "$replaceWith": {
            "$cond": {
                "if": { "$and": [is_expired(), unended(spec.owner)] },
                "then": { "$mergeObjects": ["$$ROOT", holder] },
                "else": {
                    "$cond": {
                        // Not an ended attempt's expired hold (its release
                        // matched nothing, so `who` stayed).
                        "if": { "$and": [{ "$eq": ["$who", literal(spec.owner)] }, unended(spec.owner)] },
                        "then": { "$mergeObjects": ["$$ROOT", { "expiresAt": extended(spec.ttl) }] },
                        "else": "$$ROOT",
                    }
                },
            }
        }
    }]
}

/// How many ended attempts a lock's document remembers at most (see
/// [`tombstone_update`]): each is kept for its tombstone's life, and this
/// bounds the document's size (an entry is about 30 bytes plus the attempt
/// id: ~190 KB at most) when one lock sees more doubtful ends than that
/// within a life.
pub(crate) const ENDED_KEPT: i64 = 1024;

/// How many of the last ended attempts are kept whatever their age (as
/// every entry was before entries had a life): a take delayed past its
/// tombstone's life is still refused while fewer ends followed it.
pub(crate) const ENDED_KEPT_ANY_AGE: i64 = 32;

/// Expression: attempt `owner` has not ended with a take of it on the wire
/// (its tombstone is not in the document's `ended` list).
fn unended(owner: &str) -> Document {
    doc! { "$not": [{ "$in": [literal(owner), { "$ifNull": ["$ended.o", []] }] }] }
}

/// Adds attempt `owner`, which ends while a take of it may still be on the
/// wire, to the document's `ended` list as `{o: owner, u: $$NOW + life}`:
/// that take, landing later, grants nothing ([`take_update`]), whoever
/// took and freed the lock in between. Written before the update that
/// frees the attempt's hold. The same update drops the entries whose life
/// is over by the server's clock, except the last [`ENDED_KEPT_ANY_AGE`]
/// (an entry of the older format, a bare attempt id, has no life and is
/// left to the count bound), then keeps the last [`ENDED_KEPT`].
pub(crate) fn tombstone_update(owner: &str, life: Duration) -> Vec<Document> {
    let list = doc! { "$ifNull": ["$ended", []] };
    let older = doc! { "$slice": [
        list.clone(),
        { "$max": [0_i64, { "$subtract": [{ "$size": list.clone() }, ENDED_KEPT_ANY_AGE] }] },
    ] };
    let alive = doc! { "$concatArrays": [
        { "$filter": {
            "input": older,
            "as": "e",
            "cond": { "$or": [
                { "$ne": [{ "$type": "$$e" }, "object"] },
                { "$gt": ["$$e.u", "$$NOW"] },
            ] },
        } },
        { "$slice": [list, -ENDED_KEPT_ANY_AGE] },
    ] };
    // Once: a retried end does not push older tombstones out.
    let ended = doc! { "$let": {
        "vars": { "alive": alive },
        "in": { "$cond": {
            "if": { "$in": [literal(owner), { "$ifNull": ["$$alive.o", []] }] },
            "then": "$$alive",
            "else": { "$concatArrays": ["$$alive", [
                { "o": literal(owner), "u": { "$add": ["$$NOW", ms(life)] } },
            ]] },
        } },
    } };
    vec![doc! { "$set": { "ended": { "$slice": [ended, -ENDED_KEPT] } } }]
}

/// `max(expiresAt, $$NOW + ttl)`: a renewal never shortens a hold.
fn extended(ttl: Duration) -> Document {
    doc! { "$max": ["$expiresAt", { "$add": ["$$NOW", ms(ttl)] }] }
}

/// What the take returns (after the update): the holder, and the time left by
/// the same server clock, so a busy reply carries `retry_after`.
pub(crate) fn take_projection() -> Document {
    doc! {
        "_id": 0,
        "state": 1,
        "session": 1,
        "who": 1,
        "ts": 1,
        "token": 1,
        "prev": 1,
        "remaining": remaining_ms(),
    }
}

/// The update that frees a lock and keeps its document (and token).
pub(crate) fn free_update() -> Document {
    doc! {
        "$set": { "state": STATE_FREE, "expiresAt": epoch() },
        "$unset": { "session": "", "who": "", "why": "" },
    }
}

/// Owner-checked release (S3): this session, this attempt, this token, live.
pub(crate) fn release_filter(name: &LockName, session: &str, owner: &str, token: u64) -> Document {
    doc! {
        "_id": name.as_str(),
        "session": session,
        "who": owner,
        "token": token_bson(token),
        "$expr": is_live(),
    }
}

/// Frees a grant an abandoned attempt may have received.
pub(crate) fn abandon_filter(name: &LockName, owner: &str) -> Document {
    doc! { "_id": name.as_str(), "who": owner, "$expr": is_live() }
}

/// A held lock, whoever holds it (inspect, force-release).
pub(crate) fn held_filter(name: &LockName) -> Document {
    doc! { "_id": name.as_str(), "$expr": is_live() }
}

/// The current holder's token (validate).
pub(crate) fn validate_filter(name: &LockName, token: u64) -> Document {
    doc! { "_id": name.as_str(), "token": token_bson(token), "$expr": is_live() }
}

/// Every live hold of a session (close).
pub(crate) fn session_filter(session: &str) -> Document {
    doc! { "session": session, "$expr": is_live() }
}

/// Held locks whose names start with `prefix`, by a range on `_id` (names use
/// only ASCII below `~`, and `_id` compares bytewise).
pub(crate) fn list_filter(prefix: &str) -> Document {
    doc! {
        "_id": { "$gte": prefix, "$lt": format!("{prefix}~") },
        "$expr": is_live(),
    }
}

/// One hold as the store knows it: name, owner and token.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HoldRef<'a> {
    pub(crate) name: &'a str,
    pub(crate) owner: &'a str,
    pub(crate) token: u64,
}

/// The renewal filter: the session's live holds among `holds`, matched by
/// name, owner and token (S3), in one `updateMany`.
///
/// Three `$in` lists, not an `$or` of one branch per hold: the server plans
/// an `$or` of thousands of branches slowly (~0.5 s for 10,000, longer than
/// a short TTL's request timeout), while `_id: {$in}` is one index scan.
/// The lists match exactly the listed holds: an owner (`who`) is one
/// attempt's, on one name, so a document whose `_id` and `who` are listed
/// is that attempt's grant, and its token is listed unless a late copy of
/// the attempt's own take granted it again after it expired under a token
/// that another listed hold happens to have (then the renewal extends that
/// attempt's own newer grant, which no one else holds).
pub(crate) fn renew_filter(session: &str, holds: &[HoldRef<'_>]) -> Document {
    let names: Vec<&str> = holds.iter().map(|h| h.name).collect();
    let owners: Vec<&str> = holds.iter().map(|h| h.owner).collect();
    let tokens: Vec<i64> = holds.iter().map(|h| token_bson(h.token)).collect();
    doc! {
        "_id": { "$in": names },
        "who": { "$in": owners },
        "token": { "$in": tokens },
        "session": session,
        "$expr": is_live(),
    }
}

/// The renewal update: `expiresAt = max(expiresAt, $$NOW + ttl)` (a renewal
/// never shortens a hold).
pub(crate) fn renew_update(ttl: Duration) -> Vec<Document> {
    vec![doc! { "$set": { "expiresAt": extended(ttl) } }]
}

/// The session heartbeat: `ping = $$NOW` on `{_id: session}`, upserted.
pub(crate) fn ping_filter(session: &str) -> Document {
    doc! { "_id": session }
}

/// See [`ping_filter`].
pub(crate) fn ping_update() -> Vec<Document> {
    vec![doc! { "$set": { "ping": "$$NOW" } }]
}

/// Fields `inspect` and `list` read.
pub(crate) fn info_projection() -> Document {
    doc! { "session": 1, "token": 1, "why": 1, "when": 1, "expiresAt": 1 }
}

/// Fields the renewal's follow-up read needs.
pub(crate) fn hold_projection() -> Document {
    doc! { "_id": 1, "who": 1, "token": 1 }
}

/// The change-stream filter: events that may free a lock — a release, force
/// release or abandon (`state` set to 0), or the document or collection going
/// away. Renewals and takes do not wake anyone.
pub(crate) fn wake_pipeline() -> Vec<Document> {
    vec![doc! {
        "$match": {
            "$or": [
                { "operationType": "update", "updateDescription.updatedFields.state": STATE_FREE },
                { "operationType": "replace", "fullDocument.state": STATE_FREE },
                { "operationType": { "$in": ["delete", "drop", "rename", "dropDatabase", "invalidate"] } },
            ]
        }
    }]
}

/// The index name on `locks.session`.
pub(crate) const SESSION_INDEX: &str = "dlock_session";
/// The TTL index name on `sessions.ping`.
pub(crate) const PING_INDEX: &str = "dlock_ping_ttl";

/// The index on `locks.session`: renewal and close select a session's holds.
pub(crate) fn session_index() -> IndexModel {
    IndexModel::builder()
        .keys(doc! { "session": 1 })
        .options(
            IndexOptions::builder()
                .name(SESSION_INDEX.to_owned())
                .build(),
        )
        .build()
}

/// The TTL index on `sessions.ping`: dead sessions' documents are swept
/// [`SESSION_SWEEP`] after their last ping (the seeds' 4-day clean-up). Lock
/// documents are never swept: they carry the token forward.
pub(crate) fn ping_index() -> IndexModel {
    IndexModel::builder()
        .keys(doc! { "ping": 1 })
        .options(
            IndexOptions::builder()
                .name(PING_INDEX.to_owned())
                .expire_after(SESSION_SWEEP)
                .build(),
        )
        .build()
}

fn token_bson(token: u64) -> i64 {
    i64::try_from(token).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(n: &str) -> LockName {
        LockName::new(n).unwrap()
    }

    #[test]
    fn expiry_expressions_use_the_server_clock() {
        assert_eq!(
            is_expired(),
            doc! { "$lte": [{ "$ifNull": ["$expiresAt", DateTime::from_millis(0)] }, "$$NOW"] }
        );
        assert_eq!(
            is_live(),
            doc! { "$gt": [{ "$ifNull": ["$expiresAt", DateTime::from_millis(0)] }, "$$NOW"] }
        );
        assert_eq!(
            remaining_ms(),
            doc! { "$subtract": [{ "$ifNull": ["$expiresAt", DateTime::from_millis(0)] }, "$$NOW"] }
        );
    }

    #[test]
    fn take_filter_has_no_expr() {
        // An upsert filter may not contain $expr (server error 224).
        assert_eq!(take_filter(&name("a/b")), doc! { "_id": "a/b" });
    }

    #[test]
    fn tombstone_update_exact() {
        let list = doc! { "$ifNull": ["$ended", []] };
        let alive = doc! { "$concatArrays": [
            { "$filter": {
                "input": { "$slice": [
                    list.clone(),
                    { "$max": [0_i64, { "$subtract": [{ "$size": list.clone() }, 32_i64] }] },
                ] },
                "as": "e",
                "cond": { "$or": [
                    { "$ne": [{ "$type": "$$e" }, "object"] },
                    { "$gt": ["$$e.u", "$$NOW"] },
                ] },
            } },
            { "$slice": [list, -32_i64] },
        ] };
        assert_eq!(
            tombstone_update("o#1", Duration::from_secs(120)),
            vec![doc! { "$set": { "ended": { "$slice": [
                { "$let": {
                    "vars": { "alive": alive },
                    "in": { "$cond": {
                        "if": { "$in": [{ "$literal": "o#1" }, { "$ifNull": ["$$alive.o", []] }] },
                        "then": "$$alive",
                        "else": { "$concatArrays": ["$$alive", [
                            { "o": { "$literal": "o#1" }, "u": { "$add": ["$$NOW", 120_000_i64] } },
                        ]] },
                    } },
                } },
                -1024_i64,
            ] } } }]
        );
    }

    /// S5 on the server: every attempt that ended within its tombstone's
    /// life refuses its late take, however many ended after it; a retried
    /// end is kept once; a tombstone whose life is over still refuses while
    /// among the last 32 ends and is dropped after; an entry of the older
    /// format (a bare id) is kept.
    /// Red before (the list kept the last 32 ends, whatever their age):
    /// the first of 40 ended attempts was granted.
    #[tokio::test]
    async fn ended_attempts_refuse_their_late_takes_for_their_life() {
        let clients = crate::test_server::clients().await;
        let locks = clients.op(None).conn.locks.clone();
        let lock = name(&format!("ended-{}", ObjectId::new()));
        let at = || take_filter(&lock);
        // Runs `owner`'s take on the lock's document; its holder after.
        let take = async |owner: &str| {
            let spec = TakeSpec {
                session: "s",
                owner,
                why: None,
                ts: ObjectId::new(),
                ttl: Duration::from_secs(5),
            };
            locks.update_one(at(), take_update(&spec)).await.unwrap();
            let doc = locks.find_one(at()).await.unwrap().unwrap();
            doc.get_str("who").ok().map(str::to_owned)
        };
        let end = async |owner: &str, life: Duration| {
            locks
                .update_one(at(), tombstone_update(owner, life))
                .await
                .unwrap();
        };
        locks
            .insert_one(doc! { "_id": lock.as_str(), "ended": ["older"] })
            .await
            .unwrap();
        let life = Duration::from_secs(120);
        for i in 0..40 {
            end(&format!("o#{i}"), life).await;
        }
        end("o#3", life).await;
        assert_eq!(
            take("o#0").await,
            None,
            "the first ended attempt's late take"
        );
        let doc = locks.find_one(at()).await.unwrap().unwrap();
        let ended = doc.get_array("ended").unwrap();
        assert_eq!(ended.len(), 41, "{ended:?}");
        assert_eq!(ended[0].as_str(), Some("older"));
        assert_eq!(
            take("p#1").await,
            Some("p#1".to_owned()),
            "an attempt that did not end"
        );
        // A life over by the server's clock: still refused while among
        // the last 32 ends, gone once older ends follow.
        end("short", Duration::from_millis(1)).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        end("n#0", life).await;
        locks.update_one(at(), free_update()).await.unwrap();
        assert_eq!(
            take("short").await,
            None,
            "a late take past its life, 2 ends later"
        );
        assert_eq!(
            take("p#2").await,
            Some("p#2".to_owned()),
            "the lock was free"
        );
        for i in 1..33 {
            end(&format!("n#{i}"), life).await;
        }
        let doc = locks.find_one(at()).await.unwrap().unwrap();
        let owners: Vec<_> = doc
            .get_array("ended")
            .unwrap()
            .iter()
            .map(|e| e.as_document().map_or("older", |e| e.get_str("o").unwrap()))
            .collect();
        assert_eq!(owners.len(), 1 + 40 + 33, "{owners:?}");
        assert!(!owners.contains(&"short"), "{owners:?}");
        assert_eq!((owners[0], owners[1], owners[73]), ("older", "o#0", "n#32"));
        locks.delete_one(at()).await.unwrap();
    }

    #[test]
    fn take_update_exact() {
        let ts = ObjectId::parse_str("0123456789abcdef01234567").unwrap();
        let spec = TakeSpec {
            session: "h:1:2:3",
            owner: "h:1:2:3#00000000000000ff",
            why: Some("$token"),
            ts,
            ttl: Duration::from_millis(1500),
        };
        let expected = vec![doc! {
            "$replaceWith": {
                "$cond": {
                    "if": { "$and": [
                        { "$lte": [{ "$ifNull": ["$expiresAt", DateTime::from_millis(0)] }, "$$NOW"] },
                        { "$not": [{ "$in": [
                            { "$literal": "h:1:2:3#00000000000000ff" },
                            { "$ifNull": ["$ended.o", []] },
                        ] }] },
                    ] },
                    "then": { "$mergeObjects": ["$$ROOT", {
                        "state": 2,
                        "session": { "$literal": "h:1:2:3" },
                        "who": { "$literal": "h:1:2:3#00000000000000ff" },
                        "why": { "$literal": "$token" },
                        "when": "$$NOW",
                        "ts": ts,
                        "token": { "$add": [{ "$ifNull": ["$token", 0_i64] }, 1_i64] },
                        "expiresAt": { "$add": ["$$NOW", 1500_i64] },
                        "prev": {
                            "state": "$state",
                            "session": "$session",
                            "who": "$who",
                            "why": "$why",
                            "token": "$token",
                            "expiresAt": "$expiresAt",
                        },
                    }] },
                    "else": {
                        "$cond": {
                            "if": { "$and": [
                                { "$eq": ["$who", { "$literal": "h:1:2:3#00000000000000ff" }] },
                                { "$not": [{ "$in": [
                                    { "$literal": "h:1:2:3#00000000000000ff" },
                                    { "$ifNull": ["$ended.o", []] },
                                ] }] },
                            ] },
                            "then": { "$mergeObjects": ["$$ROOT", {
                                "expiresAt": { "$max": ["$expiresAt", { "$add": ["$$NOW", 1500_i64] }] },
                            }] },
                            "else": "$$ROOT",
                        }
                    },
                }
            }
        }];
        assert_eq!(take_update(&spec), expected);

        let without_why = take_update(&TakeSpec { why: None, ..spec });
        let then = without_why[0]
            .get_document("$replaceWith")
            .and_then(|d| d.get_document("$cond"))
            .and_then(|d| d.get_document("then"))
            .and_then(|d| d.get_array("$mergeObjects"))
            .unwrap();
        let holder = then[1].as_document().unwrap();
        assert_eq!(holder.get("why"), Some(&Bson::Null));
        // Tokens are 64-bit from the first grant on.
        assert!(matches!(
            holder
                .get_document("token")
                .unwrap()
                .get_array("$add")
                .unwrap()[1],
            Bson::Int64(1)
        ));
    }

    #[test]
    fn take_projection_exact() {
        assert_eq!(
            take_projection(),
            doc! {
                "_id": 0, "state": 1, "session": 1, "who": 1, "ts": 1, "token": 1, "prev": 1,
                "remaining": { "$subtract": [{ "$ifNull": ["$expiresAt", DateTime::from_millis(0)] }, "$$NOW"] },
            }
        );
    }

    #[test]
    fn owner_checked_filters_exact() {
        let live =
            doc! { "$gt": [{ "$ifNull": ["$expiresAt", DateTime::from_millis(0)] }, "$$NOW"] };
        assert_eq!(
            release_filter(&name("x"), "s", "s#1", 7),
            doc! { "_id": "x", "session": "s", "who": "s#1", "token": 7_i64, "$expr": live.clone() }
        );
        assert_eq!(
            abandon_filter(&name("x"), "s#1"),
            doc! { "_id": "x", "who": "s#1", "$expr": live.clone() }
        );
        assert_eq!(
            held_filter(&name("x")),
            doc! { "_id": "x", "$expr": live.clone() }
        );
        assert_eq!(
            validate_filter(&name("x"), 3),
            doc! { "_id": "x", "token": 3_i64, "$expr": live.clone() }
        );
        assert_eq!(
            session_filter("s"),
            doc! { "session": "s", "$expr": live.clone() }
        );
        assert_eq!(
            list_filter("jobs/"),
            doc! { "_id": { "$gte": "jobs/", "$lt": "jobs/~" }, "$expr": live.clone() }
        );
        assert_eq!(
            list_filter(""),
            doc! { "_id": { "$gte": "", "$lt": "~" }, "$expr": live }
        );
    }

    #[test]
    fn free_update_keeps_the_token() {
        let u = free_update();
        assert_eq!(
            u,
            doc! {
                "$set": { "state": 0, "expiresAt": DateTime::from_millis(0) },
                "$unset": { "session": "", "who": "", "why": "" },
            }
        );
        assert!(!u.get_document("$set").unwrap().contains_key("token"));
        assert!(!u.get_document("$unset").unwrap().contains_key("token"));
    }

    #[test]
    fn renewal_exact() {
        let holds = [
            HoldRef {
                name: "a",
                owner: "s#1",
                token: 4,
            },
            HoldRef {
                name: "b/c",
                owner: "s#2",
                token: 9,
            },
        ];
        assert_eq!(
            renew_filter("s", &holds),
            doc! {
                "_id": { "$in": ["a", "b/c"] },
                "who": { "$in": ["s#1", "s#2"] },
                "token": { "$in": [4_i64, 9_i64] },
                "session": "s",
                "$expr": { "$gt": [{ "$ifNull": ["$expiresAt", DateTime::from_millis(0)] }, "$$NOW"] },
            }
        );
        assert_eq!(
            renew_update(Duration::from_secs(2)),
            vec![
                doc! { "$set": { "expiresAt": { "$max": ["$expiresAt", { "$add": ["$$NOW", 2000_i64] }] } } }
            ]
        );
        assert_eq!(ping_filter("s"), doc! { "_id": "s" });
        assert_eq!(ping_update(), vec![doc! { "$set": { "ping": "$$NOW" } }]);
    }

    #[test]
    fn wake_pipeline_matches_frees_only() {
        let p = wake_pipeline();
        assert_eq!(p.len(), 1);
        let branches = p[0]
            .get_document("$match")
            .unwrap()
            .get_array("$or")
            .unwrap();
        assert_eq!(
            branches[0],
            Bson::Document(
                doc! { "operationType": "update", "updateDescription.updatedFields.state": 0 }
            )
        );
        assert_eq!(branches.len(), 3);
    }

    #[test]
    fn index_models_exact() {
        let session = mongodb::bson::to_document(&session_index()).unwrap();
        assert_eq!(
            session,
            doc! { "key": { "session": 1 }, "name": "dlock_session" }
        );
        let ping = mongodb::bson::to_document(&ping_index()).unwrap();
        assert_eq!(
            ping,
            doc! { "key": { "ping": 1 }, "expireAfterSeconds": 345_600_i32, "name": "dlock_ping_ttl" }
        );
    }
}
