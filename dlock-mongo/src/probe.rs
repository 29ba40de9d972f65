//! The connect-time compatibility probe: does the server run the take?
//!
//! Every grant is one `findAndModify` whose update is an aggregation
//! pipeline reading `$$NOW` (inside `$replaceWith` → `$cond` →
//! `$mergeObjects` → a document literal), with an upsert and a projection
//! that computes `expiresAt − $$NOW`. MongoDB runs it from 4.4 on (update
//! pipelines and `$$NOW` came in 4.2, expressions in `findAndModify`
//! projections in 4.4). Mongo-compatible servers differ: stock Microsoft
//! DocumentDB (the engine under FerretDB 2 and Azure Cosmos DB for MongoDB
//! vCore) refuses `$$NOW` in write commands unless
//! `documentdb.enableVariablesSupportForWriteCommands` is on, and even then,
//! before a fix, refused it inside a document literal with code 9
//! (`FailedToParse`, "The $$NOW operator cannot be used within this specific
//! context"); other services lack update pipelines altogether. A server
//! version says none of this, so connect **runs the take itself** once, on
//! a scratch document of the session collection, and refuses the server with
//! [`Error::Config`] naming the missing feature, rather than letting the
//! first acquire fail.
//!
//! It then checks, on a second scratch document, that the take of an
//! attempt whose end left its tombstone grants nothing (S5).
//!
//! The scratch documents (`_id: "dlock-probe:<ObjectId>"`, and the same
//! with `:ended`) are deleted at once; should the delete not happen (a
//! cancelled connect, a lost reply) they also carry `ping`, so the session
//! collection's TTL index sweeps them after
//! [`SESSION_SWEEP`](crate::SESSION_SWEEP).

use std::time::Duration;

use dlock_core::Error;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Bson, Document, doc};
use mongodb::options::ReturnDocument;

use crate::SCHEME;
use crate::client::Clients;
use crate::query::{self, TakeSpec};
use crate::store::{Class, TakeReply, classify, error_code, map_err, read_take};

/// What the probe checks, for messages: the feature the take needs.
pub(crate) const FEATURE: &str = "a findAndModify whose update is an aggregation pipeline \
     using $$NOW (inside $replaceWith/$mergeObjects) with an upsert and a $$NOW projection \
     (MongoDB 4.4 semantics)";

/// The probe's scratch owner: never a real session's (those are
/// `host:pid:start:random`).
const PROBE_SESSION: &str = "dlock-probe";

/// Server codes that mean "no permission", not "no such feature": the probe
/// reports them as they are (the first acquire would fail the same way).
const PERMISSION_CODES: &[i32] = &[
    13,   // Unauthorized
    8000, // AtlasError ("user is not allowed to do action ...")
];

/// Runs the take's update on a scratch document; `Ok` if the server ran it
/// as MongoDB does.
pub(crate) async fn check(clients: &Clients) -> Result<(), Error> {
    check_with(clients, None).await
}

/// [`check`], with the take's pipeline replaced by `pipeline` (tests: a
/// pipeline the server must refuse exercises the refusal path on a real
/// server).
pub(crate) async fn check_with(
    clients: &Clients,
    pipeline: Option<Vec<Document>>,
) -> Result<(), Error> {
    let ts = ObjectId::new();
    let id = format!("{PROBE_SESSION}:{ts}");
    let owner = format!("{id}#probe");
    let spec = TakeSpec {
        session: PROBE_SESSION,
        owner: &owner,
        why: Some("$$NOW"),
        ts,
        ttl: Duration::from_secs(60),
    };
    let mut update = pipeline.unwrap_or_else(|| query::take_update(&spec));
    // The session heartbeat's stage, and what lets the TTL index sweep a
    // scratch document that is left behind.
    update.extend(query::ping_update());
    let op = clients.op(None);
    let r = op
        .conn
        .sessions
        .find_one_and_update(doc! { "_id": &id }, update)
        .upsert(true)
        .return_document(ReturnDocument::After)
        .projection(probe_projection())
        .await;
    let reply = op.done(r).map_err(refusal)?;
    let ended = format!("{id}:ended");
    let refused = match judge(reply.as_ref(), &owner, ts) {
        Ok(()) => refuses_ended(clients, &ended).await,
        Err(e) => Err(e),
    };
    let op = clients.op(None);
    let r = op
        .conn
        .sessions
        .delete_many(doc! { "_id": { "$in": [&id, &ended] } })
        .await;
    if let Err(e) = op.done(r) {
        tracing::debug!(error = %e, id, "probe documents not deleted (their TTL index sweeps them)");
    }
    refused
}

