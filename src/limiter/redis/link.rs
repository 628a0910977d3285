//! A connection to one Redis server that replaces itself when it goes out of step.
//!
//! The multiplexed connection matches replies to requests by their order. A reply lost while
//! the connection stays up (a middlebox or a proxy in front of Redis dropping bytes, a
//! half-dead path that the kernel has not noticed) leaves every later reply matched to the
//! request before it, for good: calls time out one after the other (or, worse, take another
//! call's answer), and the client reconnects only on a connection error, which never comes.
//! So a connection whose calls time out `REPLACE_AFTER_TIMEOUTS` times in a row, or that hands
//! back a reply of the wrong shape (the script's replies have a fixed shape, so only a
//! connection out of step does that), is replaced by a fresh one. Calls already out on the old
//! one end there (answered or timed out) and are not counted against the new one.
//!
//! A Redis that is merely stalled also times out: it gets a new connection every few timeouts,
//! which costs one TCP connect each, paced by the circuit breaker (one probe per cooldown once
//! it is open). A Redis Cluster client is left as it is: it keeps a connection per node with a
//! response timeout of its own, and replacing it whole would rediscover every slot each time
//! one master stalls.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;

use super::conn::RedisConn;
use super::failure::Failure;
use super::{RedisConfig, Unavailable};

/// Consecutive timed-out calls after which a single server's connection is replaced: as many
/// as open the breaker, so by the breaker's first probe the connection is a fresh one.
pub(super) const REPLACE_AFTER_TIMEOUTS: u32 = 3;

/// The connection calls go out on now, and which one it is.
#[derive(Debug)]
pub(super) struct Current {
    pub(super) conn: RedisConn,
    id: u64,
}

/// A connection that a caller reports back to: answered, timed out, or out of step.
#[derive(Debug)]
pub(super) struct Link {
    cfg: RedisConfig,
    current: ArcSwap<Current>,
    /// Calls on the current connection that timed out since its last answer.
    timeouts: AtomicU32,
    /// Connections replaced since start (those the current one replaced by itself apart).
    replaced: AtomicU64,
    /// Failovers followed by connections replaced since (the current one counts its own).
    followed_before: AtomicU64,
}

impl Link {
    /// Set up the connection without waiting for it (see `RedisConn::open`).
    pub(super) fn open(cfg: &RedisConfig) -> Result<Self, String> {
        let conn = RedisConn::open(cfg)?;
        Ok(Self {
            cfg: cfg.clone(),
            current: ArcSwap::from_pointee(Current { conn, id: 0 }),
            timeouts: AtomicU32::new(0),
            replaced: AtomicU64::new(0),
            followed_before: AtomicU64::new(0),
        })
    }

    /// The connection to send the next call on; report how it went with the same `Current`.
    pub(super) fn now(&self) -> Arc<Current> {
        self.current.load_full()
    }

    pub(super) fn is_cluster(&self) -> bool {
        matches!(self.current.load().conn, RedisConn::Cluster(_))
    }

    /// Connections replaced since start.
    pub(super) fn replaced(&self) -> u64 {
        self.replaced.load(Ordering::Relaxed) + self.current.load().conn.reconnects()
    }

    /// Times this link's connections followed a Sentinel failover to another master.
    pub(super) fn failovers(&self) -> u64 {
        self.followed_before.load(Ordering::Relaxed) + self.current.load().conn.failovers()
    }

    /// Note how a call on `on` went: answered, timed out, or neither (an error Redis sent, a
    /// connection error the client handles itself).
    pub(super) fn settle<T>(&self, on: &Current, result: &Result<T, Failure>) {
        match result {
            Ok(_) => self.answered(on),
            Err(f) if f.kind == Unavailable::Timeout => self.timed_out(on),
            Err(_) => {}
        }
    }

    /// A call on `on` was answered.
    pub(super) fn answered(&self, on: &Current) {
        // Read first: every answered call lands here, and a store would dirty the line for
        // every thread that reads it.
        if self.timeouts.load(Ordering::Relaxed) != 0 && self.is_current(on) {
            self.timeouts.store(0, Ordering::Relaxed);
        }
    }

    /// A call on `on` timed out.
    pub(super) fn timed_out(&self, on: &Current) {
        if !self.is_current(on) || matches!(on.conn, RedisConn::Cluster(_)) {
            return;
        }
        // Exactly one caller sees the count reach the threshold.
        if self.timeouts.fetch_add(1, Ordering::AcqRel) + 1 == REPLACE_AFTER_TIMEOUTS {
            self.replace(on, "consecutive timeouts");
        }
    }

    /// A call on `on` got a reply that is not the script's: the connection is out of step.
    pub(super) fn out_of_step(&self, on: &Current) {
        if self.is_current(on) && !matches!(on.conn, RedisConn::Cluster(_)) {
            self.replace(on, "a reply that does not fit its request");
        }
    }

    fn is_current(&self, on: &Current) -> bool {
        self.current.load().id == on.id
    }

    /// Swap in a new connection for `old`, unless another caller already did.
    fn replace(&self, old: &Current, why: &str) {
        let conn = match RedisConn::open(&self.cfg) {
            Ok(conn) => conn,
            Err(e) => {
                tracing::warn!(error = %e, "cannot open a new Redis connection");
                return;
            }
        };
        let next = Arc::new(Current {
            conn,
            id: old.id + 1,
        });
        let previous = self.current.rcu(|now| {
            if now.id == old.id {
                next.clone()
            } else {
                now.clone()
            }
        });
        if previous.id == old.id {
            self.followed_before
                .fetch_add(old.conn.failovers(), Ordering::Relaxed);
            self.timeouts.store(0, Ordering::Relaxed);
            self.replaced
                .fetch_add(1 + old.conn.reconnects(), Ordering::Relaxed);
            tracing::warn!(
                reason = why,
                "Redis connection out of step or stalled: replaced by a new one"
            );
        }
    }
}
