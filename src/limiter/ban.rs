//! Escalating bans: an identity a limit keeps rejecting is refused outright for a while.
//!
//! Per limit and identity, with `ban: { after: N, within: W, for: F, max: M }`:
//!
//! ```text
//! strikes: the limit's rejections in a window of W opened by the first of them
//! the N-th strike: banned until now + min(F * 2^level, M); level += 1; strikes = 0
//! level: forgotten M after the ban it belongs to ends (a ban within M of the last one doubles)
//! while banned: every request is refused, with Retry-After = the ban's remaining time; it
//!               takes nothing from any bucket and is no strike
//! ```
//!
//! `bucket.lua` runs the same arithmetic on Redis, in the call that checks the buckets. In
//! process, the state of one limit's bans lives in a sharded map bounded like the buckets' (at
//! most `max_buckets` identities): an entry goes once its ban, its level and its strikes are all
//! over, and an identity with no room left is simply not banned (its limit still limits it).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use parking_lot::Mutex;

use super::local::DigestHasher;
use crate::config::settings::BanSpec;
use crate::identity::ClientId;

const SHARDS: usize = 16;

/// What a ban did to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BanEvent {
    #[default]
    None,
    /// The identity is banned: refused without a check.
    Refused,
    /// This rejection was the last strike: a ban of this many microseconds began.
    Started(u64),
    /// The identity's ban had ended: this is its first request since.
    Lifted,
}

impl BanEvent {
    /// The event's name in traces (`None` for no event).
    pub fn as_str(self) -> Option<&'static str> {
        match self {
            Self::None => None,
            Self::Refused => Some("refused"),
            Self::Started(_) => Some("started"),
            Self::Lifted => Some("lifted"),
        }
    }
}

/// The ban arithmetic's numbers, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BanArgs {
    pub after: u32,
    pub within_us: u64,
    pub first_us: u64,
    pub max_us: u64,
}

impl BanArgs {
    pub fn of(b: &BanSpec) -> Self {
        let us = |d: std::time::Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        Self {
            after: b.after,
            within_us: us(b.within),
            first_us: us(b.first),
            max_us: us(b.max),
        }
    }

    /// The length of ban number `level` (0: the first).
    pub fn length_us(&self, level: u32) -> u64 {
        self.first_us
            .saturating_mul(1u64 << level.min(62))
            .min(self.max_us)
    }
}

/// One identity's ban state as `explain` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Standing {
    /// Microseconds the ban in force has left; 0 when none is.
    pub banned_us: f64,
    /// Strikes in the current window.
    pub strikes: u32,
    /// Bans so far that the next one doubles from (0 once forgotten).
    pub level: u32,
}

/// One identity's ban state.
#[derive(Debug, Clone, Copy, Default)]
struct State {
    strikes: u32,
    strikes_until: f64,
    until: f64,
    level: u32,
    level_until: f64,
}

impl State {
    fn over(&self, now: f64) -> bool {
        self.until <= now && self.level_until <= now && self.strikes_until <= now
    }
}

type Shard = HashMap<ClientId, State, BuildHasherDefault<DigestHasher>>;

/// The bans of one limit, in process.
#[derive(Debug)]
pub struct Bans {
    args: BanArgs,
    shards: Vec<Mutex<Shard>>,
    per_shard_cap: usize,
}

impl Bans {
    pub fn new(spec: &BanSpec, max_identities: usize) -> Self {
        Self {
            args: BanArgs::of(spec),
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            per_shard_cap: max_identities.div_ceil(SHARDS).max(1),
        }
    }

    /// The numbers these bans were built with (a reload keeps them only for the same ones).
    pub fn args(&self) -> BanArgs {
        self.args
    }

    fn shard(&self, client: ClientId) -> &Mutex<Shard> {
        &self.shards[(client.0 >> 64) as usize % SHARDS]
    }

    /// Whether `client` is banned at `now`: the remaining microseconds, with
    /// `BanEvent::Refused`; `BanEvent::Lifted` (and `None`) on the first look after a ban ended.
    pub fn banned(&self, client: ClientId, now: f64) -> (Option<f64>, BanEvent) {
        let mut shard = self.shard(client).lock();
        let Some(s) = shard.get_mut(&client) else {
            return (None, BanEvent::None);
        };
        if s.until > now {
            return (Some(s.until - now), BanEvent::Refused);
        }
        if s.until > 0.0 {
            s.until = 0.0;
            return (None, BanEvent::Lifted);
        }
        (None, BanEvent::None)
    }

    /// `client`'s ban state at `now`, changing nothing (for `explain`); `None` when it has none.
    pub fn peek(&self, client: ClientId, now: f64) -> Option<Standing> {
        let shard = self.shard(client).lock();
        let s = shard.get(&client)?;
        Some(Standing {
            banned_us: (s.until - now).max(0.0),
            strikes: if s.strikes_until > now { s.strikes } else { 0 },
            level: if s.level_until > now { s.level } else { 0 },
        })
    }

