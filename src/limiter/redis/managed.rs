//! A connection to one Redis server, or to the master a set of Sentinels names, that
//! reconnects by itself and names itself (`CLIENT SETNAME`).
//!
//! Hand-written rather than the redis crate's `ConnectionManager`, which can neither run a
//! command on each new connection nor ask anew where to connect each time. It is the same
//! idea: one multiplexed connection shared by clones; the call that meets a connection error
//! (or a failed connect) starts a new connection in the background, and a call that finds the
//! last attempt failed starts another and waits for it. Attempts are so paced by the calls (and
//! so by the circuit breaker) rather than by a loop of their own, and a failed connect is tried
//! again at most once per `RETRY_CONNECT` whatever calls come meanwhile (readiness, the
//! operators' entries, the sweeper): a call in between fails at once with the last error. A
//! connection that dies, or a master that moves, is replaced at once.
//!
//! Under Sentinel every new connection first asks the Sentinels where the master is (the
//! crate checks that the server named answers `ROLE` as a master). A failover is followed at
//! the promotion: `watch` hears `+switch-master` (or, as a backstop, asks the Sentinels every
//! second) and the connection moves to the new master at once. A dropped connection or a
//! `READONLY` reply (a client that reached the old master after it became a replica) makes the
//! next call reconnect too. When no Sentinel answers, a new connection goes to the last master
//! they named, as long as it still answers `ROLE` as a master.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::aio::{ConnectionLike, MultiplexedConnection};
use ::redis::sentinel::SentinelClient;
use ::redis::{
    AsyncConnectionConfig, Client, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture,
    ServerErrorKind, Value,
};
use arc_swap::ArcSwap;
use futures_util::future::{BoxFuture, FutureExt, Shared};

/// A connection being made, or made (or failed): every caller awaits the same one.
type Pending = Shared<BoxFuture<'static, Result<MultiplexedConnection, RedisError>>>;

/// Where new connections go.
pub(super) enum Target {
    /// One server, always the same.
    Server(Client),
    /// Wherever the Sentinels say the master is now.
    Sentinel(tokio::sync::Mutex<SentinelClient>),
}

/// The least time between two attempts to connect after one failed.
const RETRY_CONNECT: Duration = Duration::from_secs(1);

/// One connection attempt, its number, and when it started.
struct Slot {
    id: u64,
    pending: Pending,
    started: tokio::time::Instant,
}

impl Slot {
    /// An attempt that failed less than `RETRY_CONNECT` ago: not tried again yet.
    fn failed_lately(&self) -> bool {
        matches!(self.pending.peek(), Some(Err(_))) && self.started.elapsed() < RETRY_CONNECT
    }
}

struct Inner {
    target: Target,
    name: String,
    config: AsyncConnectionConfig,
    /// How long asking the Sentinels may take.
    resolve_timeout: Duration,
    slot: ArcSwap<Slot>,
    /// The master's address the last connection went to, and its client (Sentinel only).
    master: Mutex<Option<(String, Client)>>,
    /// A replica the watch saw promoted, until the Sentinels name it too: new connections go
    /// there (while it answers `ROLE` as a master), not to the master the Sentinels still name.
    promoted: Mutex<Option<Promotion>>,
    /// Times the Sentinels named a different master than the previous connection's.
    switches: AtomicU64,
    /// Connections replaced after an error (or a move to another master).
    reconnects: AtomicU64,
}

/// A replica seen promoted before the Sentinels name it.
#[derive(Clone)]
struct Promotion {
    /// The master it replaces, which the Sentinels go on naming for up to a second.
    from: String,
    to: String,
    client: Client,
}

/// A self-healing multiplexed connection; clones share it.
#[derive(Clone)]
pub(super) struct Managed(Arc<Inner>);

impl std::fmt::Debug for Managed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0.target {
            Target::Server(_) => "Managed::Server",
            Target::Sentinel(_) => "Managed::Sentinel",
        })
    }
}

impl Managed {
    /// Start connecting in the background and return at once.
    pub(super) fn new(
        target: Target,
        name: String,
        config: AsyncConnectionConfig,
        resolve_timeout: Duration,
        watch: Option<super::sentinel::Watch>,
    ) -> Self {
        let inner = Arc::new_cyclic(|weak: &std::sync::Weak<Inner>| {
            let first = connect(weak.clone());
            Inner {
                target,
                name,
                config,
                resolve_timeout,
                slot: ArcSwap::from_pointee(Slot {
                    id: 0,
                    pending: first,
                    started: tokio::time::Instant::now(),
                }),
                master: Mutex::new(None),
                promoted: Mutex::new(None),
                switches: AtomicU64::new(0),
                reconnects: AtomicU64::new(0),
            }
        });
        tokio::spawn(inner.slot.load().pending.clone().map(drop));
        if let Some(watch) = watch {
            tokio::spawn(watch.run(Arc::downgrade(&inner)));
        }
        Self(inner)
    }

