//! Token buckets in Redis: the same GCRA as `local`, shared by every proxy of a fleet.
//!
//! One check is one round trip (on a cluster, one script call per slot its buckets live in,
//! all sent at once: see `cluster`), shared with the checks waiting at the same moment on the
//! same worker (on a cluster, with those of the same slot: see `batch`): a Lua script
//! (`bucket.lua`) reads all the request's buckets, decides on Redis's own clock (so proxies
//! with skewed clocks agree), and charges them only if every enforced bucket admits, exactly
//! like `local::check`. A bucket is one string key,
//! `<key_prefix><limit name>:{<client digest hex>}`, that expires when the bucket is full again;
//! the digest keeps raw identities (API keys, tokens) out of Redis, and the braces make it the
//! Redis Cluster hash tag, so a client's buckets spread over the cluster by client.
//!
//! A single server's connection (or the master's, found through Sentinel) reconnects by itself,
//! names itself, and follows a failover to wherever the Sentinels say (see `managed`).
//!
//! Redis being slow or gone must not become the proxy's problem. Every call has a deadline
//! (`timeout`); after a few consecutive failures a circuit breaker answers `Unavailable` at
//! once, and probes Redis once per cooldown (on a cluster, one breaker per range of slots, so
//! a dead master fails fast for its own slots only). A server connection whose calls keep
//! timing out, or that answers out of step, is replaced by a fresh one (see `link`). What to do when unavailable (admit,
//! reject, count locally) is the caller's failure policy. And a client hammering a limit it
//! has exhausted is answered from a negative cache until a token can exist again (see
//! `negative`), so a flood costs Redis nothing.
//!
//! A timed-out call may still run on Redis later and take its tokens: the request is then
//! counted twice (by Redis and by whatever the failure policy did), which errs toward limiting.

mod batch;
mod breaker;
mod buckets;
mod cluster;
mod conn;
mod entries;
mod failure;
mod link;
mod managed;
mod negative;
mod peek;
mod sentinel;
pub(crate) mod slots;
mod stats;
mod wire;

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use ::redis::Script;
use smallvec::SmallVec;
use tokio::time::Instant;

use self::breaker::Breaker;
pub use self::failure::Unavailable;
use self::failure::{by_deadline, Failure};
use self::link::{Current, Link};
use self::negative::NegativeCache;
pub use self::stats::RedisStats;
use self::stats::{bump, Counters};
use self::wire::{parse_reply, Mode, Reply, BUCKET_LUA};
use super::ban::BanEvent;
use super::Clock;
use super::{Check, Rate, Small, Verdict};
pub use crate::config::settings::RedisConfig;
use crate::log_gate::LogGate;

/// Slots of a Redis Cluster.
const CLUSTER_SLOTS: usize = 16_384;

/// How long a worker's first connection may take before its warm-up gives up waiting (the
/// connection itself keeps trying).
const WARM_UP_TIMEOUT: Duration = Duration::from_secs(10);

/// Hashing the script once per process, not per call.
static BUCKET_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(BUCKET_LUA));

/// One bucket of one check, as sent to Redis.
#[derive(Debug, Clone)]
struct Bucket<'a> {
    key: String,
    /// The key's Redis Cluster slot (0 on a single server).
    slot: u16,
    rate: &'a Rate,
    cost: u32,
    /// Tokens asked beyond `cost` for this replica's lease (see `leasing`); 0: none.
    lease: u32,
    enforced: bool,
    /// A calendar quota's count and windows, as the script takes them.
    quota: Option<wire::QuotaArgs>,
    /// The limit's ban, if it has one.
    ban: Option<super::ban::BanArgs>,
    /// A settled cost's bucket (`cost: { from_response }`): it may owe tokens, so a `tat`
    /// past a full window is a debt to wait out, not a clock step to clamp.
    debt: bool,
}

/// A worker's own connection, and its batching queue.
#[derive(Debug)]
struct Worker {
    link: Arc<Link>,
    batcher: batch::Batcher,
    leases: slots::Batcher,
}

/// The worker whose connection and batcher a check uses; `None`: the shared connection.
type Via<'a> = Option<&'a Worker>;

