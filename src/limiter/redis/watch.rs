//! Follows a Sentinel failover at the promotion: a subscription to `+switch-master` on one
//! Sentinel at a time, with `SENTINEL get-master-addr-by-name` every second as a backstop,
//! moves a `Managed` connection to the new master as soon as the Sentinels name it, not once
//! the old master is demoted (until then it still answers, and what it counts is lost).

use std::sync::Weak;
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{Client, ConnectionAddr, IntoConnectionInfo, RedisError, TlsCertificates};

use crate::config::settings::SentinelSpec;
use futures_util::StreamExt;

/// How often the Sentinels are asked for the master, whatever the subscription says.
const POLL: Duration = Duration::from_secs(1);
/// How long connecting to a Sentinel, or its answer, may take.
const SENTINEL_TIMEOUT: Duration = Duration::from_millis(500);

/// The Sentinels of one master, and what to tell when they name another.
pub(super) struct Watch {
    pub(super) sentinels: Vec<Client>,
    pub(super) master: String,
}

/// Told the master's address (`host:port`) each time the Sentinels name it (`announced`: by
/// `+switch-master`, else by the poll). The watch ends once the follower is gone.
pub(super) trait Follower: Send + Sync + 'static {
    fn named(self: std::sync::Arc<Self>, addr: &str, announced: bool);
}

impl Watch {
    /// Clients of each Sentinel (their own user and password, TLS as the servers'), for the
    /// watch that follows a failover at the promotion.
    pub(super) fn of(
        s: &SentinelSpec,
        nodes: &[ConnectionAddr],
        tls: Option<&TlsCertificates>,
    ) -> Result<Self, String> {
        let sentinels = nodes
            .iter()
            .map(|addr| {
                let mut info = addr
                    .clone()
                    .into_connection_info()
                    .map_err(|e| format!("limiter.redis.sentinel: {e}"))?;
                let mut settings = info.redis_settings().clone();
                if let Some(password) = &s.password {
                    settings = settings.set_password(password);
                }
                if let Some(user) = &s.username {
                    settings = settings.set_username(user);
                }
                info = info.set_redis_settings(settings);
                match tls {
                    Some(tls) => Client::build_with_tls(info, tls.clone()),
                    None => Client::open(info),
                }
                .map_err(|e| format!("limiter.redis.sentinel: {e}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            sentinels,
            master: s.master.clone(),
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
                pubsub.subscribe("+switch-master").await?;
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
                        if let Some(addr) = switched_to(&payload, &self.master) {
                            let Some(f) = follower.upgrade() else { return };
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
                let made = tokio::time::timeout(
                    SENTINEL_TIMEOUT,
                    client.get_multiplexed_async_connection(),
                )
                .await;
                *conn = made.ok().and_then(Result::ok);
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

/// `+switch-master`'s payload is `<name> <old-ip> <old-port> <new-ip> <new-port>`: the new
/// master's address when the name is ours.
fn switched_to(payload: &str, master: &str) -> Option<String> {
    let parts: Vec<&str> = payload.split_whitespace().collect();
    match parts.as_slice() {
        [name, _, _, host, port] if *name == master => Some(addr_of(host, port.parse().ok()?)),
        _ => None,
    }
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
}
