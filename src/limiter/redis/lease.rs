//! Concurrency slots in Redis: leases in a sorted set per limit and identity (`lease.lua`),
//! renewed in one batch per interval by one task per limit while held, released by ZREM.
//!
//! A replica that dies stops renewing: its leases expire within the `lease` time and the
//! next take drops them. Renewals and releases are fire-and-forget: a lost one costs at most a
//! slot held until its lease ends.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Weak};
use std::time::Duration;

use ::redis::{Script, Value};
use parking_lot::Mutex;

use super::failure::{Failure, Unavailable};
use super::link::Link;
use super::RedisLimiter;
use crate::identity::ClientId;
use crate::limiter::Limit;

static LEASE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lease.lua")));

/// One limit's live leases in this replica, for its renewal task.
#[derive(Debug)]
pub struct Leases {
    /// Lease ID -> its set's key.
    live: Mutex<HashMap<u128, Arc<str>>>,
    link: Arc<Link>,
    lease: Duration,
    timeout: Duration,
}

/// A lease held by a request; released when dropped.
#[derive(Debug)]
pub struct Lease {
    leases: Arc<Leases>,
    id: u128,
    key: Arc<str>,
}

/// What a take found.
#[derive(Debug)]
pub enum Taken {
    /// A slot, and the count in flight with it.
    Slot(Lease, u32),
    /// Every slot taken: the count in flight.
    Full(u32),
}

fn member(id: u128) -> String {
    format!("{id:032x}")
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.leases.live.lock().remove(&self.id);
        // Off the dropping thread (hyper's, in a body's drop): a task of its own.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let leases = self.leases.clone();
            let key = self.key.clone();
            let id = member(self.id);
            rt.spawn(async move {
                let mut call = LEASE_SCRIPT.prepare_invoke();
                call.key(&*key).arg("drop").arg(id);
                let on = leases.link.now();
                let _ = tokio::time::timeout(leases.timeout * 4, on.conn.invoke(&call)).await;
            });
        }
    }
}

impl RedisLimiter {
    /// A limit's lease registry, with its renewal task (which ends once the registry is gone).
    pub(crate) fn leases(&self, lease: Duration) -> Arc<Leases> {
        let leases = Arc::new(Leases {
            live: Mutex::default(),
            link: self.shared.clone(),
            lease,
            timeout: self.timeout,
        });
        tokio::spawn(renew(Arc::downgrade(&leases)));
        leases
    }

    /// The Redis key of `client`'s leases under `limit`: the bucket's hash tag, so a cluster
    /// keeps an identity's keys together.
    pub(super) fn lease_key(&self, limit: &Limit, client: ClientId) -> String {
        let mut key = String::with_capacity(self.key_prefix.len() + limit.name.len() + 37);
        key.push_str(&self.key_prefix);
        key.push_str(&limit.name);
        key.push_str(":c:{");
        client.push_hex(&mut key);
        key.push('}');
        key
    }

    /// Take one of `max` slots of `client` under `limit`, as a lease in `leases`.
    pub(crate) async fn take_lease(
        &self,
        leases: &Arc<Leases>,
        limit: &Limit,
        client: ClientId,
        max: u32,
    ) -> Result<Taken, Unavailable> {
        let key: Arc<str> = self.lease_key(limit, client).into();
        let id = (u128::from(fastrand::u64(..)) << 64) | u128::from(fastrand::u64(..));
        let lease_ms = u64::try_from(leases.lease.as_millis()).unwrap_or(u64::MAX);
        let mut call = LEASE_SCRIPT.prepare_invoke();
        call.key(&*key)
            .arg("take")
            .arg(max)
            .arg(lease_ms)
            .arg(member(id));
        let on = self.shared.now();
        // Registered before it is asked: a renewal may go out for it, never a lease unrenewed.
        leases.live.lock().insert(id, key.clone());
        let asked = tokio::time::timeout(self.timeout, on.conn.invoke(&call)).await;
        let taken = match asked {
            Ok(Ok(reply)) => parse(&reply).ok_or_else(|| {
                Failure::new(
                    Unavailable::Error,
                    format!("unexpected lease reply {reply:?}"),
                )
            }),
            Ok(Err(e)) => Err(Failure::new(Unavailable::Error, e.to_string())),
            Err(_) => Err(Failure::timed_out(self.timeout)),
        };
        match taken {
            Ok((true, n)) => Ok(Taken::Slot(
                Lease {
                    leases: leases.clone(),
                    id,
                    key,
                },
                n,
            )),
            // Not added (or unknown: then it expires unrenewed).
            Ok((false, n)) => {
                leases.live.lock().remove(&id);
                Ok(Taken::Full(n))
            }
            Err(failure) => {
                leases.live.lock().remove(&id);
                Err(self.failed(&failure))
            }
        }
    }
}

/// `{admitted, in flight}`.
fn parse(v: &Value) -> Option<(bool, u32)> {
    let Value::Array(items) = v else { return None };
    let int = |v: &Value| match v {
        Value::Int(n) => u32::try_from(*n).ok(),
        _ => None,
    };
    Some((int(items.first()?)? == 1, int(items.get(1)?)?))
}

/// Every third of the lease, renew all live leases of the registry: one call per set.
async fn renew(leases: Weak<Leases>) {
    let period = match leases.upgrade() {
        Some(l) => l.lease / 3,
        None => return,
    };
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(leases) = leases.upgrade() else {
            return;
        };
        let mut by_key: HashMap<Arc<str>, Vec<String>> = HashMap::new();
        for (id, key) in leases.live.lock().iter() {
            by_key.entry(key.clone()).or_default().push(member(*id));
        }
        if by_key.is_empty() {
            continue;
        }
        let lease_ms = u64::try_from(leases.lease.as_millis()).unwrap_or(u64::MAX);
        let on = leases.link.now();
        let calls = by_key.iter().map(|(key, ids)| {
            let mut call = LEASE_SCRIPT.prepare_invoke();
            call.key(&**key).arg("renew").arg(lease_ms);
            for id in ids {
                call.arg(id);
            }
            call
        });
        let calls: Vec<_> = calls.collect();
        let sent = futures_util::future::join_all(calls.iter().map(|c| on.conn.invoke(c)));
        match tokio::time::timeout(period, sent).await {
            Ok(results) => {
                if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
                    tracing::debug!(error = %e, "renewing concurrency leases failed");
                }
            }
            Err(_) => tracing::debug!("renewing concurrency leases timed out"),
        }
        drop(leases);
    }
}
