//! The per-thread line buffers and the writer thread they are handed to.
// The writer is a thread of its own, outside tokio: it keeps time by std's clock.
#![allow(clippy::disallowed_types)]

use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{LazyLock, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::counter::Counter;

use super::format::{self, At, Clock};
use super::{Destination, Entry, Format};

/// A thread's buffer is handed over once it holds this much...
const FLUSH_AT: usize = 60 << 10;
/// ...in a buffer this large, so the line that crosses it rarely grows it.
const CAPACITY: usize = 64 << 10;
/// ...or once its oldest line is this old.
const MAX_AGE_US: u64 = 1_000_000;
/// Buffers waiting for the writer; past them, lines are dropped and counted.
const QUEUE: usize = 64;

/// The installed access log.
struct Shared {
    format: Format,
    to_writer: SyncSender<Message>,
}

enum Message {
    Lines(Vec<u8>),
    Reopen,
    /// Everything sent before is written: tell the sender.
    Sync(mpsc::Sender<()>),
}

static LOG: OnceLock<Shared> = OnceLock::new();

static DROPPED: LazyLock<Counter> = LazyLock::new(Counter::default);

/// `tollgate_access_log_dropped_lines_total`: lines dropped because the writer was behind.
pub fn dropped_lines() -> Counter {
    DROPPED.clone()
}

/// An access log is installed: requests build their `Entry`.
pub fn enabled() -> bool {
    LOG.get().is_some()
}

/// An access log of JSON lines is installed: requests fill in `Entry::keys`.
pub fn json() -> bool {
    LOG.get().is_some_and(|log| log.format == Format::Json)
}

pub(super) fn install(destination: &Destination, format: Format) -> std::io::Result<()> {
    let output = match destination {
        Destination::Off => return Ok(()),
        Destination::Stderr => Output::Stderr,
        Destination::Stdout => Output::Stdout,
        Destination::File(path) => Output::open(path.clone())?,
    };
    let (to_writer, from_workers) = mpsc::sync_channel(QUEUE);
    std::thread::Builder::new()
        .name("tollgate-access-log".to_owned())
        .spawn(move || run(output, &from_workers))?;
    if LOG.set(Shared { format, to_writer }).is_err() {
        return Err(std::io::Error::other("the access log is already installed"));
    }
    Ok(())
}

// === the worker side ===

/// One thread's lines not yet handed to the writer.
struct Local {
    buf: Vec<u8>,
    lines: u64,
    /// When the oldest line in `buf` was written (µs since the epoch).
    oldest_us: u64,
    clock: Clock,
    /// The wall-clock time (µs since the epoch) at an instant, read again once a second: a
    /// line then reads one clock, the monotonic one its duration needs anyway.
    wall: Option<(std::time::Instant, u64)>,
}

impl Local {
    /// When a line of a request `started` is written, now.
    fn at(&mut self, started: std::time::Instant) -> At {
        let now = std::time::Instant::now();
        let (base, base_us) = match self.wall {
            Some((base, us)) if now.saturating_duration_since(base) < Duration::from_secs(1) => {
                (base, us)
            }
            _ => {
                let us = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
                self.wall = Some((now, us));
                (now, us)
            }
        };
        let since = now.saturating_duration_since(base).as_micros() as u64;
        At {
            unix_us: base_us + since,
            took: now.saturating_duration_since(started),
        }
    }
}

impl Local {
    /// Hand the buffer to the writer. `wait`: wait for room in its queue instead of dropping.
    fn flush(&mut self, wait: bool) {
        let Some(log) = LOG.get() else { return };
        if self.buf.is_empty() {
            return;
        }
        let full = std::mem::replace(&mut self.buf, Vec::with_capacity(CAPACITY));
        let lines = std::mem::take(&mut self.lines);
        let sent = if wait {
            log.to_writer
                .send(Message::Lines(full))
                .map_err(|mpsc::SendError(m)| m)
        } else {
            log.to_writer
                .try_send(Message::Lines(full))
                .map_err(|e| match e {
                    TrySendError::Full(m) | TrySendError::Disconnected(m) => m,
                })
        };
        if let Err(Message::Lines(mut back)) = sent {
            DROPPED.inc_by(lines);
            // The buffer is kept: dropping lines costs no allocation either.
            back.clear();
            self.buf = back;
        }
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        self.flush(true);
    }
}

thread_local! {
    static LOCAL: RefCell<Local> = RefCell::new(Local {
        buf: Vec::new(),
        lines: 0,
        oldest_us: 0,
        clock: Clock::default(),
        wall: None,
    });
}

/// Format `entry`'s line into this thread's buffer, `bytes_out` sent.
pub(super) fn write(entry: &Entry, bytes_out: u64) {
    let Some(log) = LOG.get() else { return };
    // A thread being torn down has no buffer left: the line is lost, as at an abort.
    let _ = LOCAL.try_with(|local| {
        let Ok(mut local) = local.try_borrow_mut() else {
            return;
        };
        let local = &mut *local;
        if local.buf.capacity() == 0 {
            local.buf.reserve(CAPACITY);
        }
        let at = local.at(entry.started.into_std());
        let now_us = at.unix_us;
        if local.lines == 0 {
            local.oldest_us = now_us;
        }
        format::line(
            &mut local.buf,
            &mut local.clock,
            log.format,
            entry,
            bytes_out,
            at,
        );
        local.lines += 1;
        if local.buf.len() >= FLUSH_AT || now_us.saturating_sub(local.oldest_us) >= MAX_AGE_US {
            local.flush(false);
        }
    });
}

/// Hand this thread's lines to the writer now (the worker's ticker, reload, shutdown).
pub fn flush_local() {
    let _ = LOCAL.try_with(|local| {
        if let Ok(mut local) = local.try_borrow_mut() {
            local.flush(false);
        }
    });
}

/// Hand this thread's lines to the writer every second until `stop` changes: a worker with
/// no traffic still writes its last lines within a second.
pub async fn flush_periodically(mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut every = tokio::time::interval(Duration::from_secs(1));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            _ = every.tick() => flush_local(),
        }
    }
    flush_local();
}

