//! The standard `process_*` metrics (as every Prometheus client library exports them), read off
//! `/proc/self` at scrape time through the `procfs` crate.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// Reads this process's CPU time, memory, file descriptors and start time on each scrape.
#[derive(Debug, Default)]
pub(super) struct Process;

/// One reading of `/proc/self`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Reading {
    cpu_seconds: f64,
    resident_bytes: u64,
    virtual_bytes: u64,
    open_fds: u64,
    max_fds: Option<u64>,
    start_time_seconds: f64,
}

#[cfg(target_os = "linux")]
fn read() -> Option<Reading> {
    use procfs::process::LimitValue;
    let me = procfs::process::Process::myself().ok()?;
    let stat = me.stat().ok()?;
    let ticks = procfs::ticks_per_second() as f64;
    let boot = procfs::boot_time_secs().ok()? as f64;
    let max_fds = me
        .limits()
        .ok()
        .and_then(|l| match l.max_open_files.soft_limit {
            LimitValue::Value(n) => Some(n),
            LimitValue::Unlimited => None,
        });
    Some(Reading {
        cpu_seconds: (stat.utime + stat.stime) as f64 / ticks,
        resident_bytes: stat.rss * procfs::page_size(),
        virtual_bytes: stat.vsize,
        open_fds: me.fd_count().ok()? as u64,
        max_fds,
        start_time_seconds: boot + stat.starttime as f64 / ticks,
    })
}

#[cfg(not(target_os = "linux"))]
fn read() -> Option<Reading> {
    None
}

impl Collector for Process {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(r) = read() else {
            return Ok(());
        };
        let counter = ConstCounter::new(r.cpu_seconds);
        counter.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            None,
            counter.metric_type(),
        )?)?;
        let gauges: [(&str, &str, Option<f64>); 5] = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                Some(r.resident_bytes as f64),
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes.",
                Some(r.virtual_bytes as f64),
            ),
            (
                "process_open_fds",
                "Number of open file descriptors.",
                Some(r.open_fds as f64),
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors.",
                r.max_fds.map(|n| n as f64),
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                Some(r.start_time_seconds),
            ),
        ];
        for (name, help, value) in gauges {
            let Some(value) = value else { continue };
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    #[test]
    fn reads_this_process() {
        let r = super::read().expect("/proc/self is readable");
        assert!(r.resident_bytes > 0 && r.virtual_bytes >= r.resident_bytes);
        assert!(
            r.open_fds >= 3,
            "stdin, stdout, stderr at least: {}",
            r.open_fds
        );
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        // Started within the last hour (the test binary), and not in the future.
        assert!(r.start_time_seconds <= now + 1.0 && r.start_time_seconds > now - 3600.0);
    }
}
