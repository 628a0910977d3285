//! `rediss://user:password@host:port`: the Redis limiter over TLS (rustls), authenticated as
//! an ACL user that may only touch the limiter's own keys. The certificates are made by the
//! `openssl` command for each run; the client trusts the test CA through `SSL_CERT_FILE`
//! (read by rustls-native-certs), set for this test's life only.

use crate::common::redis as redis_helpers;

use std::time::Duration;

use redis_helpers::{free_port, make_certs, RedisServer};
use tollgate::identity::{ClientId, KeySpec};
use tollgate::limiter::redis::{RedisConfig, RedisLimiter};
use tollgate::limiter::Check;

fn limiter(url: String) -> RedisLimiter {
    let cfg = RedisConfig {
        url: Some(url),
        cluster: Vec::new(),
        timeout: Duration::from_secs(2),
        key_prefix: "tg-tls:".into(),
        ..RedisConfig::default()
    };
    RedisLimiter::new(&cfg).expect("a valid config")
}

/// Removes an environment variable when dropped.
struct Unset(&'static str);

impl Drop for Unset {
    fn drop(&mut self) {
        std::env::remove_var(self.0);
    }
}

#[tokio::test]
async fn rediss_with_an_acl_user() {
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path());
    let file = |name: &str| certs.path().join(name).to_string_lossy().into_owned();
    std::env::set_var("SSL_CERT_FILE", file("ca.crt"));
    // Gone before the certificates are: other tests of this binary run in the same process,
    // and a dangling SSL_CERT_FILE makes every TLS client they build fail to load its roots.
    let _unset = Unset("SSL_CERT_FILE");
    let tls_port = free_port().to_string();
    let (cert, key, ca) = (file("srv.crt"), file("srv.key"), file("ca.crt"));
    let server = RedisServer::start_with(&[
        "--tls-port",
        &tls_port,
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
        "--tls-ca-cert-file",
        &ca,
        "--tls-auth-clients",
        "no",
        // A user that can run scripts on the limiter's keys and nothing else.
        "--user",
        "tollgate",
        "on",
        ">s3cret",
        "~tg-tls:*",
        "+@all",
    ]);
    let lim = tollgate::limiter::test_util::limit("tls", (0.01, 2), 1, KeySpec(Vec::new()));
    let checks = [Check {
        limit: &lim,
        client: ClientId(1),
    }];
    let l = limiter(format!("rediss://tollgate:s3cret@127.0.0.1:{tls_port}"));
    let admitted: Vec<bool> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(l.check(&checks, &[true]).await.expect("TLS + ACL works")[0].admitted);
        }
        v
    };
    assert_eq!(admitted, [true, true, false]);
    assert_eq!(server.keys().len(), 1);

    let wrong = limiter(format!("rediss://tollgate:nope@127.0.0.1:{tls_port}"));
    assert!(wrong.check(&checks, &[true]).await.is_err());
    let plain = limiter(format!("redis://tollgate:s3cret@127.0.0.1:{tls_port}"));
    assert!(plain.check(&checks, &[true]).await.is_err());
}
