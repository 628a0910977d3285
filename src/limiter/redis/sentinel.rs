//! Follows a Sentinel failover at the promotion: a subscription on one Sentinel at a time
//! moves a `Managed` connection to the replica the moment it turns master, not once the old
//! master is demoted (until then it still answers, and what it counts is lost).
//!
//! Sentinel publishes `+switch-master` some 0.4-1 s after it promoted the replica (it learns
//! of the promotion from the replica's `INFO`, polled every second). So the watch listens for
//! `+failover-state-send-slaveof-noone` too, which names the replica about to be promoted, and
//! asks that replica `ROLE` every millisecond until it answers as master (Sentinel kills the
//! replica's clients in the same transaction as the promotion: a dropped poll means it is
//! done). `+switch-master`, and `SENTINEL get-master-addr-by-name` every second, remain the
//! backstop.

use std::sync::{Arc, Weak};
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{Client, ConnectionAddr, IntoConnectionInfo, RedisError, TlsCertificates, Value};

use crate::config::settings::SentinelSpec;
use futures_util::StreamExt;

/// How often the Sentinels are asked for the master, whatever the subscription says.
const POLL: Duration = Duration::from_secs(1);
/// How long connecting to a Sentinel, or its answer, may take.
const SENTINEL_TIMEOUT: Duration = Duration::from_millis(500);
/// How often a replica being promoted is asked `ROLE`, and for how long at most.
const PROMOTION_POLL: Duration = Duration::from_millis(1);
const PROMOTION_WAIT: Duration = Duration::from_secs(5);
/// The Sentinel channels the watch follows.
const SWITCH: &str = "+switch-master";
const PROMOTING: &str = "+failover-state-send-slaveof-noone";

/// The Sentinels of one master, and what to tell when they name another.
pub(super) struct Watch {
    pub(super) sentinels: Vec<Client>,
    pub(super) master: String,
    /// How to reach a replica being promoted: the servers' credentials and TLS.
    servers: Servers,
}

/// The servers' user, password and TLS, for a client to any of them.
struct Servers {
    username: Option<String>,
    password: Option<String>,
    tls: Option<TlsCertificates>,
}

impl Servers {
    fn client(&self, host: &str, port: u16) -> Option<Client> {
        let addr = if self.tls.is_some() {
            ConnectionAddr::TcpTls {
                host: host.to_owned(),
                port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(host.to_owned(), port)
        };
        let auth = (self.username.as_deref(), self.password.as_deref());
        authed(addr, auth, self.tls.as_ref()).ok()
    }
}

/// A client of `addr` with a user and password (`auth`) and TLS, as the Sentinels' and the
/// servers' own settings say.
fn authed(
    addr: ConnectionAddr,
    (user, password): (Option<&str>, Option<&str>),
    tls: Option<&TlsCertificates>,
) -> Result<Client, RedisError> {
    let mut info = addr.into_connection_info()?;
    let mut settings = info.redis_settings().clone();
    if let Some(password) = password {
        settings = settings.set_password(password);
    }
    if let Some(user) = user {
        settings = settings.set_username(user);
    }
    info = info.set_redis_settings(settings);
    match tls {
        Some(tls) => Client::build_with_tls(info, tls.clone()),
        None => Client::open(info),
    }
}

/// Told the master's address (`host:port`) each time the Sentinels name it (`announced`: by
/// `+switch-master`, else by the poll), and a replica's the moment it answers as the promoted
/// master. The watch ends once the follower is gone.
pub(super) trait Follower: Send + Sync + 'static {
    fn named(self: std::sync::Arc<Self>, addr: &str, announced: bool);
    fn promoted(self: std::sync::Arc<Self>, addr: &str, client: Client);
}

