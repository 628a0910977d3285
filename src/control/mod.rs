//! Operators' bans and overrides, set through the admin API and enforced on every replica:
//! the live table the request path reads, and its changes (kept in Redis with `backend:
//! redis`, see `sync`; in memory with `backend: local`).
//!
//! The request path pays one atomic load while there is no entry (`active`). With entries, a
//! request reads the wall clock once and tests each ban (and each override of each of its
//! limits) in turn: an address test, or one BLAKE3 digest of a short header or cookie value.
//! Entries are few (an incident's handful), so a list beats an index.

pub mod entry;
mod sync;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};

pub use self::entry::{Ban, BanView, Override, OverrideView};
pub use self::sync::run;
use crate::identity::RequestView;
use crate::limiter::redis::RedisLimiter;
use crate::limiter::{Limit, Tuning};
use crate::response::{fixed, Body};
use crate::Small;

/// The entries in force (and those expired but not yet swept: matching skips them).
#[derive(Debug, Default, Clone)]
pub struct InForce {
    /// Longest-lasting first: the first ban that matches answers with the longest wait.
    bans: Vec<Ban>,
    /// Newest first: of two overrides for one identity, the latest one applies.
    overrides: Vec<Override>,
}

impl InForce {
    fn new(mut bans: Vec<Ban>, mut overrides: Vec<Override>) -> Self {
        bans.sort_by_key(|b| std::cmp::Reverse(b.span.expires_ms));
        overrides.sort_by_key(|o| std::cmp::Reverse(o.span.created_ms));
        Self { bans, overrides }
    }

    fn is_empty(&self) -> bool {
        self.bans.is_empty() && self.overrides.is_empty()
    }

    /// The ban in force at `now_ms` that holds `view`'s requests on `route`.
    pub fn ban_for(&self, view: &RequestView<'_>, route: &str, now_ms: i64) -> Option<&Ban> {
        self.bans
            .iter()
            .find(|b| !b.span.expired(now_ms) && b.holds(view, route))
    }

    /// The override in force at `now_ms` of `limit` for `view`.
    pub fn override_for(
        &self,
        limit: &str,
        view: &RequestView<'_>,
        now_ms: i64,
    ) -> Option<&Override> {
        self.overrides
            .iter()
            .find(|o| o.limit == limit && !o.span.expired(now_ms) && o.matcher.matches(view))
    }

    /// The numbers `limit` counts `view` at, when an override applies (and fits the limit's
    /// kind, which a reload may have changed).
    pub fn tuning(&self, limit: &Limit, view: &RequestView<'_>, now_ms: i64) -> Option<&Tuning> {
        self.override_for(&limit.name, view, now_ms)
            .map(|o| &o.tuning)
            .filter(|t| entry::fits(t, limit))
    }

    /// The answer to `view`'s request on `route` when a ban in force refuses it.
    pub fn refusal_of(&self, view: &RequestView<'_>, route: &str) -> Option<Response<Body>> {
        let now = entry::now_ms();
        self.ban_for(view, route, now).map(|ban| refusal(ban, now))
    }

    /// The numbers each of `limits` counts `view` at now (`None`: the limit's own); empty
    /// when there is no override at all.
    pub fn tunings(&self, view: &RequestView<'_>, limits: &[Arc<Limit>]) -> Small<Option<&Tuning>> {
        if self.overrides.is_empty() {
            return Small::new();
        }
        let now = entry::now_ms();
        limits.iter().map(|l| self.tuning(l, view, now)).collect()
    }

    /// The entries expired at `now_ms`, and the table without them (`None`: none expired).
    fn without_expired(&self, now_ms: i64) -> Option<(Vec<Ban>, Vec<Override>, InForce)> {
        let gone = |s: entry::Span| s.expired(now_ms);
        if !self.bans.iter().any(|b| gone(b.span)) && !self.overrides.iter().any(|o| gone(o.span)) {
            return None;
        }
        let (old_bans, bans) = self.bans.iter().cloned().partition(|b| gone(b.span));
        let (old_overrides, overrides) = self.overrides.iter().cloned().partition(|o| gone(o.span));
        Some((old_bans, old_overrides, InForce { bans, overrides }))
    }
}

/// What a change is about, for Redis and the logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Ban,
    Override,
}