    /// Times the connection followed a failover to another master.
    pub(super) fn switches(&self) -> u64 {
        self.0.switches.load(Ordering::Relaxed)
    }

    /// Times the connection was replaced after an error.
    pub(super) fn reconnects(&self) -> u64 {
        self.0.reconnects.load(Ordering::Relaxed)
    }

    /// The current connection (waiting for it if it is being made), and which it is. One that
    /// failed to connect is replaced first: this call waits for a fresh attempt rather than
    /// failing on an old one (under Sentinel, one made before the failover was over).
    async fn get(&self) -> (Result<MultiplexedConnection, RedisError>, u64) {
        let mut slot = self.0.slot.load_full();
        if matches!(slot.pending.peek(), Some(Err(_))) {
            let _ = self.reconnect(slot.id);
            slot = self.0.slot.load_full();
        }
        (slot.pending.clone().await, slot.id)
    }

    /// Replace connection `id` by a new one, unless another caller already did (false).
    /// The live connection and its id. A failed connect is tried again by the next call,
    /// whatever the error.
    async fn ready(&self) -> Result<(MultiplexedConnection, u64), RedisError> {
        let (conn, id) = self.get().await;
        conn.map(|c| (c, id)).inspect_err(|_| {
            let _ = self.reconnect(id);
        })
    }

    fn reconnect(&self, id: u64) -> bool {
        if self.0.slot.load().failed_lately() {
            return false;
        }
        self.replace(id)
    }

    /// `reconnect`, without waiting for the pace of failed attempts.
    fn replace(&self, id: u64) -> bool {
        let next = Arc::new(Slot {
            id: id + 1,
            pending: connect(Arc::downgrade(&self.0)),
            started: tokio::time::Instant::now(),
        });
        let previous = self.0.slot.rcu(|now| {
            if now.id == id {
                next.clone()
            } else {
                now.clone()
            }
        });
        let swapped = previous.id == id;
        if swapped {
            self.0.reconnects.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(next.pending.clone().map(drop));
        }
        swapped
    }

    /// `settle`, and whether the call met a dead connection (Redis restarted, or a server
    /// closed it while idle): then the caller sends it once more, on the new connection, so
    /// an idle replica's first request after Redis returns is decided, not refused. A call
    /// that reached Redis before its connection died may so be counted twice: the price of
    /// not failing every first call after a restart.
    fn settled_dead<T>(&self, id: u64, result: &Result<T, RedisError>) -> bool {
        self.settle(id, result);
        matches!(result, Err(e) if !e.is_timeout() && (e.is_connection_dropped() || e.is_io_error()))
    }

    /// After a call on connection `id`: reconnect if the connection is gone, or (Sentinel)
    /// if the server is no longer the master.
    fn settle<T>(&self, id: u64, result: &Result<T, RedisError>) {
        let Err(e) = result else { return };
        let demoted = matches!(self.0.target, Target::Sentinel(_))
            && e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly);
        let gone = demoted || e.is_unrecoverable_error() || e.is_io_error();
        // Logged once per connection, by the call that replaces it.
        if gone && self.reconnect(id) && demoted {
            tracing::warn!(
                "the Redis master turned read-only (a failover): asking the Sentinels again"
            );
        }
    }
}

/// A new connection for `inner` (gone: an error), named, as a shared future.
fn connect(inner: std::sync::Weak<Inner>) -> Pending {
    async move {
        let Some(inner) = inner.upgrade() else {
            return Err(RedisError::from((ErrorKind::Client, "the limiter is gone")));
        };
        let promoted = match inner.target {
            Target::Sentinel(_) => promoted_master(&inner).await,
            Target::Server(_) => None,
        };
        let mut conn = match promoted {
            Some(conn) => conn,
            None => {
                let (client, unconfirmed) = match &inner.target {
                    Target::Server(client) => (client.clone(), false),
                    Target::Sentinel(sentinel) => match master(&inner, sentinel).await {
                        Ok(client) => (client, false),
                        Err(e) => (last_master(&inner).ok_or(e)?, true),
                    },
                };
                let mut conn = client
                    .get_multiplexed_async_connection_with_config(&inner.config)
                    .await?;
                if unconfirmed {
                    still_master(&mut conn).await?;
                }
                conn
            }
        };
        // A user whose ACL lacks CLIENT SETNAME can still check limits: only the name is lost.
        let named: Result<(), RedisError> = ::redis::cmd("CLIENT")
            .arg("SETNAME")
            .arg(&inner.name)
            .query_async(&mut conn)
            .await;
        if let Err(e) = named {
            tracing::warn!(error = %e, "Redis refused CLIENT SETNAME; the connection stays unnamed");
        }
        Ok(conn)
    }
    .boxed()
    .shared()
}