/// On scratch document `id`: an attempt's tombstone, then that attempt's
/// take, which must not grant (S5 rests on the server's running the
/// tombstone's update, a `$filter` by `$$NOW` inside `$let`, and reading
/// `$ended.o` as the list of the entries' `o`).
async fn refuses_ended(clients: &Clients, id: &str) -> Result<(), Error> {
    let owner = format!("{id}#probe");
    let mut tombstone = query::tombstone_update(&owner, Duration::from_secs(60));
    tombstone.extend(query::ping_update());
    let op = clients.op(None);
    let r = op
        .conn
        .sessions
        .update_one(doc! { "_id": id }, tombstone)
        .upsert(true)
        .await;
    op.done(r).map_err(refusal)?;
    let spec = TakeSpec {
        session: PROBE_SESSION,
        owner: &owner,
        why: None,
        ts: ObjectId::new(),
        ttl: Duration::from_secs(60),
    };
    let op = clients.op(None);
    let r = op
        .conn
        .sessions
        .find_one_and_update(doc! { "_id": id }, query::take_update(&spec))
        .return_document(ReturnDocument::After)
        .projection(query::take_projection())
        .await;
    match op.done(r).map_err(refusal)? {
        Some(doc) if doc.get_str("who").ok() != Some(owner.as_str()) => Ok(()),
        reply => Err(unsupported(&format!(
            "the take of an attempt that ended was not refused (reply: {reply:?})"
        ))),
    }
}

/// The take's projection plus the fields the probe checks.
fn probe_projection() -> Document {
    let mut p = query::take_projection();
    p.insert("why", 1);
    p.insert("when", 1);
    p.insert("ping", 1);
    p
}

/// Whether the reply is what MongoDB returns for a fresh grant: token 1,
/// `why` stored as text (`$literal`), `when` and `ping` dates, and
/// `remaining` about the TTL.
fn judge(reply: Option<&Document>, owner: &str, ts: ObjectId) -> Result<(), Error> {
    let Some(doc) = reply else {
        return Err(unsupported(
            "an upserting findAndModify returned no document",
        ));
    };
    let wrong = |what: &str| unsupported(&format!("{what} (reply: {doc})"));
    match read_take(doc, owner, ts) {
        Ok(TakeReply::Granted { token, fresh: true }) if token.get() == 1 => {}
        Ok(_) | Err(_) => return Err(wrong("the take did not grant a fresh lock with token 1")),
    }
    if !matches!(doc.get("why"), Some(Bson::String(s)) if s == "$$NOW") {
        return Err(wrong("$literal was not kept as text"));
    }
    for field in ["when", "ping"] {
        if !matches!(doc.get(field), Some(Bson::DateTime(_))) {
            return Err(wrong(&format!("$$NOW did not yield a date in `{field}`")));
        }
    }
    Ok(())
}

/// The probe's error: a server refusal that is not about permissions names
/// the missing feature; anything else (network, authentication, TLS,
/// permissions) is mapped as for any request.
pub(crate) fn refusal(e: mongodb::error::Error) -> Error {
    let code = error_code(&e);
    if classify(&e) != Class::Refused || code.is_some_and(|c| PERMISSION_CODES.contains(&c)) {
        return map_err(e);
    }
    let detail = match e.kind.as_ref() {
        mongodb::error::ErrorKind::Command(c) => {
            format!("code {} {}: {}", c.code, c.code_name, c.message)
        }
        _ => e.kind.to_string(),
    };
    unsupported(&format!("the server refused it ({detail})"))
}