/// The operators' entries of one proxy. Survives reloads (it lives in `State`).
#[derive(Debug, Default)]
pub struct Control {
    /// Some entry exists: the request path reads this and nothing else while it is false.
    any: AtomicBool,
    table: ArcSwap<InForce>,
    /// Changes and Redis reloads one at a time, so that none is lost or overtaken.
    sync: tokio::sync::Mutex<sync::Synced>,
}

impl Control {
    pub fn new() -> Self {
        Self::default()
    }

    /// The table, when it has entries (one atomic load when it has none).
    #[inline]
    pub fn active(&self) -> Option<Arc<InForce>> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        Some(self.table.load_full())
    }

    fn store(&self, table: InForce) {
        let any = !table.is_empty();
        self.table.store(Arc::new(table));
        self.any.store(any, Ordering::Release);
    }

    /// Every ban, oldest first, as `GET /api/v1/bans` lists them.
    pub fn bans(&self) -> Vec<BanView> {
        let now = entry::now_ms();
        let table = self.table.load();
        let mut bans: Vec<&Ban> = table.bans.iter().filter(|b| !b.span.expired(now)).collect();
        bans.sort_by_key(|b| b.span.created_ms);
        bans.into_iter().map(|b| b.view(now)).collect()
    }

    /// Every override, oldest first, as `GET /api/v1/overrides` lists them.
    pub fn overrides(&self) -> Vec<OverrideView> {
        let now = entry::now_ms();
        let table = self.table.load();
        let mut list: Vec<&Override> = table
            .overrides
            .iter()
            .filter(|o| !o.span.expired(now))
            .collect();
        list.sort_by_key(|o| o.span.created_ms);
        list.into_iter().map(|o| o.view(now)).collect()
    }

    /// The ban that refuses `view`'s requests on `route` now, if any.
    pub fn ban_for(&self, view: &RequestView<'_>, route: &str) -> Option<BanView> {
        let now = entry::now_ms();
        let table = self.active()?;
        table.ban_for(view, route, now).map(|b| b.view(now))
    }

    /// The override of `limit` that applies to `view` now, if any.
    pub fn override_for(&self, limit: &str, view: &RequestView<'_>) -> Option<OverrideView> {
        let now = entry::now_ms();
        let table = self.active()?;
        table.override_for(limit, view, now).map(|o| o.view(now))
    }

    /// Add `ban`: in Redis when `redis` is given (then this replica reloads at once), else
    /// in memory.
    pub async fn add_ban(&self, ban: Ban, redis: Option<&Arc<RedisLimiter>>) -> Result<(), String> {
        let mut synced = self.sync.lock().await;
        match redis {
            Some(r) => {
                sync::put(r, Kind::Ban, &ban.id, &ban.to_record()).await?;
                self.reload(&mut synced, r, true).await?;
            }
            None => {
                let t = self.table.load();
                let mut bans = t.bans.clone();
                bans.push(ban.clone());
                self.store(InForce::new(bans, t.overrides.clone()));
            }
        }
        log_ban("ban created", &ban);
        Ok(())
    }

    /// Add `o` (see `add_ban`).
    pub async fn add_override(
        &self,
        o: Override,
        redis: Option<&Arc<RedisLimiter>>,
    ) -> Result<(), String> {
        let mut synced = self.sync.lock().await;
        match redis {
            Some(r) => {
                sync::put(r, Kind::Override, &o.id, &o.to_record()).await?;
                self.reload(&mut synced, r, true).await?;
            }
            None => {
                let t = self.table.load();
                let mut overrides = t.overrides.clone();
                overrides.push(o.clone());
                self.store(InForce::new(t.bans.clone(), overrides));
            }
        }
        log_override("override created", &o);
        Ok(())
    }

    /// Remove entry `id` of `kind`; `false` when there is none.
    pub async fn remove(
        &self,
        kind: Kind,
        id: &str,
        redis: Option<&Arc<RedisLimiter>>,
    ) -> Result<bool, String> {
        let mut synced = self.sync.lock().await;
        let now = entry::now_ms();
        let t = self.table.load_full();
        let (mut bans, mut overrides) = (t.bans.clone(), t.overrides.clone());
        let removed = match kind {
            Kind::Ban => take(&mut bans, |b| b.id == id && !b.span.expired(now)),
            Kind::Override => take(&mut overrides, |o| o.id == id && !o.span.expired(now)),
        };
        match redis {
            Some(r) => {
                let deleted = sync::delete(r, kind, id).await?;
                self.reload(&mut synced, r, true).await?;
                if !deleted {
                    return Ok(false);
                }
            }
            None if removed.is_none() => return Ok(false),
            None => self.store(InForce::new(bans, overrides)),
        }
        match removed {
            Some(Removed::Ban(b)) => log_ban("ban deleted", &b),
            Some(Removed::Override(o)) => log_override("override deleted", &o),
            None => tracing::info!(target: "tollgate::admin", id, ?kind, "entry deleted"),
        }
        Ok(true)
    }

    /// Drop the entries expired by now, logging each; in Redis too when `redis` is given
    /// (logged by the replica whose delete took it out). Under the sync lock (`synced`), so
    /// that no change is overwritten.
    async fn sweep(&self, synced: &mut sync::Synced, redis: Option<&RedisLimiter>) {
        let Some((bans, overrides, rest)) = self.table.load().without_expired(entry::now_ms())
        else {
            return;
        };
        self.store(rest);
        let expired = bans
            .iter()
            .map(|b| (Kind::Ban, b.id.as_str()))
            .chain(overrides.iter().map(|o| (Kind::Override, o.id.as_str())));
        let mut by_us = Vec::new();
        for (kind, id) in expired {
            by_us.push(match redis {
                Some(r) => match sync::delete(r, kind, id).await {
                    Ok(deleted) => deleted,
                    Err(_) => {
                        // Read everything again once Redis answers, and delete it then.
                        synced.forget();
                        false
                    }
                },
                None => true,
            });
        }
        let (for_bans, for_overrides) = by_us.split_at(bans.len());
        for (b, _) in bans.iter().zip(for_bans).filter(|(_, by_us)| **by_us) {
            log_ban("ban expired", b);
        }
        for (o, _) in overrides
            .iter()
            .zip(for_overrides)
            .filter(|(_, by_us)| **by_us)
        {
            log_override("override expired", o);
        }
    }
}

