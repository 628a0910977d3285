//! One owner per port: a second `tollgate run` on a port another process serves fails to start
//! and says which listener, unless its listener asks to share the port (`share_port: true`).

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::{self, BinaryProxy, Http};

fn answering(address: &str, share: bool) -> String {
    format!(
        "listeners:\n  - address: {address}\n    share_port: {share}\nroutes:\n  - name: all\n    respond: {{ status: 200, body: \"ok\" }}\n"
    )
}

#[tokio::test]
async fn a_second_process_on_a_served_port_is_refused_and_says_which() {
    let first = BinaryProxy::start(&answering("127.0.0.1:0", false));
    let taken = first.addr();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("second.yaml");
    std::fs::write(&path, answering(&taken.to_string(), false)).unwrap();
    let mut second = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["run", "--config"])
        .arg(&path)
        .env_remove("TOLLGATE_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let exited = common::eventually(Duration::from_secs(10), || {
        let done = second.try_wait().ok().flatten().is_some();
        async move { done }
    })
    .await;
    if !exited {
        let _ = second.kill();
    }
    let out = second.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        exited && !out.status.success(),
        "the second process must not start: {stderr}"
    );
    assert!(
        stderr.contains(&format!("cannot listen on {taken}")) && stderr.contains("in use"),
        "{stderr}"
    );
    // The first one still has every connection.
    assert_eq!(Http::new().get(&first.url("/")).await.code(), 200);
}

#[tokio::test]
async fn share_port_lets_a_new_process_join_the_old_one() {
    let old = BinaryProxy::start(&answering("127.0.0.1:0", false));
    let port = old.addr();
    let new = BinaryProxy::start(&answering(&port.to_string(), true));
    assert_eq!(new.addr(), port);
    assert_eq!(Http::new().get(&new.url("/")).await.code(), 200);
}
