//! Real `redis-server` processes for tests: one server (`RedisServer`) or a three-master
//! cluster (`RedisCluster`), each on free loopback ports in a temporary directory, never 6379.
//!
//! `redis-server --port 0` would disable TCP altogether, so a free port is found by binding
//! 127.0.0.1:0 and letting it go; if another process grabs it first, the server fails to bind
//! and is started again on another port.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// How long a server may take to answer PING after it is started.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// One redis-server, killed on drop.
pub struct RedisServer {
    port: u16,
    dir: TempDir,
    extra: Vec<String>,
    /// The file libfaketime reads this server's wall-clock offset from, when it runs under it.
    clock: Option<std::path::PathBuf>,
    child: Option<Child>,
}

/// Where Debian's `libfaketime` package puts the library (`apt-get install faketime`).
const LIBFAKETIME: [&str; 3] = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
];

impl RedisServer {
    /// A plain server: no persistence, loopback only.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// A server with extra `redis-server` arguments.
    pub fn start_with(extra: &[&str]) -> Self {
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        for _ in 0..5 {
            let mut server = Self {
                port: free_port(),
                dir: tempfile::tempdir().expect("temp dir"),
                extra: extra.clone(),
                clock: None,
                child: None,
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("could not start redis-server on a free port");
    }

    /// Start a server on `port`, which nothing should be listening on.
    pub fn start_on(port: u16) -> Self {
        Self::start_on_with(port, &[])
    }

    /// Start a server with extra arguments on `port`, which nothing should be listening on.
    pub fn start_on_with(port: u16, extra: &[&str]) -> Self {
        let mut server = Self {
            port,
            dir: tempfile::tempdir().expect("temp dir"),
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            clock: None,
            child: None,
        };
        assert!(server.spawn(), "redis-server did not start on port {port}");
        server
    }

    /// A plain server whose wall clock can be stepped (`set_clock_offset`): the real
    /// redis-server under libfaketime, which reads the offset from a file on every clock read,
    /// so `TIME`, the bucket script's `now` and key expiry all move with it. Its monotonic
    /// clock (event loop, timeouts) is left alone, as an NTP step leaves it.
    pub fn start_with_fake_clock() -> Self {
        libfaketime();
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("temp dir");
            let clock = dir.path().join("clock-offset");
            std::fs::write(&clock, "+0").expect("write the clock offset");
            let mut server = Self {
                port: free_port(),
                dir,
                extra: Vec::new(),
                clock: Some(clock),
                child: None,
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("could not start redis-server under libfaketime on a free port");
    }

    /// Step this server's wall clock to `seconds` away from the real one (negative: behind).
    /// Takes effect on its next clock read.
    pub fn set_clock_offset(&self, seconds: i64) {
        let file = self
            .clock
            .as_ref()
            .expect("a server from start_with_fake_clock");
        std::fs::write(file, format!("{seconds:+}")).expect("write the clock offset");
    }

    /// Spawn and wait for PING; false if the process died (the port was taken).
    fn spawn(&mut self) -> bool {
        let mut command = Command::new("redis-server");
        if let Some(clock) = &self.clock {
            let lib = libfaketime();
            // libfaketime's set-up allocates, and jemalloc (which Debian's redis-server links)
            // reads the clock while it sets itself up: each waits on the other and the server
            // hangs before main. glibc's malloc, preloaded after libfaketime, takes the
            // allocations instead and breaks the cycle.
            command
                .env("LD_PRELOAD", format!("{lib}:libc.so.6"))
                .env("FAKETIME_TIMESTAMP_FILE", clock)
                .env("FAKETIME_NO_CACHE", "1")
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        let child = command
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.dir.path().join("redis.log"))
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed");
        self.child = Some(child);
        let started = Instant::now();
        while started.elapsed() < START_TIMEOUT {
            if ping(self.port) {
                return true;
            }
            if let Some(child) = self.child.as_mut() {
                if child.try_wait().ok().flatten().is_some() {
                    self.child = None;
                    return false;
                }
            }
            sleep(Duration::from_millis(10));
        }
        false
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// SIGKILL, as a crash would: connections are reset, nothing is saved.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start again on the same port, empty (nothing is persisted).
    pub fn restart(&mut self) {
        self.kill();
        assert!(
            self.spawn(),
            "redis-server did not restart on {}",
            self.port
        );
    }

    /// SIGSTOP: the server keeps its connections but answers nothing, like a stalled host.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after `pause`.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("server running").id();
        let ok = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {pid}");
    }

    /// Run `redis-cli -p PORT args...` and return its stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli is installed");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Bucket-script calls this server ran: `EVALSHA` and `EVAL`.
    pub fn script_calls(&self) -> u64 {
        self.command_calls("evalsha") + self.command_calls("eval")
    }

    /// Every key on this server.
    pub fn keys(&self) -> Vec<String> {
        self.cli(&["--scan"])
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// `calls` of one command in `INFO commandstats` (`evalsha`, `eval`, `script|load`...).
    pub fn command_calls(&self, command: &str) -> u64 {
        calls_in(&self.cli(&["info", "commandstats"]), command)
    }
}

/// `calls` of `command` in the text of `INFO commandstats`.
fn calls_in(info: &str, command: &str) -> u64 {
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if self.child.is_some() {
            // A paused server would not die of SIGTERM; SIGKILL needs no cooperation.
            self.kill();
        }
    }
}

/// Three masters, no replicas, slots spread by `redis-cli --cluster create`.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> Self {
        let nodes = (0..3)
            .map(|_| RedisServer::start_with(&Self::ARGS))
            .collect();
        Self::create(nodes)
    }

    /// A cluster on these three ports (from `free_cluster_port`), which nothing should be
    /// listening on.
    pub fn start_on(ports: [u16; 3]) -> Self {
        let nodes = ports
            .iter()
            .map(|&p| RedisServer::start_on_with(p, &Self::ARGS))
            .collect();
        Self::create(nodes)
    }

    const ARGS: [&'static str; 4] = ["--cluster-enabled", "yes", "--cluster-node-timeout", "5000"];

    fn create(nodes: Vec<RedisServer>) -> Self {
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli is installed");
        assert!(
            out.status.success(),
            "cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Self { nodes };
        cluster.wait_ok();
        cluster
    }

    fn wait_ok(&self) {
        let started = Instant::now();
        while started.elapsed() < START_TIMEOUT {
            if self
                .nodes
                .iter()
                .all(|n| n.cli(&["cluster", "info"]).contains("cluster_state:ok"))
            {
                return;
            }
            sleep(Duration::from_millis(50));
        }
        panic!("cluster_state never became ok");
    }

    /// Bucket-script calls all nodes ran together.
    pub fn script_calls(&self) -> u64 {
        self.nodes.iter().map(RedisServer::script_calls).sum()
    }

    /// Seed URLs of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The slot ranges (first, last) node `n` serves, from its own `CLUSTER NODES` line.
    pub fn slot_ranges(&self, n: usize) -> Vec<(u16, u16)> {
        let nodes = self.nodes[n].cli(&["cluster", "nodes"]);
        let me = nodes
            .lines()
            .find(|l| l.contains("myself"))
            .expect("CLUSTER NODES has a `myself` line");
        // <id> <address> <flags> <master> <ping> <pong> <epoch> <link> <slot or range>...
        me.split_whitespace()
            .skip(8)
            .filter(|s| !s.starts_with('['))
            .map(|s| {
                let (a, b) = s.split_once('-').unwrap_or((s, s));
                (a.parse().expect("a slot"), b.parse().expect("a slot"))
            })
            .collect()
    }

    /// The slot Redis computes for `key`.
    pub fn keyslot(&self, key: &str) -> u16 {
        self.nodes[0]
            .cli(&["cluster", "keyslot", key])
            .trim()
            .parse()
            .expect("CLUSTER KEYSLOT answers a number")
    }
}

/// The libfaketime library; panics with what to install when it is missing.
fn libfaketime() -> &'static str {
    LIBFAKETIME
        .iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("libfaketime is installed (apt-get install faketime; scripts/test.sh does)")
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// A free port a cluster node can take: Redis Cluster talks on the port 10,000 above, so it
/// refuses ports over 55,535, which `free_port` gives about one time in five.
pub fn free_cluster_port() -> u16 {
    loop {
        let port = free_port();
        if port <= 55_535 {
            return port;
        }
    }
}

fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 64];
    // A server with `requirepass` answers, if only to ask for the password.
    s.write_all(b"PING\r\n").is_ok()
        && s.read(&mut buf)
            .is_ok_and(|n| buf[..n].starts_with(b"+PONG") || buf[..n].starts_with(b"-NOAUTH"))
}

/// A limit with the given numbers, for tests that drive `RedisLimiter` directly (no config).
pub fn limit(name: &str, per_sec: f64, burst: u32, cost: u32) -> tollgate::limiter::Limit {
    let key = tollgate::identity::KeySpec(Vec::new());
    tollgate::limiter::test_util::limit(name, (per_sec, burst), cost, key)
}

/// The key prefix of the limiter tests.
pub const PREFIX: &str = "tg-test:";

/// Check one bucket of `lim` for `client`.
pub async fn one(
    l: &tollgate::limiter::redis::RedisLimiter,
    lim: &tollgate::limiter::Limit,
    client: u128,
) -> Result<tollgate::limiter::Verdict, tollgate::limiter::redis::Unavailable> {
    let checks = [tollgate::limiter::Check {
        limit: lim,
        client: tollgate::identity::ClientId(client),
    }];
    Ok(l.check(&checks, &[true]).await?[0])
}

/// A master named `mymaster`, one replica of it, and one Sentinel watching them (quorum 1,
/// down after 1 s), each a redis-server on free loopback ports. `password` is the servers'
/// `requirepass` (and `masterauth`, and the Sentinel's `auth-pass`); `sentinel_password` the
/// Sentinel's own.
pub struct SentinelSet {
    /// `servers[0]` starts as the master, `servers[1]` as its replica.
    pub servers: Vec<RedisServer>,
    /// Each server's TLS port, under TLS.
    tls_ports: Vec<u16>,
    pub sentinel_port: u16,
    /// The Sentinel's TLS port, under TLS.
    pub sentinel_tls_port: u16,
    password: Option<String>,
    sentinel_password: Option<String>,
    sentinel_dir: TempDir,
    sentinel: Option<Child>,
}

/// The master's name in the Sentinel's configuration.
pub const MASTER: &str = "mymaster";

impl SentinelSet {
    pub fn start(password: Option<&str>, sentinel_password: Option<&str>) -> Self {
        Self::start_with(password, sentinel_password, None)
    }

