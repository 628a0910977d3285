//! `${VAR}` in the config: a Redis password from the environment reaches a real redis-server
//! with `requirepass`, or an ACL user with only the commands the limiter needs (and never the
//! served `/config`); a wrong one is logged and shown by `/readyz`; an unset variable is a
//! located error of `check`. About the binary's environment, so the proxy is the real process.

use crate::common;
use crate::common::redis as redis_helpers;

use std::io::Write;
use std::time::Duration;

use common::{config, BinaryProxy, Http};
use redis_helpers::{RedisServer, MINIMAL_ACL};

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

const ACL_PASSWORD: &str = "acl-pw-from-the-environment";

/// The `limiter.redis` block as user `tollgate` with the password in `password:` (`pw`).
fn acl_yaml(port: u16, pw: &str) -> String {
    config(&format!(
        "admin:\n  address: 127.0.0.1:0\n\
         limiter:\n  backend: redis\n  on_failure: closed\n  redis:\n    url: redis://127.0.0.1:{port}\n    username: tollgate\n    password: {pw}\n\
         routes:\n  - name: all\n    respond: {{ status: 200 }}\n    limits:\n      - {{ name: acl-limit, rate: 1/min, burst: 2, key: [ip] }}\n"
    ))
}

fn acl_server() -> RedisServer {
    let redis = RedisServer::start();
    let pass = format!(">{ACL_PASSWORD}");
    let mut args = vec!["ACL", "SETUSER", "tollgate", "on", &pass];
    args.extend(MINIMAL_ACL);
    assert_eq!(redis.cli(&args).trim(), "OK");
    redis
}

#[tokio::test]
async fn an_acl_user_with_the_minimal_commands() {
    let redis = acl_server();
    let proxy = BinaryProxy::start_with_env(
        &acl_yaml(redis.port(), "${TOLLGATE_TEST_ACL_PASSWORD}"),
        &[("TOLLGATE_TEST_ACL_PASSWORD", ACL_PASSWORD)],
    );
    let http = Http::new();
    let codes = http.statuses(3, &proxy.url("/"), &[]).await;
    assert_eq!(codes, [200, 200, 429]);
    let admin = proxy.admin_addr();
    assert_eq!(
        http.get(&format!("http://{admin}/readyz")).await.code(),
        200
    );
    let clients = redis.cli(&["client", "list"]);
    assert!(
        clients
            .lines()
            .any(|l| l.contains("name=tollgate ") && l.contains("user=tollgate ")),
        "{clients}"
    );
    assert_eq!(redis.keys().len(), 1);
    let served = http.get(&format!("http://{admin}/config")).await;
    assert!(!served.text().contains(ACL_PASSWORD), "{}", served.text());

    // Written in the file itself, the password is masked too.
    let literal = BinaryProxy::start(&acl_yaml(redis.port(), ACL_PASSWORD));
    let served = http
        .get(&format!("http://{}/config", literal.admin_addr()))
        .await;
    assert!(served.text().contains("password: ***"), "{}", served.text());
    assert!(!served.text().contains(ACL_PASSWORD), "{}", served.text());
}

#[tokio::test]
async fn a_wrong_password_is_reported() {
    let redis = acl_server();
    let proxy = BinaryProxy::start_with_env(
        &acl_yaml(redis.port(), "${TOLLGATE_TEST_ACL_PASSWORD}"),
        &[("TOLLGATE_TEST_ACL_PASSWORD", "not-the-password")],
    );
    let http = Http::new();
    // The limit fails closed: nothing is admitted without Redis.
    let codes = http.statuses(2, &proxy.url("/"), &[]).await;
    assert_eq!(codes, [503, 503]);
    let why = "Password authentication failed";
    assert!(
        proxy.wait_for_log("Redis refused the credentials", Duration::from_secs(5)),
        "{:#?}",
        proxy.logs()
    );
    assert!(proxy.logs().iter().any(|l| l.contains(why)));
    let ready = http
        .get(&format!("http://{}/readyz", proxy.admin_addr()))
        .await;
    assert_eq!(ready.code(), 503);
    assert!(ready.text().contains(why), "{}", ready.text());
    assert!(redis.keys().is_empty());
}