/// Ask the Sentinels for the master, and note when it moved.
async fn master(
    inner: &Inner,
    sentinel: &tokio::sync::Mutex<SentinelClient>,
) -> Result<Client, RedisError> {
    let ask = async { sentinel.lock().await.async_get_client().await };
    let client = tokio::time::timeout(inner.resolve_timeout, ask)
        .await
        .map_err(|_| {
            RedisError::from((ErrorKind::Io, "the Sentinels did not name a master in time"))
        })??;
    let addr = client.get_connection_info().addr().to_string();
    inner.note_master(
        addr,
        client.clone(),
        "the Sentinels name another Redis master: following it",
    );
    Ok(client)
}

/// A connection to the replica the watch saw promoted, if it still answers `ROLE` as a
/// master; it becomes the master the Sentinels are taken to name.
async fn promoted_master(inner: &Inner) -> Option<MultiplexedConnection> {
    let Promotion {
        to: addr, client, ..
    } = inner
        .promoted
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()?;
    let connected = async {
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&inner.config)
            .await?;
        still_master(&mut conn).await.map(|()| conn)
    };
    let Ok(conn) = connected.await else {
        // Gone, or no longer a master: the Sentinels decide again.
        *inner
            .promoted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        return None;
    };
    inner.note_master(addr, client, "a Redis replica was promoted: following it");
    Some(conn)
}

impl Inner {
    /// The master's address the last connection went to.
    fn current_master(&self) -> Option<String> {
        self.master
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|(a, _)| a.clone())
    }

    /// Note `addr` as the master connections go to; a move from another is counted and
    /// logged as `moved`.
    fn note_master(&self, addr: String, client: Client, moved: &'static str) {
        let mut last = self
            .master
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match last.as_ref().map(|(a, _)| a) {
            Some(before) if *before == addr => {}
            Some(before) => {
                self.switches.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(from = %before, to = %addr, "{moved}");
            }
            None => tracing::info!(master = %addr, "the Sentinels name the Redis master"),
        }
        *last = Some((addr, client));
    }

    /// Replace the live connection, as the master moved to `addr` (told `by`).
    fn move_to(self: Arc<Self>, addr: &str, by: &'static str) {
        let id = self.slot.load().id;
        if Managed(self).replace(id) {
            tracing::warn!(to = %addr, by, "the Redis master moved: reconnecting to it");
        }
    }
}

/// The last master the Sentinels named, when none of them answers now.
fn last_master(inner: &Inner) -> Option<Client> {
    let last = inner
        .master
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let (addr, client) = last.as_ref()?;
    tracing::warn!(master = %addr, "no Sentinel answers: trying the last master they named");
    Some(client.clone())
}

/// Whether the server of `conn` still answers `ROLE` as a master (an error if not).
async fn still_master(conn: &mut MultiplexedConnection) -> Result<(), RedisError> {
    let role: Value = ::redis::cmd("ROLE").query_async(conn).await?;
    if super::sentinel::is_master(&role) {
        Ok(())
    } else {
        Err(RedisError::from((
            ErrorKind::Io,
            "the server is no longer (or not yet) a master",
        )))
    }
}

impl super::sentinel::Follower for Inner {
    fn named(self: Arc<Self>, addr: &str, announced: bool) {
        {
            let mut promoted = self
                .promoted
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match promoted.as_ref() {
                // The Sentinels have not caught up with the promotion yet.
                Some(p) if p.from == addr => return,
                // Caught up, or another failover: the Sentinels lead again.
                Some(_) => *promoted = None,
                None => {}
            }
        }
        // Before the first connection, that connection asks the Sentinels itself.
        if self.current_master().is_none_or(|c| c == addr) {
            return;
        }
        let by = if announced {
            "+switch-master"
        } else {
            "the Sentinels' answer"
        };
        self.move_to(addr, by);
    }

    fn promoted(self: Arc<Self>, addr: &str, client: Client) {
        let Some(from) = self.current_master().filter(|c| c != addr) else {
            return;
        };
        *self
            .promoted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Promotion {
            from,
            to: addr.to_owned(),
            client,
        });
        self.move_to(addr, "the promotion");
    }
}

impl ConnectionLike for Managed {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        async move {
            let (mut conn, id) = self.ready().await?;
            let result = conn.req_packed_command(cmd).await;
            if !self.settled_dead(id, &result) {
                return result;
            }
            let (mut conn, id) = self.ready().await?;
            let again = conn.req_packed_command(cmd).await;
            self.settle(id, &again);
            again
        }
        .boxed()
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        async move {
            let (mut conn, id) = self.ready().await?;
            let result = conn.req_packed_commands(pipeline, offset, count).await;
            if !self.settled_dead(id, &result) {
                return result;
            }
            let (mut conn, id) = self.ready().await?;
            let again = conn.req_packed_commands(pipeline, offset, count).await;
            self.settle(id, &again);
            again
        }
        .boxed()
    }

    fn get_db(&self) -> i64 {
        match &self.0.target {
            Target::Server(client) => client.get_connection_info().redis_settings().db(),
            Target::Sentinel(_) => 0,
        }
    }
}
