//! [`MongoFence`]: a lock's fencing token checked where the protected data
//! lives, when that is a MongoDB document.

use dlock_core::{FenceError, FencingToken, StaleToken};
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};
use mongodb::results::{InsertOneResult, UpdateResult};

/// Fenced updates of MongoDB documents: the token is kept in a field of the
/// protected document itself (default `fence`), and an update goes through
/// only if that field holds no newer token, in the update's own filter,
/// atomically on the server; it also records the token. An older token is
/// [`FenceError::Stale`] and writes nothing. Equal tokens are accepted, so a
/// holder may write many times.
///
/// Tokens are stored as 64-bit integers. Tokens are per lock name: guard one
/// document with one lock name on one backend.
///
/// Rules of use:
/// * **A protected document always carries the fence field.** One without it
///   accepts any token, so create documents through
///   [`insert_one`](Self::insert_one) (or set the field yourself), and never
///   replace one without it.
/// * With [`filter`](Self::filter) and [`update`](Self::update) in your own
///   call, do not upsert on a filter that is not unique: a refused update
///   would insert a second document instead.
/// * The field must hold a number (dlock writes Int64); a string there
///   compares as no token at all.
///
/// ```no_run
/// # async fn demo(accounts: mongodb::Collection<mongodb::bson::Document>, guard: dlock_core::LockGuard) -> Result<(), dlock_core::FenceError> {
/// use dlock_mongo::MongoFence;
/// use mongodb::bson::doc;
///
/// let fence = MongoFence::new();
/// fence
///     .update_one(&accounts, doc! { "_id": 42 }, doc! { "$inc": { "balance": -10 } }, guard.token())
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MongoFence {
    field: String,
}

impl Default for MongoFence {
    fn default() -> Self {
        Self::new()
    }
}

impl MongoFence {
    /// The fence in the field `fence`.
    pub fn new() -> Self {
        Self::in_field("fence")
    }

    /// The fence in the field `field` of the protected documents.
    pub fn in_field(field: impl Into<String>) -> Self {
        Self {
            field: field.into(),
        }
    }

    /// `filter`, narrowed to documents whose fence holds no newer token than
    /// `token` (a missing field counts as none).
    pub fn filter(&self, filter: Document, token: FencingToken) -> Result<Document, FenceError> {
        let t = self.value(token)?;
        Ok(doc! { "$and": [filter, { self.field.as_str(): { "$not": { "$gt": t } } }] })
    }

    /// `update` (operators such as `$set`, `$inc`), with the token recorded
    /// in the fence field.
    pub fn update(
        &self,
        mut update: Document,
        token: FencingToken,
    ) -> Result<Document, FenceError> {
        let t = self.value(token)?;
        let mut set = match update.remove("$set") {
            Some(Bson::Document(set)) => set,
            None => Document::new(),
            Some(_) => {
                return Err(FenceError::InvalidResource {
                    resource: self.field.clone(),
                    why: "the update's $set is not a document",
                });
            }
        };
        set.insert(self.field.as_str(), t);
        update.insert("$set", set);
        Ok(update)
    }

    /// Updates the document `filter` matches with `update` if `token` is
    /// current: the update's result (no match: no such document);
    /// [`FenceError::Stale`] if the document holds a newer token.
    pub async fn update_one(
        &self,
        collection: &Collection<Document>,
        filter: Document,
        update: Document,
        token: FencingToken,
    ) -> Result<UpdateResult, FenceError> {
        let resource = self.resource(collection);
        let t = self.value(token)?;
        let result = collection
            .update_one(
                self.filter(filter.clone(), token)?,
                self.update(update, token)?,
            )
            .await
            .map_err(|e| store_error(&resource, e))?;
        if result.matched_count > 0 {
            return Ok(result);
        }
        // Nothing matched: a newer token (of any numeric type), or no such
        // document. A newer token never goes away, so finding one is sure;
        // not finding one is as of this read.
        let newer = collection
            .find_one(doc! { "$and": [filter, { self.field.as_str(): { "$gt": t } }] })
            .await
            .map_err(|e| store_error(&resource, e))?;
        match newer.as_ref().and_then(|d| d.get(self.field.as_str())) {
            Some(highest) => Err(FenceError::Stale {
                resource,
                stale: StaleToken {
                    token,
                    highest: FencingToken::new(as_token(highest).unwrap_or(u64::MAX)),
                },
            }),
            None => Ok(result),
        }
    }

    /// Inserts `document` as a protected one, its fence field set to
    /// `token`, so that no older holder can update it afterwards.
    pub async fn insert_one(
        &self,
        collection: &Collection<Document>,
        mut document: Document,
        token: FencingToken,
    ) -> Result<InsertOneResult, FenceError> {
        document.insert(self.field.as_str(), self.value(token)?);
        collection
            .insert_one(document)
            .await
            .map_err(|e| store_error(&self.resource(collection), e))
    }

    /// What errors name: the collection and the field, never the filter
    /// (which may hold data).
    fn resource(&self, collection: &Collection<Document>) -> String {
        format!("{}/{}", collection.namespace(), self.field)
    }

    fn value(&self, token: FencingToken) -> Result<i64, FenceError> {
        i64::try_from(token.get()).map_err(|_| FenceError::TokenTooLarge {
            resource: self.field.clone(),
            token,
        })
    }
}

/// A fence field's value as a token, whatever numeric type holds it.
fn as_token(value: &Bson) -> Option<u64> {
    match value {
        Bson::Int64(v) => u64::try_from(*v).ok(),
        Bson::Int32(v) => u64::try_from(*v).ok(),
        Bson::Double(v) if *v >= 0.0 => Some(*v as u64),
        _ => None,
    }
}

fn store_error(resource: &str, e: mongodb::error::Error) -> FenceError {
    FenceError::Store {
        resource: resource.to_owned(),
        source: Box::new(e),
    }
}
