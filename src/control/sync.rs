//! The entries fleet-wide, for `backend: redis`: kept in Redis, polled by every replica.
//!
//! Layout (one hash tag, `{tollgate}`, so all of it is one slot on a Redis Cluster):
//! `<key_prefix>control:{tollgate}:bans` and `...:overrides`, hashes of ID -> JSON record (with
//! its absolute expiry), and `...:version`, a counter every change increments in the same
//! script (`write.lua`). Each replica GETs the counter every `POLL_EVERY` and, when it moved,
//! reads both hashes (HGETALL, after the GET: what it reads is at least that version), so a
//! change made on one replica is enforced by all within a second. An expired entry is dropped
//! by every replica on its own clock, and deleted from Redis by whichever replica sweeps it
//! first (the one that logs its expiry).
//!
//! Without Redis the last entries known stay in force (they expire on time all the same), and
//! changes are refused: the API answers 503 rather than keep a change one replica alone knows.
//! A Redis that lost its data (the version counter gone, which no change ever removes) gets
//! back the entries the replicas hold: each writes its own, and logs it.

use std::sync::Arc;
use std::time::Duration;

use ::redis::Value;
use tokio::sync::watch;

use super::{Ban, Control, InForce, Kind, Override};
use crate::limiter::redis::RedisLimiter;

/// How often each replica asks Redis whether the entries changed.
pub const POLL_EVERY: Duration = Duration::from_millis(250);

/// How long a starting proxy waits for Redis's entries before serving without them.
const START_WAIT: Duration = Duration::from_secs(1);

/// The change script (see its header).
const WRITE: &str = include_str!("write.lua");

/// What this replica last read from Redis.
#[derive(Debug, Default)]
pub(super) struct Synced {
    /// The client it was read through (its address): a reload may build another one, to
    /// another Redis.
    from: usize,
    version: Option<String>,
    /// The last poll failed: logged once until one succeeds.
    failing: bool,
}

impl Synced {
    /// Read everything on the next poll, whatever the version says.
    pub(super) fn forget(&mut self) {
        self.version = None;
    }
}

/// The version counter's key, and the hash of `kind`.
fn keys(r: &RedisLimiter, kind: Kind) -> [String; 2] {
    let base = format!("{}control:{{tollgate}}:", r.key_prefix());
    let hash = match kind {
        Kind::Ban => "bans",
        Kind::Override => "overrides",
    };
    [format!("{base}version"), format!("{base}{hash}")]
}

/// Store `record` as entry `id` of `kind`.
pub(super) async fn put(
    r: &RedisLimiter,
    kind: Kind,
    id: &str,
    record: &str,
) -> Result<(), String> {
    let [version, hash] = keys(r, kind);
    r.eval(WRITE, &[&version, &hash], &["put", id, record])
        .await
        .map(|_| ())
}

/// Delete entry `id` of `kind`: `false` when Redis had no such entry.
pub(super) async fn delete(r: &RedisLimiter, kind: Kind, id: &str) -> Result<bool, String> {
    let [version, hash] = keys(r, kind);
    let v = r.eval(WRITE, &[&version, &hash], &["del", id]).await?;
    Ok(matches!(v, Value::Int(1)))
}

impl Control {
    /// Read the entries from Redis if their version moved (always, with `force`), and make
    /// them the table.
    pub(super) async fn reload(
        &self,
        synced: &mut Synced,
        r: &Arc<RedisLimiter>,
        force: bool,
    ) -> Result<(), String> {
        let from = Arc::as_ptr(r) as usize;
        let have = match &synced.version {
            Some(v) if !force && synced.from == from => v.as_str(),
            _ => "",
        };
        let [version, bans] = keys(r, Kind::Ban);
        let [_, overrides] = keys(r, Kind::Override);
        let now = r.command(::redis::cmd("GET").arg(&version)).await?;
        let Some(now) = text(&now) else {
            // No counter: no change was ever made (each one counts, in the same script), or
            // Redis lost its data. Either way there is nothing to read, and a proxy whose API
            // goes unused needs no more than GET (see the ACL in docs/operations.md).
            if have == "0" {
                return Ok(());
            }
            let held = self.table.load_full();
            if !have.is_empty() && !held.is_empty() {
                // The counter only ever grows: gone, it means Redis lost its data (a restart
                // without persistence, a flush, an eviction). What this replica holds goes back.
                let n = restore(r, &held).await?;
                tracing::warn!(target: "tollgate::admin", entries = n, version = have, "Redis lost the operators' bans and overrides (a restart without persistence, a flush or an eviction): writing back the entries this replica holds");
                synced.version = None;
                return Ok(());
            }
            self.store(InForce::default());
            synced.from = from;
            synced.version = Some("0".to_owned());
            return Ok(());
        };
        if now == have {
            return Ok(());
        }
        let bans = r.command(::redis::cmd("HGETALL").arg(&bans)).await?;
        let overrides = r.command(::redis::cmd("HGETALL").arg(&overrides)).await?;
        let bans = records(&bans, Ban::of_record);
        let overrides = records(&overrides, Override::of_record);
        self.store(InForce::new(bans, overrides));
        let version = now;
        synced.from = from;
        synced.version = Some(version);
        Ok(())
    }