fn unsupported(why: &str) -> Error {
    Error::Config(format!(
        "{SCHEME}: the server does not support what every lock grant needs: {FEATURE}; {why}. \
         dlock-mongo needs MongoDB 4.4 or newer; a self-run Microsoft DocumentDB (or \
         FerretDB 2 on it) needs documentdb.enableNowSystemVariable and \
         documentdb.enableVariablesSupportForWriteCommands on; see the dlock-mongo docs, \
         \"Compatibility\""
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::error::{CommandError, ErrorKind};

    fn command_error(code: i32, name: &str, msg: &str) -> mongodb::error::Error {
        let reply = doc! { "ok": 0, "code": code, "codeName": name, "errmsg": msg };
        let err: CommandError = mongodb::bson::from_document(reply).unwrap();
        mongodb::error::Error::from(ErrorKind::Command(err))
    }

    #[test]
    fn refusals_name_the_missing_feature() {
        // Stock DocumentDB on a document literal with $$NOW; mongod < 4.2
        // on an update pipeline; an undefined variable; an unknown stage;
        // a service without findAndModify pipelines.
        for (code, name) in [
            (9, "FailedToParse"),
            (14, "TypeMismatch"),
            (17276, "Location17276"),
            (40324, "Location40324"),
            (115, "CommandNotSupported"),
            (238, "NotImplemented"),
            (2, "BadValue"),
        ] {
            let e = refusal(command_error(
                code,
                name,
                "The $$NOW operator cannot be used within this specific context.",
            ));
            let Error::Config(msg) = &e else {
                panic!("{code}: {e:?}")
            };
            assert!(msg.contains("$$NOW"), "{msg}");
            assert!(msg.contains("update is an aggregation pipeline"), "{msg}");
            assert!(msg.contains(&format!("code {code} {name}")), "{msg}");
            assert!(msg.contains("MongoDB 4.4"), "{msg}");
            assert!(!e.is_retryable());
        }
    }

    #[test]
    fn other_failures_keep_their_meaning() {
        // Permissions: as for any request (the first acquire would say the same).
        for code in PERMISSION_CODES {
            let e = refusal(command_error(*code, "Unauthorized", "not authorized"));
            assert!(matches!(e, Error::Backend { .. }), "{code}: {e:?}");
        }
        // Elections, shutdowns, network: retryable, not "unsupported".
        for code in [10107, 91, 189] {
            let e = refusal(command_error(code, "NotWritablePrimary", "m"));
            assert!(matches!(e, Error::Unavailable { .. }), "{code}: {e:?}");
        }
        let io =
            mongodb::error::Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(matches!(refusal(io), Error::Unavailable { .. }));
    }

    /// On the real server: the take's pipeline passes; a pipeline it
    /// refuses, and one it runs but that does not grant, are `Config`
    /// errors naming the feature (the paths a server without `$$NOW` in
    /// write commands takes).
    #[tokio::test]
    async fn probe_on_the_test_server() {
        let clients = crate::test_server::clients().await;
        check(&clients).await.unwrap();
        let refused = check_with(
            &clients,
            Some(vec![doc! { "$set": { "x": "$$DLOCK_NO_SUCH_VARIABLE" } }]),
        )
        .await
        .unwrap_err();
        let Error::Config(msg) = &refused else {
            panic!("{refused:?}")
        };
        eprintln!("refused: {msg}");
        assert!(msg.contains("the server refused it (code "), "{msg}");
        assert!(msg.contains(FEATURE), "{msg}");
        let ignored = check_with(&clients, Some(vec![doc! { "$set": { "x": 1 } }]))
            .await
            .unwrap_err();
        assert!(
            matches!(&ignored, Error::Config(m) if m.contains("did not grant")),
            "{ignored:?}"
        );
    }

    #[test]
    fn replies_are_judged_like_mongod() {
        let ts = ObjectId::new();
        let owner = "dlock-probe:x#probe";
        let now = mongodb::bson::DateTime::now();
        let good = doc! {
            "state": 2, "session": PROBE_SESSION, "who": owner, "ts": ts, "token": 1_i64,
            "why": "$$NOW", "when": now, "ping": now, "remaining": 60_000_i64,
        };
        judge(Some(&good), owner, ts).unwrap();

        let mut bad = Vec::new();
        bad.push(None);
        // $$NOW stored as text, or missing: no date, and no `remaining`.
        let mut d = good.clone();
        d.insert("when", "$$NOW");
        bad.push(Some(d));
        let mut d = good.clone();
        d.remove("ping");
        bad.push(Some(d));
        // $literal evaluated (or dropped) instead of kept.
        let mut d = good.clone();
        d.insert("why", now);
        bad.push(Some(d));
        // No projection expression: no `remaining`.
        let mut d = good.clone();
        d.remove("remaining");
        bad.push(Some(d));
        // Not granted to the probe, or not a first grant.
        let mut d = good.clone();
        d.insert("who", "someone");
        bad.push(Some(d));
        let mut d = good.clone();
        d.insert("token", 2_i64);
        bad.push(Some(d));
        for reply in bad {
            let e = judge(reply.as_ref(), owner, ts).unwrap_err();
            assert!(
                matches!(&e, Error::Config(m) if m.contains("$$NOW")),
                "{e:?}"
            );
        }
    }
}