    /// `start`, and with `tls` (a directory of `make_certs` files) every server and the
    /// Sentinel also serve TLS, requiring client certificates, replicate over it, and are
    /// known to the Sentinel by their TLS ports (`tls_port`, `sentinel_tls_port`).
    pub fn start_with(
        password: Option<&str>,
        sentinel_password: Option<&str>,
        tls: Option<&std::path::Path>,
    ) -> Self {
        let tls_ports = [free_port(), free_port()];
        // What each server is started with: auth, and TLS with its announced port.
        let server_args = |i: usize| -> Vec<String> {
            let mut args = Vec::new();
            if let Some(pw) = password {
                args.extend(["--requirepass", pw, "--masterauth", pw].map(str::to_owned));
            }
            if let Some(dir) = tls {
                args.extend(tls_args(dir, tls_ports[i], true));
                args.extend(
                    ["--tls-replication", "yes", "--replica-announce-port"].map(str::to_owned),
                );
                args.push(tls_ports[i].to_string());
            }
            args
        };
        let start = |args: &[String]| {
            RedisServer::start_with(&args.iter().map(String::as_str).collect::<Vec<_>>())
        };
        let primary = start(&server_args(0));
        let upstream = if tls.is_some() {
            tls_ports[0]
        } else {
            primary.port()
        };
        let mut replica_args = server_args(1);
        replica_args.extend([
            "--replicaof".into(),
            "127.0.0.1".into(),
            upstream.to_string(),
        ]);
        let replica = start(&replica_args);
        let mut set = Self {
            servers: vec![primary, replica],
            tls_ports: tls.map(|_| tls_ports.to_vec()).unwrap_or_default(),
            sentinel_port: 0,
            sentinel_tls_port: 0,
            password: password.map(str::to_owned),
            sentinel_password: sentinel_password.map(str::to_owned),
            sentinel_dir: tempfile::tempdir().expect("temp dir"),
            sentinel: None,
        };
        set.wait_until("the replica is in sync", |s| {
            s.server_cli(1, &["info", "replication"])
                .contains("master_link_status:up")
        });
        set.start_sentinel(tls);
        set.wait_until("the Sentinel knows the replica", |s| {
            let replicas = s.sentinel_cli(&["sentinel", "replicas", MASTER]);
            replicas.contains(&s.known_port(1).to_string()) && !replicas.contains("s_down")
        });
        set
    }