/// The Redis backend. Share it (`Arc`) between all requests: it holds a multiplexed
/// connection per worker thread (and one for other threads), and its breaker and cache only
/// work if everyone uses the same one.
#[derive(Debug)]
pub struct RedisLimiter {
    /// The connection of the thread that built the limiter (readiness probes, tests).
    shared: Arc<Link>,
    /// A Redis Cluster (keys have slots, one breaker per range of them), else one server.
    cluster: bool,
    /// One connection per worker thread, opened as the worker starts (`warm_up_worker`), or on
    /// first use there: its I/O then runs on the worker that asks, so a check never wakes
    /// another thread.
    per_worker: Vec<std::sync::OnceLock<Worker>>,
    /// The concurrency-lease batcher of the shared connection, started on first use.
    shared_leases: std::sync::OnceLock<slots::Batcher>,
    cfg: RedisConfig,
    timeout: Duration,
    key_prefix: String,
    clock: Clock,
    /// The circuit breakers: one on a single server; on a cluster one per range of
    /// `SLOTS_PER_BREAKER` slots, so that a dead master opens the breakers of its own slots
    /// while the checks of the other masters' slots go on.
    breakers: Vec<Breaker>,
    negative: Arc<NegativeCache>,
    log_gate: Arc<LogGate>,
    counters: Arc<Counters>,
    /// A worker's connection has run the script: said once, at INFO.
    answered: std::sync::atomic::AtomicBool,
    /// Observes each check that went to Redis, sent until answered or failed.
    latency: Option<crate::sharded::Histogram>,
}

impl RedisLimiter {
    /// Consecutive failures that open the breaker.
    pub const BREAKER_FAILURES: u32 = 3;
    /// How long an open breaker waits before letting one probe through.
    pub const BREAKER_COOLDOWN: Duration = Duration::from_secs(1);
    /// Slots of a Redis Cluster sharing one circuit breaker. A master serves ranges of
    /// consecutive slots (thousands each, unless resharded finely), so a range of 128 mostly
    /// belongs to one master: 128 breakers in all.
    pub const SLOTS_PER_BREAKER: usize = 128;
    /// Buckets the negative cache may remember.
    pub const NEGATIVE_CACHE_CAPACITY: usize = 65_536;

    /// Set up the connection and return at once: it is established in the background, and
    /// until Redis answers, checks return `Unavailable`. Fails only on a malformed config, or
    /// when called outside a tokio runtime. Every check goes through the shared connection.
    pub fn new(cfg: &RedisConfig) -> Result<Self, String> {
        Self::for_workers(cfg, 0)
    }

    /// `new`, with a connection and batcher of its own for each of `workers` worker threads
    /// (`check_on`).
    pub fn for_workers(cfg: &RedisConfig, workers: usize) -> Result<Self, String> {
        let shared = Link::open(cfg)?;
        let cluster = shared.is_cluster();
        let breakers = if cluster {
            CLUSTER_SLOTS / Self::SLOTS_PER_BREAKER
        } else {
            1
        };
        Ok(Self {
            shared: Arc::new(shared),
            cluster,
            per_worker: (0..workers).map(|_| std::sync::OnceLock::new()).collect(),
            shared_leases: std::sync::OnceLock::new(),
            cfg: cfg.clone(),
            timeout: cfg.timeout,
            key_prefix: cfg.key_prefix.clone(),
            clock: Clock::new(),
            breakers: (0..breakers)
                .map(|_| Breaker::new(Self::BREAKER_FAILURES, Self::BREAKER_COOLDOWN))
                .collect(),
            negative: Arc::new(NegativeCache::new(Self::NEGATIVE_CACHE_CAPACITY)),
            log_gate: Arc::new(LogGate::new(Duration::from_secs(1))),
            counters: Arc::default(),
            answered: std::sync::atomic::AtomicBool::new(false),
            latency: None,
        })
    }

    /// Open a breaker after `failures` consecutive failures, for `cooldown`.
    #[must_use]
    pub fn with_breaker(mut self, failures: u32, cooldown: Duration) -> Self {
        for b in &mut self.breakers {
            *b = Breaker::new(failures, cooldown);
        }
        self
    }

