//! A read-only look at one identity's state under one limit, for `explain`: its bucket, its ban
//! and its requests in flight, in process or in Redis, taking, counting and holding nothing.

use super::ban::Standing;
use super::local::{Counted, Peer};
use super::window::{self, Window};
use super::{step, Counting, Limit, Rate, Verdict};
use crate::identity::ClientId;

/// One identity's state under one limit, as a check made now would find it.
#[derive(Debug, Clone, PartialEq)]
pub struct Peeked {
    /// Where a check would count the identity (Redis: `Own` or `New`).
    pub counted: Counted,
    /// The bucket's `tat` (`None`: full), on the store's clock.
    pub tat: Option<f64>,
    /// Now, on the same clock.
    pub now: f64,
    /// A quota's window on that clock (then `tat` counts in it).
    pub window: Option<Window>,
    /// A sliding window's last counter (its `tat` in the window before `window`).
    pub prev: Option<f64>,
    /// An `exact` window's request times, oldest first, on the same clock.
    pub log: Vec<f64>,
    /// The identity's ban state, when the limit has a ban and the identity an entry.
    pub ban: Option<Standing>,
    /// Requests in flight (a concurrency limit's slots taken).
    pub in_flight: u32,
    /// The bucket may owe tokens (a settled cost): read without the clamp.
    pub owing: bool,
}

impl Peeked {
    /// Whole tokens a settled cost's bucket owes now at `rate` (0 when it owes none).
    pub fn owed(&self, rate: &Rate) -> u64 {
        let over = self.tat.map_or(0.0, |t| t - self.now - rate.window_us());
        if self.owing && over > 0.0 {
            (over / rate.token_us()).ceil() as u64
        } else {
            0
        }
    }

    /// The bucket now (`remaining` = whole tokens it holds), and what a request of `cost` at
    /// `rate` would get from it now.
    pub fn bucket(&self, rate: &Rate, cost: u32) -> (Verdict, Verdict) {
        match &self.window {
            Some(w) if w.counting == Counting::Sliding => (
                window::slide(self.tat, self.prev, w, 0).0,
                window::slide(self.tat, self.prev, w, cost).0,
            ),
            Some(w) if w.counting == Counting::Exact => {
                let mut log = self.log.iter().copied().collect();
                (
                    window::exact(&mut log, w, 0),
                    window::exact(&mut log, w, cost),
                )
            }
            Some(w) => (
                window::step(self.tat, w, 0).0,
                window::step(self.tat, w, cost).0,
            ),
            None if self.owing => (
                super::gcra::step_owing(self.tat, self.now, rate, 0).0,
                super::gcra::step_owing(self.tat, self.now, rate, cost).0,
            ),
            None => (
                step(self.tat, self.now, rate, 0).0,
                step(self.tat, self.now, rate, cost).0,
            ),
        }
    }
}

/// `client`'s state under `limit` in process at `now` (the proxy's clock, in µs), from `peer`;
/// with `fallback`, under the stricter numbers the `local` failure policy enforces.
pub fn in_process(limit: &Limit, client: ClientId, peer: Peer, now: f64, fallback: bool) -> Peeked {
    in_process_at(limit, client, peer, (now, None), fallback)
}

/// `in_process`, at the wall-clock time `wall` (µs since the Unix epoch) quotas and windows
/// count in when the caller knows it (a replay), else read now.
pub fn in_process_at(
    limit: &Limit,
    client: ClientId,
    peer: Peer,
    (now, wall): (f64, Option<f64>),
    fallback: bool,
) -> Peeked {
    // Quotas count on the wall clock, in calendar windows.
    let window = limit.quota.as_ref().map(|q| {
        let count = if fallback { q.fallback_count } else { q.count };
        window::window(q, wall.unwrap_or_else(super::clock::wall_us), count)
    });
    let floor = window.map_or(now, |w| w.floor());
    let sliding = window.filter(|w| w.counting == Counting::Sliding);
    let key = match sliding {
        Some(w) if window::odd(&w) => ClientId(client.0 ^ 1),
        _ => client,
    };
    let (counted, tat) = limit.local.peek(key, peer, floor);
    Peeked {
        counted,
        tat,
        now: window.map_or(now, |w| w.now),
        window,
        prev: sliding.and_then(|_| limit.local.tat_of(ClientId(key.0 ^ 1))),
        log: limit.local.log_of(client),
        ban: limit.bans.as_ref().and_then(|b| b.peek(client, now)),
        in_flight: limit.slots.as_ref().map_or(0, |s| s.in_flight(client)),
        owing: limit.settle.is_some(),
    }
}