/// An entry taken out of a list.
enum Removed {
    Ban(Ban),
    Override(Override),
}

trait IntoRemoved {
    fn removed(self) -> Removed;
}

impl IntoRemoved for Ban {
    fn removed(self) -> Removed {
        Removed::Ban(self)
    }
}

impl IntoRemoved for Override {
    fn removed(self) -> Removed {
        Removed::Override(self)
    }
}

/// Take the first item of `list` that `pred` holds for.
fn take<T: IntoRemoved>(list: &mut Vec<T>, pred: impl Fn(&T) -> bool) -> Option<Removed> {
    let i = list.iter().position(pred)?;
    Some(list.remove(i).removed())
}

fn log_ban(what: &'static str, b: &Ban) {
    let ttl_s = b.span.left_s(entry::now_ms());
    tracing::info!(
        target: "tollgate::admin",
        id = %b.id,
        identity = %b.identity,
        ttl_s,
        reason = ?b.reason,
        routes = ?b.routes,
        "{what}"
    );
}

fn log_override(what: &'static str, o: &Override) {
    let ttl_s = o.span.left_s(entry::now_ms());
    tracing::info!(
        target: "tollgate::admin",
        id = %o.id,
        limit = %o.limit,
        identity = %o.identity,
        rate = o.rate.as_deref(),
        burst = o.burst,
        quota = o.quota.as_deref(),
        ttl_s,
        reason = ?o.reason,
        "{what}"
    );
}

/// The answer to a request an operator's ban refuses: `403 Forbidden`, problem+json, with
/// `Retry-After` the ban's remaining seconds. The reason stays in the operators' logs.
pub fn refusal(ban: &Ban, now_ms: i64) -> Response<Body> {
    let left = ban.span.left_s(now_ms).max(1);
    let body = format!(
        "{{\"type\":\"urn:tollgate:problem:operator-ban\",\"title\":\"Forbidden\",\"status\":403,\
         \"detail\":\"Refused by an operator's ban; retry in {left} s.\",\"ban\":{},\
         \"retry_after\":{left}}}\n",
        serde_json::Value::from(ban.id.as_str())
    );
    let mut res = fixed(
        StatusCode::FORBIDDEN,
        "application/problem+json",
        Bytes::from(body),
    );
    res.headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from(left));
    res
}