    /// Remember at most `capacity` buckets in the negative cache (0 turns it off).
    #[must_use]
    pub fn with_negative_cache(mut self, capacity: usize) -> Self {
        self.negative = Arc::new(NegativeCache::new(capacity));
        self
    }

    /// Time each check that goes to Redis in `latency` (never the negative cache's answers nor
    /// the open breaker's refusals: those asked nothing).
    #[must_use]
    pub fn with_latency(mut self, latency: crate::sharded::Histogram) -> Self {
        self.latency = Some(latency);
        self
    }

    /// Check several buckets as one, with the semantics of `local::check`: every verdict is
    /// returned, and tokens are taken only if every enforced bucket admits (`enforced[i] ==
    /// false` marks a shadow bucket; a missing entry counts as enforced).
    pub async fn check(
        &self,
        checks: &[Check<'_>],
        enforced: &[bool],
    ) -> Result<Small<Verdict>, Unavailable> {
        self.check_on(None, checks, enforced).await
    }

    /// `check`, from worker `worker`'s own connection and batch (`None`: the shared
    /// connection), so that its I/O runs on the thread that asks.
    pub async fn check_on(
        &self,
        worker: Option<usize>,
        checks: &[Check<'_>],
        enforced: &[bool],
    ) -> Result<Small<Verdict>, Unavailable> {
        Ok(self.check_bans(worker, checks, enforced).await?.0)
    }

    /// `check_on`, with what each limit's ban did (fleet-wide: the bans live in Redis, beside
    /// the buckets, and are read in the same call).
    pub async fn check_bans(
        &self,
        worker: Option<usize>,
        checks: &[Check<'_>],
        enforced: &[bool],
    ) -> Result<(Small<Verdict>, Small<BanEvent>), Unavailable> {
        self.check_tuned(worker, checks, enforced, &[], &[]).await
    }

    /// `check_bans`, with `tuned[i]` replacing the rate (or quota count) of `checks[i]`'s
    /// limit: the same key, other numbers (an empty slice: none replaced); and `asks[i]` the
    /// tokens `checks[i]` takes for this replica's lease (an empty slice: none).
    pub async fn check_tuned(
        &self,
        worker: Option<usize>,
        checks: &[Check<'_>],
        enforced: &[bool],
        tuned: &[Option<&super::Tuning>],
        asks: &[super::leasing::Ask],
    ) -> Result<(Small<Verdict>, Small<BanEvent>), Unavailable> {
        bump(&self.counters.checks);
        let via = self.worker(worker);
        if checks.is_empty() {
            return Ok((Small::new(), Small::new()));
        }
        let buckets = self.buckets(checks, enforced, tuned, asks);
        // One clock read: the local time the negative cache and breaker use, and the deadline.
        let sent = Instant::now();
        let sent_us = self.clock.at(sent).us();
        if let Some(verdicts) = self.cached(&buckets, sent_us) {
            bump(&self.counters.negative_hits);
            tracing::trace!("rejected from the negative cache, without asking Redis");
            return Ok(verdicts);
        }
        // The breakers of the check's slot ranges (one on a single server), each asked once.
        let mut breakers: SmallVec<[usize; 2]> = SmallVec::new();
        for b in &buckets {
            let i = self.breaker_index(b.slot);
            if !breakers.contains(&i) {
                breakers.push(i);
            }
        }
        // Any breaker cooling down rejects before another one's probe is taken for nothing.
        let now_us = sent_us as u64;
        if breakers.iter().any(|&i| self.breakers[i].cooling(now_us))
            || !breakers.iter().all(|&i| self.breakers[i].allow(now_us))
        {
            bump(&self.counters.breaker_rejections);
            return Err(self.failed(&Failure::new(
                Unavailable::BreakerOpen,
                "not asking Redis during the breaker's cooldown",
            )));
        }
        let asked = self.ask(via, &buckets, sent).await;
        if let Some(latency) = &self.latency {
            latency.observe(sent.elapsed().as_secs_f64());
        }
        match asked {
            Ok(reply) => {
                for &i in &breakers {
                    self.breakers[i].success();
                }
                if !reply.all_admitted {
                    self.negative
                        .remember(&buckets, &reply.verdicts, &reply.bans, sent_us);
                }
                Ok((reply.verdicts, reply.bans))
            }
            Err(failure) => {
                let now_us = self.clock.now().us() as u64;
                match failure.slot {
                    // One slot of several failed: only its range's breaker counts it.
                    Some(slot) => self.breakers[self.breaker_index(slot)].failure(now_us),
                    None => {
                        for &i in &breakers {
                            self.breakers[i].failure(now_us);
                        }
                    }
                }
                Err(self.failed(&failure))
            }
        }
    }

    /// A Redis server restarted or left (its `run_id` is gone): what the negative cache learnt
    /// from it may be gone with it (a cluster node's connection is replaced inside the cluster
    /// client, unseen by the reconnect count).
    pub fn saw_restart(&self) {
        self.negative.clear();
    }

    /// The negative cache's answer, if it knows one. A new connection may be to a Redis that
    /// restarted and lost the counts the cache's rejections came from: they are forgotten
    /// first (see `negative`).
    fn cached(
        &self,
        buckets: &[Bucket<'_>],
        sent_us: f64,
    ) -> Option<(Small<Verdict>, Small<BanEvent>)> {
        if self.negative.holds_any() {
            self.negative.renew(self.reconnects());
        }
        self.negative.answer(buckets, sent_us)
    }

    /// Whether Redis runs the bucket script within the check timeout (for `/readyz`): an
    /// EVALSHA of a check of no buckets, which touches no key. More than a PING: a server that
    /// answers but refuses or breaks the script (scripting disabled or renamed, an ACL without
    /// it, out of memory for the script cache) fails every check, and fails this too.
    pub async fn script_runs(&self) -> Result<(), String> {
        let deadline = Instant::now() + self.timeout;
        match self.call(None, Mode::Check, &[], deadline).await {
            Ok(_) => Ok(()),
            Err(failure) => Err(failure.detail),
        }
    }

    /// Redis is failing fast, for some checks at least: a breaker is open (on a cluster, the
    /// breaker of one slot range or more), and its checks return `Unavailable` without trying.
    pub fn breaker_open(&self) -> bool {
        self.breakers.iter().any(Breaker::is_open)
    }

    /// The breaker of `slot`'s range (always 0 on a single server).
    fn breaker_index(&self, slot: u16) -> usize {
        usize::from(slot) / Self::SLOTS_PER_BREAKER % self.breakers.len()
    }

    /// Count and log (at most once a second) a check Redis did not decide.
    fn failed(&self, failure: &Failure) -> Unavailable {
        bump(&self.counters.errors);
        if failure.kind == Unavailable::Timeout {
            bump(&self.counters.timeouts);
        }
        if let Some(held_back) = self.log_gate.open(self.clock.now().us() as u64) {
            tracing::warn!(
                reason = %failure.kind,
                detail = %failure.detail,
                similar_since_last = held_back,
                "rate limit not decided by Redis; the failure policy applies"
            );
        }
        failure.kind
    }

    /// Worker `id`'s connection and batcher, opened on first use; `None` for no worker.
    fn worker(&self, id: Option<usize>) -> Via<'_> {
        let cell = id.and_then(|id| self.per_worker.get(id))?;
        if let Some(worker) = cell.get() {
            return Some(worker);
        }
        let link = Arc::new(Link::open(&self.cfg).ok()?);
        let batcher = batch::Batcher::start(link.clone(), self.counters.clone(), self.timeout);
        let leases = slots::Batcher::start(link.clone(), self.counters.clone(), self.timeout);
        Some(cell.get_or_init(|| Worker {
            link,
            batcher,
            leases,
        }))
    }

    /// Open this worker thread's connection and start its batcher now, and have Redis answer
    /// once (for a cluster, once its slots are known) and hold the script, so that the first
    /// checks do not spend their timeout connecting. Errors are only logged: the connection
    /// keeps trying on its own, and checks apply the failure policy meanwhile.
    pub async fn warm_up_worker(&self, id: usize) {
        let Some(worker) = self.worker(Some(id)) else {
            return;
        };
        let on = worker.link.now();
        let warm = async {
            on.conn.ping().await?;
            on.conn.load_script(&BUCKET_SCRIPT).await
        };
        match tokio::time::timeout(WARM_UP_TIMEOUT, warm).await {
            Ok(Ok(())) => {
                tracing::debug!("worker's Redis connection ready");
                if !self
                    .answered
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::info!("Redis answers: limits are decided by Redis");
                }
            }
            Ok(Err(e)) if e.kind() == ::redis::ErrorKind::AuthenticationFailed => tracing::error!(
                error = %e,
                "Redis refused the credentials (limiter.redis username and password, or the \
                 URL's); checks apply the failure policy until they are right"
            ),
            Ok(Err(e)) => tracing::warn!(
                error = %e,
                "cannot reach Redis yet; checks apply the failure policy until it answers"
            ),
            Err(_) => tracing::warn!(
                "no answer from Redis within {WARM_UP_TIMEOUT:?}; checks apply the failure \
                 policy until it answers"
            ),
        }
    }

    /// The connection to use: the worker's own, else the shared one.
    fn link<'a>(&'a self, via: Via<'a>) -> &'a Arc<Link> {
        via.map_or(&self.shared, |w| &w.link)
    }

    /// One script call per slot the buckets live in (one in total on a single server), all
    /// sent at once. The deadline counts from `now`, when the check started.
    async fn ask(
        &self,
        via: Via<'_>,
        buckets: &[Bucket<'_>],
        now: Instant,
    ) -> Result<Reply, Failure> {
        // A nonsensical timeout (Duration::MAX) must not panic on the request path.
        let deadline = now
            .checked_add(self.timeout)
            .unwrap_or_else(|| now + Duration::from_hours(24));
        // All in one slot (always on a single server, where every bucket's slot is 0): the
        // common case, known without grouping.
        let first = buckets.first().map(|b| b.slot);
        if buckets.iter().all(|b| Some(b.slot) == first) {
            let all: SmallVec<[&Bucket<'_>; 4]> = buckets.iter().collect();
            return self.check_group(via, &all, deadline).await;
        }
        self.ask_slots(via, buckets, deadline).await
    }

    /// Check `group` (buckets of one slot) as one: in the worker's next batch, or, off the
    /// workers, in a call of its own.
    async fn check_group(
        &self,
        via: Via<'_>,
        group: &[&Bucket<'_>],
        deadline: Instant,
    ) -> Result<Reply, Failure> {
        if let Some(Worker { batcher, .. }) = via {
            // The batch answers by the deadline (see `batch`): no timer per request.
            return batcher.check(group.iter().copied(), deadline).await;
        }
        self.call(via, Mode::Check, group, deadline).await
    }

    /// Run the script on `group` before `deadline`, and parse a "check" reply.
    async fn call(
        &self,
        via: Via<'_>,
        mode: Mode,
        group: &[&Bucket<'_>],
        deadline: Instant,
    ) -> Result<Reply, Failure> {
        let link = self.link(via);
        let on = link.now();
        let value = self.send_on(link, &on, mode, group, deadline).await?;
        parse_reply(&value, group.iter().map(|b| b.enforced)).ok_or_else(|| {
            link.out_of_step(&on);
            Failure::unexpected_reply()
        })
    }

    /// Run the script on `group` before `deadline`.
    async fn send(
        &self,
        via: Via<'_>,
        mode: Mode,
        group: &[&Bucket<'_>],
        deadline: Instant,
    ) -> Result<::redis::Value, Failure> {
        let link = self.link(via);
        self.send_on(link, &link.now(), mode, group, deadline).await
    }

    /// Run the script on `group` through `link`'s connection `on`, and tell `link` how it went.
    async fn send_on(
        &self,
        link: &Link,
        on: &Current,
        mode: Mode,
        group: &[&Bucket<'_>],
        deadline: Instant,
    ) -> Result<::redis::Value, Failure> {
        bump(&self.counters.redis_calls);
        let run = on.conn.run(&BUCKET_SCRIPT, mode, group.iter().copied());
        let result = by_deadline(deadline, self.timeout, run).await;
        link.settle(on, &result);
        result
    }
}