/// Reopen the log file (SIGUSR1, after logrotate renamed it).
pub fn reopen() {
    if let Some(log) = LOG.get() {
        let _ = log.to_writer.try_send(Message::Reopen);
    }
}

/// Hand this thread's lines over and wait, up to `timeout`, until the writer has written
/// everything handed to it so far (at shutdown).
pub fn sync(timeout: Duration) {
    let _ = LOCAL.try_with(|local| {
        if let Ok(mut local) = local.try_borrow_mut() {
            local.flush(true);
        }
    });
    let Some(log) = LOG.get() else { return };
    let (done, written) = mpsc::channel();
    if log.to_writer.send(Message::Sync(done)).is_ok() {
        let _ = written.recv_timeout(timeout);
    }
}

// === the writer thread ===

enum Output {
    Stderr,
    Stdout,
    File {
        path: PathBuf,
        file: File,
        /// Device and inode of `file`: a different one at `path` means it was rotated.
        id: (u64, u64),
    },
}

impl Output {
    fn open(path: PathBuf) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        let id = file_id(&file.metadata()?);
        Ok(Self::File { path, file, id })
    }

    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            // The lock keeps other log lines from being written in the middle of these.
            Self::Stderr => std::io::stderr().lock().write_all(bytes),
            Self::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(bytes)?;
                out.flush()
            }
            Self::File { file, .. } => file.write_all(bytes),
        }
    }

    /// Reopen the file at its path: always on `forced` (SIGUSR1), else when the file there is
    /// not the one open (renamed away, or replaced).
    fn reopen(&mut self, forced: bool) {
        let Self::File { path, id, .. } = self else {
            return;
        };
        let current = std::fs::metadata(&*path).ok().map(|m| file_id(&m));
        if !forced && current == Some(*id) {
            return;
        }
        match Self::open(path.clone()) {
            Ok(reopened) => *self = reopened,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot reopen the access log");
            }
        }
    }
}

#[cfg(unix)]
fn file_id(m: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt as _;
    (m.dev(), m.ino())
}

#[cfg(not(unix))]
fn file_id(_: &std::fs::Metadata) -> (u64, u64) {
    (0, 0)
}

/// Write what the workers hand over until they are all gone; look for a renamed file once a
/// second.
fn run(mut output: Output, from_workers: &Receiver<Message>) {
    let mut failing_since: Option<std::time::Instant> = None;
    let mut checked = std::time::Instant::now();
    loop {
        match from_workers.recv_timeout(Duration::from_secs(1)) {
            Ok(Message::Lines(lines)) => match output.write(&lines) {
                Ok(()) => failing_since = None,
                // Said once a minute while it lasts, not once per buffer.
                Err(e) => {
                    if failing_since.is_none_or(|t| t.elapsed() >= Duration::from_mins(1)) {
                        tracing::warn!(error = %e, "cannot write the access log");
                        failing_since = Some(std::time::Instant::now());
                    }
                }
            },
            Ok(Message::Reopen) => output.reopen(true),
            Ok(Message::Sync(done)) => {
                let _ = done.send(());
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        if checked.elapsed() >= Duration::from_secs(1) {
            checked = std::time::Instant::now();
            output.reopen(false);
        }
    }
}
