//! `${VAR}` in the config: a Redis password from the environment reaches a real redis-server
//! with `requirepass` (and never the served `/config`), and an unset variable is a located
//! error of `check`. About the binary's environment, so the proxy is the real process.

mod common;
#[allow(dead_code)]
#[path = "common/redis.rs"]
mod redis_helpers;

use std::io::Write;

use common::{config, BinaryProxy, Http};
use redis_helpers::RedisServer;

const PASSWORD: &str = "pw-from-the-environment";

fn yaml(port: u16) -> String {
    config(&format!(
        "admin:\n  address: 127.0.0.1:0\n\
         limiter:\n  backend: redis\n  on_failure: closed\n  redis:\n    url: redis://:${{TOLLGATE_TEST_REDIS_PASSWORD}}@127.0.0.1:{port}\n\
         routes:\n  - name: all\n    respond: {{ status: 200 }}\n    limits:\n      - {{ name: env-limit, rate: 1/min, burst: 2, key: [ip] }}\n"
    ))
}

#[tokio::test]
async fn a_redis_password_comes_from_the_environment() {
    let redis = RedisServer::start();
    // Set after start: the helper's readiness PING has no password.
    assert_eq!(
        redis
            .cli(&["CONFIG", "SET", "requirepass", PASSWORD])
            .trim(),
        "OK"
    );
    let proxy = BinaryProxy::start_with_env(
        &yaml(redis.port()),
        &[("TOLLGATE_TEST_REDIS_PASSWORD", PASSWORD)],
    );
    let http = Http::new();
    // Redis counts them (a refused AUTH would be 503: the limit fails closed).
    let codes = http.statuses(3, &proxy.url("/"), &[]).await;
    assert_eq!(codes, [200, 200, 429]);
    let served = http
        .get(&format!("http://{}/config", proxy.admin_addr()))
        .await;
    assert!(!served.text().contains(PASSWORD), "{}", served.text());
}

#[test]
fn an_unset_variable_is_a_located_error() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(yaml(6390).as_bytes()).unwrap();
    let out = common::proxy::run_cli(&["check", "--config", file.path().to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(":9:10: limiter.redis.url: environment variable `TOLLGATE_TEST_REDIS_PASSWORD` is not set"),
        "{err}"
    );
}