    /// Count a rejection of `client` by the limit at `now`; `BanEvent::Started` when it bans.
    pub fn strike(&self, client: ClientId, now: f64) -> BanEvent {
        let mut shard = self.shard(client).lock();
        if !shard.contains_key(&client) && shard.len() >= self.per_shard_cap {
            shard.retain(|_, s| !s.over(now));
            if shard.len() >= self.per_shard_cap {
                return BanEvent::None;
            }
        }
        let s = shard.entry(client).or_default();
        strike(s, &self.args, now)
    }

    /// Forget the identities whose ban, level and strikes are all over. Returns how many.
    pub fn sweep(&self, now: f64) -> usize {
        let mut dropped = 0;
        for shard in &self.shards {
            let mut shard = shard.lock();
            let before = shard.len();
            shard.retain(|_, s| !s.over(now));
            dropped += before - shard.len();
        }
        dropped
    }
}

/// Log a ban begun or seen lifted (one line a second at most for each, with the number held
/// back: a flood of identities banned at once must not flood the log).
pub(crate) fn log(c: &super::Check<'_>, event: BanEvent) {
    static STARTED: std::sync::LazyLock<crate::log_gate::LogGate> =
        std::sync::LazyLock::new(|| {
            crate::log_gate::LogGate::new(std::time::Duration::from_secs(1))
        });
    static LIFTED: std::sync::LazyLock<crate::log_gate::LogGate> = std::sync::LazyLock::new(|| {
        crate::log_gate::LogGate::new(std::time::Duration::from_secs(1))
    });
    let now = super::clock::wall_us() as u64;
    let mut client = String::with_capacity(32);
    match event {
        BanEvent::Started(length) => {
            if let Some(held_back) = STARTED.open(now) {
                c.client.push_hex(&mut client);
                tracing::warn!(
                    limit = &*c.limit.name,
                    client = %client,
                    ban_seconds = length as f64 / 1e6,
                    similar_since_last = held_back,
                    "identity banned: refused outright until the ban ends"
                );
            }
        }
        BanEvent::Lifted => {
            if let Some(held_back) = LIFTED.open(now) {
                c.client.push_hex(&mut client);
                tracing::info!(
                    limit = &*c.limit.name,
                    client = %client,
                    similar_since_last = held_back,
                    "ban lifted"
                );
            }
        }
        BanEvent::None | BanEvent::Refused => {}
    }
}

/// One strike on `s` (see the module doc).
fn strike(s: &mut State, a: &BanArgs, now: f64) -> BanEvent {
    if s.strikes_until <= now {
        s.strikes = 0;
        s.strikes_until = now + a.within_us as f64;
    }
    s.strikes += 1;
    if s.strikes < a.after {
        return BanEvent::None;
    }
    let level = if s.level_until > now { s.level } else { 0 };
    let length = a.length_us(level);
    s.until = now + length as f64;
    s.level = level.saturating_add(1);
    s.level_until = s.until + a.max_us as f64;
    s.strikes = 0;
    s.strikes_until = 0.0;
    BanEvent::Started(length)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn spec() -> BanSpec {
        BanSpec {
            after: 3,
            within: Duration::from_secs(10),
            first: Duration::from_mins(1),
            max: Duration::from_secs(200),
        }
    }

    #[test]
    fn n_strikes_within_the_window_ban_and_bans_double_up_to_max() {
        let bans = Bans::new(&spec(), 100);
        let c = ClientId(7);
        let mut now = 0.0;
        for expected in [60e6, 120e6, 200e6, 200e6] {
            assert_eq!(bans.strike(c, now), BanEvent::None);
            assert_eq!(bans.strike(c, now + 1e6), BanEvent::None);
            assert_eq!(
                bans.strike(c, now + 2e6),
                BanEvent::Started(expected as u64)
            );
            let (left, e) = bans.banned(c, now + 3e6);
            assert_eq!(e, BanEvent::Refused);
            assert!((left.unwrap() - (expected - 1e6)).abs() < 1.0);
            now += 2e6 + expected;
            assert_eq!(bans.banned(c, now), (None, BanEvent::Lifted));
            assert_eq!(bans.banned(c, now), (None, BanEvent::None));
        }
    }

    #[test]
    fn strikes_outside_the_window_do_not_add_up_and_the_level_is_forgotten() {
        let bans = Bans::new(&spec(), 100);
        let c = ClientId(7);
        bans.strike(c, 0.0);
        bans.strike(c, 5e6);
        // The window of the first strike closed at 10 s: this one opens a new one.
        assert_eq!(bans.strike(c, 10e6), BanEvent::None);
        bans.strike(c, 11e6);
        assert_eq!(bans.strike(c, 12e6), BanEvent::Started(60_000_000));
        // The ban ends at 72 s; its level is kept until 272 s, then the next ban is 60 s again.
        assert_eq!(bans.sweep(100e6), 0);
        for t in [300e6, 301e6] {
            bans.strike(c, t);
        }
        assert_eq!(bans.strike(c, 302e6), BanEvent::Started(60_000_000));
        assert_eq!(bans.sweep(1e12), 1);
    }
}
