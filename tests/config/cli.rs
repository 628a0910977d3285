//! The command line: `check` on valid configs (its summary, the shipped config), `run` on the
//! shipped config, an invalid config refused by `run`, `--version` (with the commit), `--help`,
//! a mistyped `--log-level`, completions and the man page, and shutdown on
//! SIGTERM with in-flight requests drained. All of it is about the binary, so every proxy here
//! is the real process (`BinaryProxy`).

use crate::common;

use std::time::Duration;

use common::proxy::run_cli;
use common::{check, config, upstream_app, BinaryProxy, Http, MockUpstream};

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn check_prints_one_line_per_route_and_limit_and_exits_zero() {
    let out = check("tests/fixtures/valid/full.yaml");
    assert!(out.status.success(), "stderr:\n{}", stderr(&out));
    assert_eq!(stderr(&out), "");
    assert_eq!(
        stdout(&out),
        "\
listeners: 127.0.0.1:8000, [::1]:8000
route login: POST /login -> upstream legacy
  limit login-per-ip: 5/min, burst 5, key [ip], on_failure closed
route api: * *.example.com/v1/* (+1 header conditions) -> upstream legacy
  limit per-key: 10/s, burst 50, key [header:x-api-key, ip], on_failure open
  limit api-global: 1000/s, burst 2000, key [global], cost 2, shadow, 2 exemptions, on_failure open
  limit per-tenant-ip: 10/s, burst 100, key [header:x-tenant+ip, query:tenant, cookie:tenant, bearer], on_failure open
  limit daily: 0.5/day, burst 1, key [host+method+path], on_failure open
route hello: * /* -> respond 200
  limit hello-per-ip: 1/s, burst 5, key [ip], on_failure open
tests/fixtures/valid/full.yaml: ok
"
    );
}

#[test]
fn check_shows_leasing() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("leased.yaml");
    std::fs::write(
        &file,
        config(
            "limiter: { backend: redis, redis: { url: \"redis://127.0.0.1:6379\" } }
routes:
  - name: r
    respond: { status: 200 }
    limits:
      - { name: tenant, rate: 20000/s, burst: 20000, key: [\"header:X-Tenant\"], leasing: auto }
      - { name: partner, rate: 500/s, burst: 1000, key: [ip], leasing: { tokens: 50, hold: 2s } }
",
        ),
    )
    .unwrap();
    let out = check(file.to_str().unwrap());
    assert!(out.status.success(), "stderr:\n{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("  limit tenant: 20000/s, burst 20000, key [header:x-tenant], leasing auto, at most 1024 tokens held 1s, on_failure open\n"), "{text}");
    assert!(text.contains("  limit partner: 500/s, burst 1000, key [ip], leasing at most 50 tokens held 2s, on_failure open\n"), "{text}");
}

#[test]
fn the_shipped_config_passes_check() {
    let out = check("config/tollgate.yaml");
    assert!(out.status.success(), "stderr:\n{}", stderr(&out));
    assert!(
        stdout(&out).ends_with("config/tollgate.yaml: ok\n"),
        "{}",
        stdout(&out)
    );
}

#[test]
fn the_config_path_can_come_from_the_environment() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("check")
        .current_dir(common::proxy::repo_root())
        .env("TOLLGATE_CONFIG", "tests/fixtures/valid/full.yaml")
        .output()
        .expect("run tollgate");
    assert!(out.status.success(), "stderr:\n{}", stderr(&out));
    assert!(stdout(&out).ends_with("tests/fixtures/valid/full.yaml: ok\n"));
}

#[test]
fn version_and_help() {
    let out = run_cli(&["--help"]);
    assert!(out.status.success());
    let help = stdout(&out);
    for word in [
        "run",
        "check",
        "completions",
        "man",
        "--config",
        "--log-level",
    ] {
        assert!(
            help.contains(word),
            "--help does not mention {word}:\n{help}"
        );
    }
}

#[test]
fn run_refuses_an_invalid_config_with_the_same_message_as_check() {
    let path = "tests/fixtures/invalid/unknown_upstream.yaml";
    let checked = check(path);
    let out = run_cli(&["run", "--config", path]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&stderr(&checked)),
        "run says:\n{}\ncheck says:\n{}",
        stderr(&out),
        stderr(&checked)
    );
}

#[tokio::test]
async fn the_shipped_config_runs_and_limits_as_its_comment_says() {
    let shipped = std::fs::read_to_string(common::proxy::repo_root().join("config/tollgate.yaml"))
        .expect("read config/tollgate.yaml");
    assert!(shipped.contains("127.0.0.1:8000"));
    // The same file on a free port.
    let proxy = BinaryProxy::start(&shipped.replace("127.0.0.1:8000", "127.0.0.1:0"));
    let http = Http::new();
    let mut codes = Vec::new();
    for _ in 0..8 {
        let r = http.get(&proxy.url("/")).await;
        if r.code() == 200 {
            assert_eq!(r.text(), "hello from tollgate\n");
        }
        codes.push(r.code());
    }
    assert_eq!(codes, [200, 200, 200, 200, 200, 429, 429, 429]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_then_exits() {
    let up = MockUpstream::start();
    let mut proxy = BinaryProxy::start(&config(&format!(
        "{}routes:\n  - name: r\n    upstream: app\n",
        upstream_app(up.addr(), "5s")
    )));
    let http = Http::new();
    let url = proxy.url("/slow/700");
    let in_flight = tokio::spawn(async move { http.get(&url).await });
    assert!(
        up.wait_for(1, Duration::from_secs(5)),
        "the request never reached the upstream"
    );
    proxy.terminate();
    let r = in_flight.await.expect("the request task");
    assert_eq!(
        r.code(),
        200,
        "an in-flight request completes during the drain"
    );
    assert_eq!(r.text(), "slow\n");
    let status = proxy
        .wait_exit(Duration::from_secs(10))
        .expect("tollgate exits after SIGTERM");
    assert!(status.success(), "exit status {status:?}");
    assert!(proxy.logs().iter().any(|l| l.contains("stopped")));
}

#[test]
fn version_names_the_commit() {
    let out = run_cli(&["--version"]);
    assert!(out.status.success());
    let text = stdout(&out);
    assert!(
        text.starts_with(&format!("tollgate {} (commit ", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
}

#[test]
fn an_invalid_log_level_is_an_error_not_info() {
    for bad in ["warnn", "info,tollgate=loud", "=debug"] {
        let out = run_cli(&[
            "--log-level",
            bad,
            "check",
            "--config",
            "config/tollgate.yaml",
        ]);
        assert_eq!(out.status.code(), Some(2), "{bad}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("--log-level"),
            "{bad}: {}",
            stderr(&out)
        );
    }
    let out = run_cli(&[
        "--log-level",
        "warn,tollgate=debug",
        "check",
        "--config",
        "config/tollgate.yaml",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn completions_and_the_man_page_are_generated() {
    let out = run_cli(&["completions", "bash"]);
    assert!(out.status.success());
    let script = std::env::temp_dir().join(format!("tollgate-{}.bash", std::process::id()));
    std::fs::write(&script, &out.stdout).unwrap();
    let parsed = std::process::Command::new("bash")
        .arg("-n")
        .arg(&script)
        .status()
        .expect("run bash -n");
    let _ = std::fs::remove_file(&script);
    assert!(
        parsed.success(),
        "the bash completion script does not parse"
    );
    assert!(stdout(&out).contains("completions"));
    for shell in ["zsh", "fish"] {
        assert!(run_cli(&["completions", shell]).status.success(), "{shell}");
    }
    let man = run_cli(&["man"]);
    assert!(man.status.success());
    let page = stdout(&man);
    assert!(
        page.starts_with(".ie") && page.contains(".TH tollgate 1"),
        "{page}"
    );
}

#[test]
fn man_dir_writes_a_page_per_command() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_cli(&["man", "--dir", dir.path().to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    for command in [
        "run", "check", "health", "explain", "simulate", "schema", "man",
    ] {
        let page = std::fs::read_to_string(dir.path().join(format!("tollgate-{command}.1")))
            .unwrap_or_else(|e| panic!("tollgate-{command}.1: {e}"));
        assert!(
            page.contains(&format!(".TH tollgate-{command} 1")),
            "{page}"
        );
        assert!(page.contains(&format!("tollgate {command}")), "{page}");
    }
    assert!(dir.path().join("tollgate.1").exists());
}

/// `--color always` colours the text log even off a terminal, `never` (and `auto` off a
/// terminal) does not; `NO_COLOR` turns `auto` off on a terminal.
#[tokio::test]
async fn the_log_is_coloured_only_when_asked() {
    use tollgate::cli::Color;
    let yaml = config("routes:\n  - name: r\n    respond: { status: 200 }\n");
    for (flag, coloured) in [("always", true), ("never", false), ("auto", false)] {
        let proxy = BinaryProxy::start_with(&yaml, &["--color", flag], &[]);
        assert!(proxy.wait_for_log("listening", Duration::from_secs(10)));
        let line = proxy
            .logs()
            .into_iter()
            .find(|l| l.contains("listening"))
            .unwrap();
        assert_eq!(line.contains('\x1b'), coloured, "--color {flag}: {line:?}");
    }
    let no_color = Some(std::ffi::OsStr::new("1"));
    assert!(Color::Auto.ansi(true, None));
    assert!(Color::Auto.ansi(true, Some(std::ffi::OsStr::new(""))));
    assert!(!Color::Auto.ansi(true, no_color));
    assert!(!Color::Auto.ansi(false, None));
    assert!(Color::Always.ansi(false, no_color));
    assert!(!Color::Never.ansi(true, None));
}

#[test]
fn check_and_health_list_and_accept_only_their_own_flags() {
    for command in ["check", "health"] {
        let out = run_cli(&[command, "--help"]);
        assert!(out.status.success());
        let help = stdout(&out);
        assert!(help.contains("--config"), "{command}: {help}");
        for run_only in ["--log-level", "--log-format", "--access-log"] {
            assert!(
                !help.contains(run_only),
                "{command} lists {run_only}:\n{help}"
            );
        }
    }
    let out = run_cli(&[
        "check",
        "--log-level",
        "info",
        "--config",
        "config/tollgate.yaml",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let out = run_cli(&["run", "--help"]);
    assert!(stdout(&out).contains("--log-level"), "{}", stdout(&out));
}

#[test]
fn check_warns_of_an_admin_listener_off_loopback_and_still_passes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("open-admin.yaml");
    std::fs::write(
        &path,
        "listeners: [{ address: 127.0.0.1:0 }]\nadmin: { address: 0.0.0.0:9901 }\nroutes:\n  - name: all\n    respond: { status: 200 }\n",
    )
    .unwrap();
    let out = common::proxy::run_cli(&["check", "--config", path.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "a warning, not an error: {}",
        stderr(&out)
    );
    assert!(
        stderr(&out).starts_with("warning: admin.address 0.0.0.0:9901 is not a loopback address"),
        "{}",
        stderr(&out)
    );
}

/// `tollgate health` asks the admin listener the config names (or a URL) and exits 0 only on
/// a 200; a closed port or another status fails with the address and the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_asks_the_admin_listener() {
    let yaml = config(
        "admin:\n  address: 127.0.0.1:0\nroutes:\n  - name: r\n    respond: { status: 200 }\n",
    );
    let proxy = BinaryProxy::start(&yaml);
    let config = proxy.config_path().to_str().unwrap().to_owned();
    let admin = proxy.admin_addr();
    let healthz = format!("http://{admin}/healthz");
    let missing = format!("http://{admin}/no-such-page");
    let (by_url, by_config, not_found) = tokio::task::block_in_place(|| {
        (
            run_cli(&["health", "--url", &healthz]),
            // The config's admin address is port 0: only a URL reaches this one.
            run_cli(&["health", "--config", &config]),
            run_cli(&["health", "--url", &missing]),
        )
    });
    assert!(by_url.status.success(), "{}", stderr(&by_url));
    assert!(!by_config.status.success());
    assert!(
        stderr(&by_config).starts_with("unhealthy: 127.0.0.1:0"),
        "{}",
        stderr(&by_config)
    );
    assert!(!not_found.status.success());
    assert!(
        stderr(&not_found).contains("HTTP 404"),
        "{}",
        stderr(&not_found)
    );
}

/// The running proxy keeps its memory out of transparent huge pages (its RSS would otherwise
/// count mimalloc's 2 MiB pages): the kernel reports the process flag where it knows it.
#[tokio::test]
async fn the_running_binary_turns_transparent_huge_pages_off() {
    let up = MockUpstream::start();
    let proxy = BinaryProxy::start(&config(&format!(
        "{}routes:\n  - name: r\n    upstream: app\n",
        upstream_app(up.addr(), "5s")
    )));
    let status = std::fs::read_to_string(format!("/proc/{}/status", proxy.pid()))
        .expect("the proxy's /proc status");
    // Kernels before 6.x do not list the flag: nothing to check there.
    if let Some(line) = status.lines().find(|l| l.starts_with("THP_enabled:")) {
        assert_eq!(line.split_whitespace().nth(1), Some("0"), "{line}");
    }
}
