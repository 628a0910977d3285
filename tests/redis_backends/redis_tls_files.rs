//! `limiter.redis.tls`: a CA file to trust instead of the system roots, and a client
//! certificate for a redis-server that requires one (`--tls-auth-clients yes`), through the
//! proxy's config. The certificates are made by `openssl` for each run; unlike `redis_tls.rs`
//! nothing here sets `SSL_CERT_FILE`, so only the CA file can make the test CA trusted.

use crate::common;
use crate::common::redis as redis_helpers;

use common::{config, Http, TestProxy};
use redis_helpers::{free_port, make_certs, tls_args, until_redis_decides, RedisServer};

/// A route limited to 2 a minute per address by Redis at `url`, failing closed; `tls` is the
/// `limiter.redis.tls` block (flow style).
fn yaml(url: &str, tls: &str) -> String {
    config(&format!(
        "limiter:\n  backend: redis\n  on_failure: closed\n  redis:\n    url: {url}\n    tls: {tls}\n    timeout: 2s\n    client_name: tollgate-tls-test\n\
         routes:\n  - name: all\n    respond: {{ status: 200 }}\n    limits:\n      - {{ name: tls-limit, rate: 2/min, burst: 2, key: [ip] }}\n"
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_file_and_a_client_certificate() {
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path());
    let file = |name: &str| certs.path().join(name).to_string_lossy().into_owned();
    let tls_port = free_port();
    let args = tls_args(certs.path(), tls_port, true);
    let server = RedisServer::start_with(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let url = format!("rediss://127.0.0.1:{tls_port}");
    let http = Http::new();

    let proxy = TestProxy::start(&yaml(
        &url,
        &format!(
            "{{ ca: {}, cert: {}, key: {} }}",
            file("ca.crt"),
            file("client.crt"),
            file("client.key")
        ),
    ));
    // Redis decides (a refused handshake would fail closed, 503, forever): the first decided
    // request takes one of the two tokens, the next the other.
    until_redis_decides(&http, &proxy.url("/"), &[]).await;
    assert_eq!(http.statuses(2, &proxy.url("/"), &[]).await, [200, 429]);
    assert_eq!(server.keys().len(), 1);
    let clients = server.cli(&["client", "list"]);
    assert!(clients.contains("name=tollgate-tls-test "), "{clients}");
    drop(proxy);

    // The server requires a client certificate: the CA alone is not enough.
    let no_cert = TestProxy::start(&yaml(&url, &format!("{{ ca: {} }}", file("ca.crt"))));
    let codes = http.statuses(2, &no_cert.url("/"), &[]).await;
    assert!(codes.iter().all(|&c| c == 503), "{codes:?}");
    drop(no_cert);

    // Without the CA file the system roots do not know the test CA.
    let no_ca = TestProxy::start(&yaml(
        &url,
        &format!(
            "{{ cert: {}, key: {} }}",
            file("client.crt"),
            file("client.key")
        ),
    ));
    let codes = http.statuses(2, &no_ca.url("/"), &[]).await;
    assert!(codes.iter().all(|&c| c == 503), "{codes:?}");
    assert_eq!(server.keys().len(), 1, "nothing else reached Redis");
}
