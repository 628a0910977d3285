//! The `limiter.redis` settings: where the shared store is (a server, a Cluster, a Sentinel
//! set), its credentials and TLS files, kept out of logs.

use std::time::Duration;

/// The `limiter.redis` block. Exactly one of `url`, `cluster` and `sentinel` is set (checked
/// when the config is compiled). Its `Debug` hides the passwords and the private key.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// `redis://[user:password@]host:port[/db]` or `rediss://...` (TLS).
    pub url: Option<String>,
    /// Seed nodes of a Redis Cluster, as URLs.
    pub cluster: Vec<String>,
    /// The master a set of Sentinels names: connections go to wherever they say it is.
    pub sentinel: Option<SentinelSpec>,
    /// The Redis servers' ACL user and password, when not in the URL.
    pub username: Option<String>,
    pub password: Option<String>,
    /// TLS to the Redis servers (and the Sentinels) with these files; `None` with a
    /// `rediss://` URL: the system roots, no client certificate.
    pub tls: Option<RedisTls>,
    /// `CLIENT SETNAME` of every connection, for `CLIENT LIST`.
    pub client_name: String,
    /// Deadline of one check; past it the failure policy applies.
    pub timeout: Duration,
    /// Prepended to every key, so several deployments can share a Redis.
    pub key_prefix: String,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: None,
            cluster: Vec::new(),
            sentinel: None,
            username: None,
            password: None,
            tls: None,
            client_name: "tollgate".into(),
            timeout: Duration::from_millis(50),
            key_prefix: "tollgate:".into(),
        }
    }
}

/// Where to find the master: the Sentinels watching it, and its name there.
#[derive(Clone, PartialEq, Eq)]
pub struct SentinelSpec {
    pub master: String,
    /// `host:port` of each Sentinel.
    pub nodes: Vec<String>,
    /// The Sentinels' own ACL user and password (`requirepass` in sentinel.conf), if any.
    pub username: Option<String>,
    pub password: Option<String>,
}

/// TLS files for Redis, read when the config is compiled (PEM).
#[derive(Clone, PartialEq, Eq)]
pub struct RedisTls {
    /// Certificates to trust instead of the system roots.
    pub ca: Option<Vec<u8>>,
    /// A client certificate chain and its key, for servers that ask for one.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |s: &Option<String>| s.as_ref().map(|_| "***");
        f.debug_struct("RedisConfig")
            .field("url", &self.url.as_deref().map(redact))
            .field(
                "cluster",
                &self.cluster.iter().map(|u| redact(u)).collect::<Vec<_>>(),
            )
            .field(
                "sentinel",
                &self
                    .sentinel
                    .as_ref()
                    .map(|s| (&s.master, &s.nodes, &s.username, hidden(&s.password))),
            )
            .field("username", &self.username)
            .field("password", &hidden(&self.password))
            .field(
                "tls",
                &self
                    .tls
                    .as_ref()
                    .map(|t| (t.ca.is_some(), t.client.is_some())),
            )
            .field("client_name", &self.client_name)
            .field("timeout", &self.timeout)
            .field("key_prefix", &self.key_prefix)
            .finish()
    }
}

/// `redis://user:secret@host` -> `redis://user:***@host`, for logs.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority = rest.split('/').next().unwrap_or(rest);
    match authority.rsplit_once('@') {
        Some((userinfo, _)) => {
            let user = userinfo.split_once(':').map_or("", |(user, _)| user);
            format!("{scheme}://{user}:***@{}", &rest[userinfo.len() + 1..])
        }
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn debug_output_hides_passwords() {
        assert_eq!(
            redact("redis://user:secret@host:6379/0"),
            "redis://user:***@host:6379/0"
        );
    }
}
