//! A read-only look at one identity's state under one limit in Redis (`peek.lua`), for
//! `explain`: the bucket, the ban hash and the lease set, read on Redis's clock.

use std::sync::LazyLock;

use ::redis::{Script, Value};

use super::wire::SCRIPT_EPOCH_US;
use super::RedisLimiter;
use crate::identity::ClientId;
use crate::limiter::ban::Standing;
use crate::limiter::local::Counted;
use crate::limiter::peek::Peeked;
use crate::limiter::{window, Counting, Limit};

static PEEK_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("peek.lua")));

impl RedisLimiter {
    /// `client`'s state under `limit` in Redis now, or why Redis did not say. One script call
    /// through the shared connection, within the check timeout; it writes nothing.
    pub async fn peek(&self, limit: &Limit, client: ClientId) -> Result<Peeked, String> {
        let key = self.key(limit, client);
        let mut call = PEEK_SCRIPT.prepare_invoke();
        call.key(&key)
            .key(format!("{key}:ban"))
            .key(self.lease_key(limit, client));
        let on = self.shared.now();
        let reply = tokio::time::timeout(self.timeout, on.conn.invoke(&call))
            .await
            .map_err(|_| format!("no answer from Redis within {:?}", self.timeout))?
            .map_err(|e| e.to_string())?;
        parse(&reply, limit).ok_or_else(|| format!("unexpected reply {reply:?}"))
    }
}

/// The script's reply (see `peek.lua`) as the state a check would find.
fn parse(reply: &Value, limit: &Limit) -> Option<Peeked> {
    let Value::Array(items) = reply else {
        return None;
    };
    let num = |i: usize| -> Option<f64> {
        match items.get(i)? {
            Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
            Value::SimpleString(s) => s.parse().ok(),
            Value::Int(n) => Some(*n as f64),
            _ => None,
        }
    };
    let (secs, micros) = (num(0)?, num(1)?);
    let wall = secs * 1e6 + micros;
    // The scripts' clock: microseconds since their epoch (`bucket.lua`).
    let now = wall - SCRIPT_EPOCH_US as f64;
    let window = limit.quota.as_ref().map(|q| {
        let w = window::window(q, wall, q.count);
        let shift = SCRIPT_EPOCH_US as f64;
        window::Window {
            start: w.start - shift,
            end: w.end - shift,
            now,
            count: w.count,
            counting: w.counting,
        }
    });
    let (tat, prev) = counters(window.as_ref(), &num);
    let log = log(items.get(11));
    let ban = limit.ban.and(num(3).or(num(6))).map(|_| {
        let at = |i: usize| num(i).unwrap_or(0.0);
        Standing {
            banned_us: (at(3) - now).max(0.0),
            strikes: if at(7) > now { at(6) as u32 } else { 0 },
            level: if at(5) > now { at(4) as u32 } else { 0 },
        }
    });
    Some(Peeked {
        counted: if tat.is_some() {
            Counted::Own
        } else {
            Counted::New
        },
        tat,
        now,
        window,
        prev,
        log,
        ban,
        in_flight: num(8).map_or(0, |n| n as u32),
        owing: limit.settle.is_some(),
    })
}

/// The bucket's `tat` and, for a sliding window, the last window's: a sliding window counts
/// under `<key>:0` and `<key>:1` by the window's parity (`bucket.lua`).
fn counters(
    window: Option<&window::Window>,
    num: &impl Fn(usize) -> Option<f64>,
) -> (Option<f64>, Option<f64>) {
    match window {
        Some(w) if w.counting == Counting::Sliding => {
            let (even, odd) = (num(9), num(10));
            if window::odd(w) {
                (odd, even)
            } else {
                (even, odd)
            }
        }
        _ => (num(2), None),
    }
}

/// An exact window's log (`ZRANGE ... WITHSCORES`): its scores, oldest first.
fn log(reply: Option<&Value>) -> Vec<f64> {
    let Some(Value::Array(log)) = reply else {
        return Vec::new();
    };
    (log.iter().skip(1).step_by(2))
        .filter_map(|v| match v {
            Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
            Value::Double(d) => Some(*d),
            _ => None,
        })
        .collect()
}
