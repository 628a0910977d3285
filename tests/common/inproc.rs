//! `TestProxy`: tollgate served inside the test process (`app::start`) on `127.0.0.1:0`, with a
//! config written to a temporary file (so reload tests rewrite it as an operator would).
//!
//! `start` serves it from a thread of its own, with real time and its own worker threads;
//! `inline` serves it on the test's own runtime, so a test that pauses tokio's clock moves the
//! proxy's clock (bucket refills, timeouts) with it.

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tollgate::app::{self, Options, Running};
use tollgate::reload::Reloader;

/// A proxy serving in this process. Stopped (without waiting for the drain) on drop.
pub struct TestProxy {
    addrs: Vec<SocketAddr>,
    admin: Option<SocketAddr>,
    rls: Option<SocketAddr>,
    generation: watch::Receiver<u64>,
    reloader: Reloader,
    config: tempfile::TempPath,
    stop: Option<oneshot::Sender<()>>,
    /// Resolves once the proxy has stopped and drained.
    stopped: Option<oneshot::Receiver<()>>,
}

fn write_config(yaml: &str) -> tempfile::TempPath {
    let mut file = tempfile::Builder::new()
        .prefix("tollgate-test-")
        .suffix(".yaml")
        .tempfile()
        .expect("create a temporary config file");
    file.write_all(yaml.as_bytes()).expect("write the config");
    file.into_temp_path()
}

impl TestProxy {
    /// Serve `yaml` with two worker threads, from a thread of its own; return once every
    /// listener is bound. Panics with the config error if it does not start.
    pub fn start(yaml: &str) -> Self {
        Self::start_with_workers(yaml, 2)
    }

    /// `start` with `workers` worker threads.
    pub fn start_with_workers(yaml: &str, workers: usize) -> Self {
        let config = write_config(yaml);
        let path = config.to_path_buf();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (stopped_tx, stopped_rx) = oneshot::channel();
        let yaml = yaml.to_owned();
        std::thread::spawn(move || {
            let control = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("a control runtime");
            control.block_on(async move {
                let options = Options {
                    workers: Some(workers),
                    ..Options::default()
                };
                let shutdown = async {
                    let _ = stop_rx.await;
                };
                match app::start(&path, options, shutdown).await {
                    Ok(running) => {
                        let info = Started::of(&running);
                        let _ = started_tx.send(Ok(info));
                        running.stopped().await;
                        let _ = stopped_tx.send(());
                    }
                    Err(e) => {
                        let _ = started_tx.send(Err(format!("{e}\nconfig:\n{yaml}")));
                    }
                }
            });
        });
        let started = started_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the proxy starts within 10 s")
            .unwrap_or_else(|e| panic!("the proxy did not start: {e}"));
        Self::from_started(started, config, stop_tx, stopped_rx)
    }

    /// Serve `yaml` on the calling runtime (one worker, no thread of its own).
    pub async fn inline(yaml: &str) -> Self {
        let config = write_config(yaml);
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let options = Options {
            inline: true,
            ..Options::default()
        };
        let shutdown = async {
            let _ = stop_rx.await;
        };
        let running = app::start(&config, options, shutdown)
            .await
            .unwrap_or_else(|e| panic!("the proxy did not start: {e}\nconfig:\n{yaml}"));
        let started = Started::of(&running);
        let (stopped_tx, stopped_rx) = oneshot::channel();
        tokio::spawn(async move {
            running.stopped().await;
            let _ = stopped_tx.send(());
        });
        Self::from_started(started, config, stop_tx, stopped_rx)
    }

    fn from_started(
        s: Started,
        config: tempfile::TempPath,
        stop: oneshot::Sender<()>,
        stopped: oneshot::Receiver<()>,
    ) -> Self {
        Self {
            addrs: s.listeners,
            admin: s.admin,
            rls: s.rls,
            generation: s.generation,
            reloader: s.reloader,
            config,
            stop: Some(stop),
            stopped: Some(stopped),
        }
    }

    /// The rate limit service's address (`rls:`).
    pub fn rls_addr(&self) -> SocketAddr {
        self.rls.expect("the config has `rls:`")
    }

    /// The first listener's address.
    pub fn addr(&self) -> SocketAddr {
        self.addrs[0]
    }

    /// Every listener's bound address, in config order.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// `http://127.0.0.1:PORT{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr())
    }

    /// The admin listener's bound address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.expect("the config has an admin listener")
    }

    /// The admin listener's `/metrics`, as text.
    pub async fn scrape(&self) -> String {
        super::Http::new()
            .get(&format!("http://{}/metrics", self.admin_addr()))
            .await
            .text()
            .to_owned()
    }

    /// The config file the proxy runs with (for reload tests: rewrite it in place).
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// The live config's generation (1 as started).
    pub fn generation(&self) -> u64 {
        *self.generation.borrow()
    }

    /// Wait until the live config's generation is at least `n`; false after `timeout`.
    pub async fn wait_for_generation(&self, n: u64, timeout: Duration) -> bool {
        let mut generation = self.generation.clone();
        tokio::time::timeout(timeout, generation.wait_for(|g| *g >= n))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Reload now, as SIGHUP does (even if the file did not change).
    pub fn reload(&self) {
        self.reloader.reload();
    }

    /// Shut down gracefully (as SIGTERM does) and wait until the drain is over.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(stopped) = self.stopped.take() {
            let _ = stopped.await;
        }
    }
}

impl Drop for TestProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// What a started proxy reports.
struct Started {
    listeners: Vec<SocketAddr>,
    admin: Option<SocketAddr>,
    rls: Option<SocketAddr>,
    generation: watch::Receiver<u64>,
    reloader: Reloader,
}

impl Started {
    fn of(running: &Running) -> Self {
        Self {
            listeners: running.listeners.clone(),
            admin: running.admin,
            rls: running.rls,
            generation: running.generation.clone(),
            reloader: running.reloader.clone(),
        }
    }
}