    /// The port the Sentinel knows server `i` by: its TLS port under TLS.
    pub fn known_port(&self, i: usize) -> u16 {
        self.tls_ports
            .get(i)
            .copied()
            .unwrap_or_else(|| self.servers[i].port())
    }

    fn start_sentinel(&mut self, tls: Option<&std::path::Path>) {
        use std::fmt::Write as _;
        for _ in 0..5 {
            let port = free_port();
            let tls_port = free_port();
            let dir = self.sentinel_dir.path();
            let mut conf = format!(
                "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {}\nlogfile {}\n\
                 sentinel monitor {MASTER} 127.0.0.1 {} 1\n\
                 sentinel down-after-milliseconds {MASTER} 1000\n\
                 sentinel failover-timeout {MASTER} 10000\n",
                dir.display(),
                dir.join("sentinel.log").display(),
                self.known_port(0),
            );
            if let Some(certs) = tls {
                let file = |name: &str| certs.join(name).display().to_string();
                let _ = writeln!(
                    conf,
                    "tls-port {tls_port}\ntls-cert-file {}\ntls-key-file {}\n\
                     tls-ca-cert-file {}\ntls-auth-clients yes\ntls-replication yes",
                    file("srv.crt"),
                    file("srv.key"),
                    file("ca.crt"),
                );
            }
            if let Some(pw) = &self.password {
                let _ = writeln!(conf, "sentinel auth-pass {MASTER} {pw}");
            }
            if let Some(pw) = &self.sentinel_password {
                let _ = writeln!(conf, "requirepass {pw}");
            }
            let file = dir.join("sentinel.conf");
            std::fs::write(&file, conf).expect("write sentinel.conf");
            let child = Command::new("redis-server")
                .arg(&file)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server is installed");
            self.sentinel = Some(child);
            self.sentinel_port = port;
            self.sentinel_tls_port = tls_port;
            let started = Instant::now();
            while started.elapsed() < START_TIMEOUT {
                if self.sentinel_cli(&["ping"]).contains("PONG") {
                    return;
                }
                if let Some(child) = self.sentinel.as_mut() {
                    if child.try_wait().ok().flatten().is_some() {
                        break;
                    }
                }
                sleep(Duration::from_millis(10));
            }
            if let Some(mut child) = self.sentinel.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        panic!("could not start redis-server --sentinel on a free port");
    }

    /// Bucket-script calls (`EVALSHA`) server `i` ran, asked with the servers' password.
    pub fn script_calls(&self, i: usize) -> u64 {
        calls_in(&self.server_cli(i, &["info", "commandstats"]), "evalsha")
    }

    /// Stop the Sentinel (the servers go on).
    pub fn stop_sentinel(&mut self) {
        if let Some(mut child) = self.sentinel.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// `host:port` of the Sentinel, as `limiter.redis.sentinel.nodes` takes it.
    pub fn sentinel_node(&self) -> String {
        format!("127.0.0.1:{}", self.sentinel_port)
    }

    /// `redis-cli` against the Sentinel, with its password if it has one.
    pub fn sentinel_cli(&self, args: &[&str]) -> String {
        cli_with(self.sentinel_port, self.sentinel_password.as_deref(), args)
    }

    /// `redis-cli` against server `i`, with the servers' password if they have one.
    pub fn server_cli(&self, i: usize, args: &[&str]) -> String {
        cli_with(self.servers[i].port(), self.password.as_deref(), args)
    }

    /// The port of the server the Sentinel names as the master now.
    pub fn master_port(&self) -> u16 {
        let out = self.sentinel_cli(&["sentinel", "get-master-addr-by-name", MASTER]);
        out.lines()
            .nth(1)
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or(0)
    }

    /// The index of the server on `port` (plain or TLS).
    pub fn index_of(&self, port: u16) -> usize {
        (0..self.servers.len())
            .find(|&i| self.servers[i].port() == port || self.known_port(i) == port)
            .expect("one of the set's servers")
    }

    /// Wait until server `replica` has everything server `master` wrote.
    pub fn wait_replicated(&self, master: usize, replica: usize) {
        let offset = |i: usize, field: &str| -> Option<u64> {
            self.server_cli(i, &["info", "replication"])
                .lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().parse().ok())
        };
        self.wait_until("the replica caught up", |_| {
            let (Some(written), Some(read)) = (
                offset(master, "master_repl_offset:"),
                offset(replica, "slave_repl_offset:"),
            ) else {
                return false;
            };
            read >= written
        });
    }

    /// Ask the Sentinel for a failover, again while it answers that it cannot start one yet
    /// (`NOGOODSLAVE` until it has seen the replica's link up, on a loaded machine seconds
    /// after start).
    pub fn failover(&self) {
        let mut last = String::new();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(20) {
            last = self.sentinel_cli(&["sentinel", "failover", MASTER]);
            if last.contains("OK") {
                return;
            }
            sleep(Duration::from_millis(100));
        }
        panic!("the Sentinel never started a failover: {last}");
    }

    /// `failover`, then wait until the Sentinel names server `new` and server `old` has
    /// turned replica.
    pub fn fail_over(&self, old: usize, new: usize) {
        self.failover();
        self.wait_until(
            "the Sentinel names the replica and the old master is one",
            |s| {
                s.master_port() == s.known_port(new)
                    && s.server_cli(old, &["role"]).starts_with("slave")
            },
        );
    }

    /// Poll `done` every 20 ms for up to 20 s; panics with `what` if it never holds.
    pub fn wait_until(&self, what: &str, done: impl Fn(&Self) -> bool) {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(20) {
            if done(self) {
                return;
            }
            sleep(Duration::from_millis(20));
        }
        panic!("timed out waiting until {what}");
    }
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        if let Some(mut child) = self.sentinel.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `redis-cli -p PORT [-a PASSWORD] args...`'s stdout.
pub fn cli_with(port: u16, password: Option<&str>, args: &[&str]) -> String {
    let mut command = Command::new("redis-cli");
    command.args(["-p", &port.to_string()]);
    if let Some(pw) = password {
        command.args(["--no-auth-warning", "-a", pw]);
    }
    let out = command.args(args).output().expect("redis-cli is installed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A CA, a certificate for 127.0.0.1 signed by it (`srv.crt`, `srv.key`) and a client
/// certificate signed by it (`client.crt`, `client.key`), made in `dir` by `openssl`.
pub fn make_certs(dir: &std::path::Path) {
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("the openssl command is installed");
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-subj",
        "/CN=tollgate test CA",
    ]);
    std::fs::write(dir.join("srv.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    // Extensions make a v3 certificate: webpki refuses v1 ones, client certificates too.
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    for (name, cn) in [("srv", "127.0.0.1"), ("client", "tollgate")] {
        let (key, csr, crt, ext) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
            format!("{name}.ext"),
        );
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={cn}"),
        ]);
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "1",
            "-extfile",
            &ext,
        ]);
    }
}

