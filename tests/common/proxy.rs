//! `BinaryProxy`: the real `tollgate` binary, started on `127.0.0.1:0` with a config written to
//! a temporary file, its stderr captured so tests can wait on and assert its log lines. For the
//! tests of what only a process has: its logs, signals, exit and memory.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

/// How long the binary may take to bind its listeners.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// The stderr lines of a child, shared with the thread that reads them.
#[derive(Default)]
struct Log {
    lines: Mutex<LogState>,
    changed: Condvar,
}

#[derive(Default)]
struct LogState {
    lines: Vec<String>,
    closed: bool,
}

impl Log {
    /// Block until `pred` holds for the lines so far, stderr closes, or `timeout` passes.
    fn wait_until(&self, timeout: Duration, mut pred: impl FnMut(&[String]) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut state = self.lines.lock().unwrap();
        loop {
            if pred(&state.lines) {
                return true;
            }
            let now = Instant::now();
            if state.closed || now >= deadline {
                return false;
            }
            state = self.changed.wait_timeout(state, deadline - now).unwrap().0;
        }
    }

    fn snapshot(&self) -> Vec<String> {
        self.lines.lock().unwrap().lines.clone()
    }
}

/// A running `tollgate run` process. Killed on drop.
pub struct BinaryProxy {
    child: Child,
    addrs: Vec<SocketAddr>,
    admin: Option<SocketAddr>,
    log: Arc<Log>,
    /// Holds the address file (`--address-file`) the binary writes once it serves.
    _run_dir: tempfile::TempDir,
    config: ConfigFile,
}

/// The config the binary runs on: a temporary file of the harness's, or a path of the test's.
enum ConfigFile {
    Temp(tempfile::TempPath),
    At(std::path::PathBuf),
}

impl BinaryProxy {
    /// Write `yaml` to a temporary file and run the binary on it; return once the first listener
    /// is bound. Panics, with everything the binary wrote, if it does not get that far.
    pub fn start(yaml: &str) -> Self {
        Self::start_with_env(yaml, &[])
    }

    /// `start`, with extra environment variables for the binary (such as `TOLLGATE_WORKERS`).
    pub fn start_with_env(yaml: &str, env: &[(&str, &str)]) -> Self {
        Self::start_with(yaml, &[], env)
    }

    /// `start`, with extra arguments after `run` (such as `--log-format json`) and environment
    /// variables.
    pub fn start_with(yaml: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut file = tempfile::Builder::new()
            .prefix("tollgate-test-")
            .suffix(".yaml")
            .tempfile()
            .expect("create a temporary config file");
        file.write_all(yaml.as_bytes()).expect("write the config");
        Self::spawn(ConfigFile::Temp(file.into_temp_path()), yaml, args, env)
    }

    /// `start` on a config file of the test's own (a directory it edits for reload tests),
    /// left in place when the proxy stops.
    pub fn start_at(config: &Path) -> Self {
        let yaml = std::fs::read_to_string(config).unwrap_or_default();
        Self::spawn(ConfigFile::At(config.to_path_buf()), &yaml, &[], &[])
    }

