//! A real OTLP trace receiver for tests: `tests/fixtures/otlp/receiver.py`, built on the
//! official opentelemetry-proto messages, serving OTLP/gRPC and OTLP/HTTP on free loopback
//! ports. Every span it receives is kept as the JSON object it prints.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The receiver process, stopped when dropped (its stdin closes).
pub struct Receiver {
    child: Child,
    pub grpc_port: u16,
    pub http_port: u16,
    spans: Arc<Mutex<Vec<Value>>>,
}

impl Receiver {
    /// A receiver that takes every export (`ok`), refuses them (`fail`) or answers after 30 s
    /// (`slow`).
    pub fn start(mode: &str) -> Self {
        let script = super::proxy::repo_root().join("tests/fixtures/otlp/receiver.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(mode)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 (scripts/test.sh installs opentelemetry-proto and grpcio)");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let ready = lines.next().and_then(Result::ok).unwrap_or_default();
        let ports: Vec<u16> = ready
            .strip_prefix("ready ")
            .unwrap_or_else(|| panic!("the OTLP receiver did not start: {ready:?}"))
            .split(' ')
            .map(|p| p.parse().expect("a port"))
            .collect();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let kept = spans.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&line) {
                    kept.lock().unwrap().push(v);
                }
            }
        });
        Self {
            child,
            grpc_port: ports[0],
            http_port: ports[1],
            spans,
        }
    }

    /// The OTLP/HTTP base URL.
    pub fn http_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }

    /// The OTLP/gRPC URL.
    pub fn grpc_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.grpc_port)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Value> {
        self.spans.lock().unwrap().clone()
    }

    /// Every span received, once `done` holds of them or `timeout` passed.
    pub fn wait(&self, timeout: Duration, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if done(&spans) || Instant::now() > deadline {
                return spans;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The spans of `trace_id`, once `n` of them came (within `timeout`).
    pub fn trace(&self, trace_id: &str, n: usize, timeout: Duration) -> Vec<Value> {
        let of_trace = |spans: &[Value]| -> Vec<Value> {
            spans
                .iter()
                .filter(|s| s["trace_id"] == trace_id)
                .cloned()
                .collect()
        };
        of_trace(&self.wait(timeout, |spans| of_trace(spans).len() >= n))
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