/// `redis-server` arguments for TLS on `tls_port` (besides the plain port the helper watches)
/// with the files of `make_certs`; `auth_clients`: whether a client certificate is required.
pub fn tls_args(dir: &std::path::Path, tls_port: u16, auth_clients: bool) -> Vec<String> {
    let file = |name: &str| dir.join(name).to_string_lossy().into_owned();
    [
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &file("srv.crt"),
        "--tls-key-file",
        &file("srv.key"),
        "--tls-ca-cert-file",
        &file("ca.crt"),
        "--tls-auth-clients",
        if auth_clients { "yes" } else { "no" },
    ]
    .map(str::to_owned)
    .to_vec()
}

/// The commands the limiter needs, on its own keys only: the ACL that docs/operations.md
/// gives.
pub const MINIMAL_ACL: &[&str] = &[
    "resetkeys",
    "~tollgate:*",
    "resetchannels",
    "-@all",
    "+evalsha",
    "+script|load",
    "+time",
    "+get",
    "+mget",
    "+set",
    "+del",
    "+ping",
    "+client|setname",
];

/// Send requests with `headers` to `url` until Redis has decided one: the RateLimit header
/// says so (a 200 alone proves nothing under an `open` policy, and a `closed` one answers 503
/// without it while the connection, a cluster's or a TLS handshake, comes up). Panics after
/// 10 s.
pub async fn until_redis_decides(http: &super::Http, url: &str, headers: &[(&str, &str)]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while http
        .get_with(url, headers)
        .await
        .opt_header("ratelimit")
        .is_none()
    {
        assert!(Instant::now() < deadline, "Redis never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