    fn spawn(config: ConfigFile, yaml: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        let run_dir = tempfile::tempdir().expect("a temporary directory");
        let address_file = run_dir.path().join("addresses");
        let mut child = Command::new(BIN)
            .args(["run", "--config"])
            .arg(config.path())
            .args(["--log-level", "info", "--address-file"])
            .arg(&address_file)
            .args(args)
            .env_remove("TOLLGATE_CONFIG")
            .env_remove("TOLLGATE_LOG")
            .env_remove("TOLLGATE_LOG_FORMAT")
            .env_remove("TOLLGATE_ACCESS_LOG")
            .env_remove("TOLLGATE_ACCESS_LOG_FORMAT")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the tollgate binary");
        let log = Arc::new(Log::default());
        let stderr = child.stderr.take().expect("piped stderr");
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                sink.lines.lock().unwrap().lines.push(line);
                sink.changed.notify_all();
            }
            sink.lines.lock().unwrap().closed = true;
            sink.changed.notify_all();
        });
        let mut proxy = Self {
            child,
            addrs: Vec::new(),
            admin: None,
            log,
            config,
            _run_dir: run_dir,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        match ready(&address_file, &proxy.log, deadline) {
            Some((addrs, admin)) => (proxy.addrs, proxy.admin) = (addrs, admin),
            None => {
                let _ = proxy.child.kill();
                panic!(
                    "tollgate was not serving within {START_TIMEOUT:?} (no address file, or \
                     its admin /healthz did not answer); its stderr:\n{}\nconfig:\n{yaml}",
                    proxy.log.snapshot().join("\n")
                );
            }
        }
        proxy
    }

    /// The first listener's address.
    pub fn addr(&self) -> SocketAddr {
        self.addrs[0]
    }

    /// Every listener address reported when the proxy became ready.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// `http://127.0.0.1:PORT{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The config file the proxy runs with (for reload tests: rewrite it in place).
    pub fn config_path(&self) -> &Path {
        self.config.path()
    }

    /// Every stderr line so far.
    pub fn logs(&self) -> Vec<String> {
        self.log.snapshot()
    }

    /// The admin listener's address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.expect("the config has an admin listener")
    }

    /// Wait until a stderr line contains `needle`. False on timeout or if the process exited.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> bool {
        self.log
            .wait_until(timeout, |lines| lines.iter().any(|l| l.contains(needle)))
    }

    /// Send SIGTERM (graceful shutdown).
    pub fn terminate(&self) {
        self.signal("TERM");
    }

    /// Send a signal by name (`TERM`, `HUP`, `INT`).
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} {} failed", self.pid());
    }

    /// Wait for the process to exit; `None` if it is still running after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The process's peak resident memory (VmHWM) in KiB, from `/proc`.
    pub fn peak_rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("read /proc/PID/status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM in /proc/PID/status")
    }
}

impl Drop for BinaryProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Wait until the binary serves: its address file written (once every listener is bound and
/// served), and, with an admin listener, `/healthz` answering 200. The listeners' addresses and
/// the admin's; `None` if the process exited or `deadline` passed first.
fn ready(
    file: &Path,
    log: &Log,
    deadline: Instant,
) -> Option<(Vec<SocketAddr>, Option<SocketAddr>)> {
    let text = loop {
        if let Ok(text) = std::fs::read_to_string(file) {
            break text;
        }
        if log.lines.lock().unwrap().closed || Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let addrs_of = |kind: &str| -> Vec<SocketAddr> {
        (text.lines())
            .filter_map(|l| l.strip_prefix(kind)?.trim().parse().ok())
            .collect()
    };
    let admin = addrs_of("admin ").into_iter().next();
    if let Some(admin) = admin {
        while !healthy(admin) {
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    Some((addrs_of("listener "), admin))
}

/// `GET /healthz` on the admin listener answers 200.
fn healthy(admin: SocketAddr) -> bool {
    use std::io::Read;
    let Ok(mut conn) = std::net::TcpStream::connect_timeout(&admin, Duration::from_secs(1)) else {
        return false;
    };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
    let asked =
        conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n");
    let mut head = [0u8; 12];
    asked.is_ok() && conn.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.1 200")
}

/// The repository root, where `tollgate check` is run so paths in its messages are relative.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Run the binary with `args` in the repository root, with no config from the environment.
pub fn run_cli(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(repo_root())
        .env_remove("TOLLGATE_CONFIG")
        .env_remove("TOLLGATE_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("run the tollgate binary")
}

/// `tollgate check --config PATH` (PATH relative to the repository root).
pub fn check(path: &str) -> Output {
    run_cli(&["check", "--config", path])
}

impl ConfigFile {
    fn path(&self) -> &Path {
        match self {
            Self::Temp(t) => t,
            Self::At(p) => p,
        }
    }
}