impl Watch {
    /// Clients of each Sentinel (their own user and password, TLS as the servers'), for the
    /// watch that follows a failover at the promotion.
    pub(super) fn of(
        s: &SentinelSpec,
        nodes: &[ConnectionAddr],
        tls: Option<&TlsCertificates>,
        server_user: Option<&str>,
        server_password: Option<&str>,
    ) -> Result<Self, String> {
        let sentinels = nodes
            .iter()
            .map(|addr| {
                let auth = (s.username.as_deref(), s.password.as_deref());
                authed(addr.clone(), auth, tls).map_err(|e| format!("limiter.redis.sentinel: {e}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            sentinels,
            master: s.master.clone(),
            servers: Servers {
                username: server_user.map(str::to_owned),
                password: server_password.map(str::to_owned),
                tls: tls.cloned(),
            },
        })
    }

    /// Watch until the follower is gone.
    pub(super) async fn run<F: Follower>(self, follower: Weak<F>) {
        let mut turn = 0usize;
        let mut poller: Option<MultiplexedConnection> = None;
        loop {
            let n = self.sentinels.len().max(1);
            let client = &self.sentinels[turn % n];
            turn += 1;
            let subscribed = tokio::time::timeout(SENTINEL_TIMEOUT, async {
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe(&[SWITCH, PROMOTING]).await?;
                Ok::<_, RedisError>(pubsub)
            })
            .await;
            let mut messages = match subscribed {
                Ok(Ok(pubsub)) => Some(pubsub.into_on_message()),
                _ => None,
            };
            let mut tick = tokio::time::interval(POLL);
            loop {
                let message = async {
                    match &mut messages {
                        Some(m) => m.next().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    m = message => {
                        let Some(m) = m else { break };
                        let payload: String = m.get_payload().unwrap_or_default();
                        let Some(f) = follower.upgrade() else { return };
                        if m.get_channel_name() == PROMOTING {
                            if let Some((host, port)) = promoting(&payload, &self.master) {
                                self.follow_promotion(&host, port, f).await;
                            }
                        } else if let Some(addr) = switched_to(&payload, &self.master) {
                            f.named(&addr, true);
                        }
                    }
                    _ = tick.tick() => {
                        let Some(f) = follower.upgrade() else { return };
                        if let Some(addr) = self.ask(&mut poller, &mut turn).await {
                            f.named(&addr, false);
                        }
                        // Without a subscription, try the next Sentinel's at each tick.
                        if messages.is_none() {
                            break;
                        }
                    }
                }
            }
        }
    }

    /// Ask the replica at `host:port` `ROLE` every millisecond until it answers as master (or
    /// `PROMOTION_WAIT` passes: a failover Sentinel gave up), and then move the follower to it.
    /// Messages meanwhile wait in the subscription.
    async fn follow_promotion<F: Follower>(&self, host: &str, port: u16, f: Arc<F>) {
        let Some(client) = self.servers.client(host, port) else {
            return;
        };
        let deadline = tokio::time::Instant::now() + PROMOTION_WAIT;
        let mut conn: Option<MultiplexedConnection> = None;
        while tokio::time::Instant::now() < deadline {
            if conn.is_none() {
                conn = connected(&client).await;
            }
            if let Some(c) = conn.as_mut() {
                let role = tokio::time::timeout(
                    SENTINEL_TIMEOUT,
                    ::redis::cmd("ROLE").query_async::<Value>(c),
                )
                .await;
                match role {
                    Ok(Ok(role)) if is_master(&role) => {
                        f.promoted(&addr_of(host, port), client);
                        return;
                    }
                    Ok(Ok(_)) => {}
                    // Killed with the promotion: the next connection's `ROLE` says so.
                    _ => {
                        conn = None;
                        continue;
                    }
                }
            }
            tokio::time::sleep(PROMOTION_POLL).await;
        }
    }

    /// The master as one Sentinel names it now (the next one's turn if this one fails).
    async fn ask(
        &self,
        conn: &mut Option<MultiplexedConnection>,
        turn: &mut usize,
    ) -> Option<String> {
        let n = self.sentinels.len().max(1);
        for _ in 0..n {
            if conn.is_none() {
                let client = &self.sentinels[*turn % n];
                *turn += 1;
                *conn = connected(client).await;
            }
            let Some(c) = conn.as_mut() else { continue };
            let asked = tokio::time::timeout(
                SENTINEL_TIMEOUT,
                ::redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(&self.master)
                    .query_async::<Option<(String, u16)>>(c),
            )
            .await;
            match asked {
                Ok(Ok(Some((host, port)))) => return Some(addr_of(&host, port)),
                Ok(Ok(None)) => return None,
                _ => *conn = None,
            }
        }
        None
    }
}

/// A connection to `client`'s server within `SENTINEL_TIMEOUT`, or none.
async fn connected(client: &Client) -> Option<MultiplexedConnection> {
    let made = tokio::time::timeout(SENTINEL_TIMEOUT, client.get_multiplexed_async_connection());
    made.await.ok().and_then(Result::ok)
}

/// `+switch-master`'s payload is `<name> <old-ip> <old-port> <new-ip> <new-port>`: the new
/// master's address when the name is ours.
fn switched_to(payload: &str, master: &str) -> Option<String> {
    let parts: Vec<&str> = payload.split_whitespace().collect();
    match parts.as_slice() {
        [name, _, _, host, port] if *name == master => Some(addr_of(host, port.parse().ok()?)),
        _ => None,
    }
}

/// `+failover-state-send-slaveof-noone`'s payload is `slave <host:port> <ip> <port> @ <name>
/// <master-ip> <master-port>`: the replica about to be promoted, when the name is ours.
fn promoting(payload: &str, master: &str) -> Option<(String, u16)> {
    let parts: Vec<&str> = payload.split_whitespace().collect();
    match parts.as_slice() {
        ["slave", _, host, port, "@", name, ..] if *name == master => {
            Some(((*host).to_owned(), port.parse().ok()?))
        }
        _ => None,
    }
}

/// Whether a `ROLE` reply is a master's.
pub(super) fn is_master(role: &Value) -> bool {
    matches!(role, Value::Array(items) if matches!(items.first(), Some(Value::BulkString(b)) if b == b"master"))
}

/// `host:port` as the redis crate writes a connection's address (`ConnectionAddr`'s Display).
fn addr_of(host: &str, port: u16) -> String {
    format!("{host}:{port}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_names_the_new_master_of_ours_only() {
        assert_eq!(
            switched_to("mymaster 127.0.0.1 6379 127.0.0.1 6380", "mymaster"),
            Some("127.0.0.1:6380".into())
        );
        assert_eq!(
            switched_to("other 127.0.0.1 6379 127.0.0.1 6380", "mymaster"),
            None
        );
        assert_eq!(switched_to("garbage", "mymaster"), None);
    }

    #[test]
    fn a_promotion_names_the_replica_of_ours_only() {
        let event = "slave 127.0.0.1:26381 127.0.0.1 26381 @ mymaster 127.0.0.1 26380";
        assert_eq!(
            promoting(event, "mymaster"),
            Some(("127.0.0.1".into(), 26381))
        );
        assert_eq!(promoting(event, "other"), None);
        assert_eq!(
            promoting("master mymaster 127.0.0.1 26380", "mymaster"),
            None
        );
    }
}