    /// At start, before serving: Redis's entries, if Redis answers within `START_WAIT` (its
    /// connection is being made), so a replica (re)started during an incident enforces its
    /// bans from its first request.
    pub async fn load_at_start(&self, redis: Option<Arc<RedisLimiter>>) {
        let Some(r) = redis else { return };
        let deadline = tokio::time::Instant::now() + START_WAIT;
        let mut synced = self.sync.lock().await;
        loop {
            match self.reload(&mut synced, &r, true).await {
                Ok(()) => return,
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    tracing::warn!(target: "tollgate::admin", error = %e, "cannot read the operators' bans and overrides from Redis yet; serving without them until it answers");
                    synced.failing = true;
                    return;
                }
                // A pause between attempts while the connection comes up, not a wait for it.
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// One poll: reload from Redis if it changed, then sweep what expired.
    async fn tick(&self, redis: Option<&Arc<RedisLimiter>>) {
        let mut synced = self.sync.lock().await;
        if let Some(r) = redis {
            match self.reload(&mut synced, r, false).await {
                Ok(()) if synced.failing => {
                    synced.failing = false;
                    tracing::info!(target: "tollgate::admin", "reading the operators' entries from Redis again");
                }
                Err(e) if !synced.failing => {
                    synced.failing = true;
                    tracing::warn!(target: "tollgate::admin", error = %e, "cannot read the operators' entries from Redis; enforcing the last ones read");
                }
                Ok(()) | Err(_) => {}
            }
        }
        self.sweep(&mut synced, redis.map(|r| &**r)).await;
    }
}

/// Write `held`'s entries that have not expired back to Redis; how many.
async fn restore(r: &RedisLimiter, held: &InForce) -> Result<usize, String> {
    let now = super::entry::now_ms();
    let mut n = 0;
    for b in held.bans.iter().filter(|b| !b.span.expired(now)) {
        put(r, Kind::Ban, &b.id, &b.to_record()).await?;
        n += 1;
    }
    for o in held.overrides.iter().filter(|o| !o.span.expired(now)) {
        put(r, Kind::Override, &o.id, &o.to_record()).await?;
        n += 1;
    }
    Ok(n)
}

/// The entries of one hash (`HGETALL`'s reply: ID, record, ID, record... or, in RESP3, a
/// map); a record that does not parse is skipped, with a warning.
fn records<T>(hash: &Value, parse: impl Fn(&str) -> Result<T, String>) -> Vec<T> {
    let pairs: Vec<(&Value, &Value)> = match hash {
        Value::Array(items) => items.chunks_exact(2).map(|p| (&p[0], &p[1])).collect(),
        Value::Map(pairs) => pairs.iter().map(|(k, v)| (k, v)).collect(),
        _ => Vec::new(),
    };
    pairs
        .into_iter()
        .filter_map(|(id, json)| {
            let (id, json) = (text(id)?, text(json)?);
            parse(&json)
                .map_err(|e| {
                    tracing::warn!(target: "tollgate::admin", id, error = %e, "skipping an entry Redis holds that does not parse");
                })
                .ok()
        })
        .collect()
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Poll and sweep every `POLL_EVERY` until `stop`: through the live runtime's Redis client
/// (`redis_of`, asked each time: a reload may change it), or in memory without one.
pub async fn run(
    control: Arc<Control>,
    redis_of: impl Fn() -> Option<Arc<RedisLimiter>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut every = tokio::time::interval(POLL_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = every.tick() => {}
        }
        let redis = redis_of();
        control.tick(redis.as_ref()).await;
    }
}
