//! Hot reload: on a file change or SIGHUP, build a whole new runtime and swap it in, or keep
//! the old one.
//!
//! The directory holding the file is watched rather than the file itself, so a reload happens
//! whether an editor rewrites the file in place, replaces it by rename, or Kubernetes swaps the
//! `..data` symlink of a ConfigMap volume. A file whose bytes did not change is not reloaded.
//!
//! A file being written in place can parse half-way through (a list cut after a whole item: a
//! route or a limit gone), so nothing is read until the edit is over: no event naming the file
//! for `DEBOUNCE`, the same bytes as `DEBOUNCE` before, and (where the platform reports it,
//! inotify) no writer that modified the file and has not closed it yet, for up to
//! `WRITER_WAIT`. A writer that pauses longer than that with the file open, or closes and
//! reopens it with more than `DEBOUNCE` between, can still be read half-way: writing the new
//! version to a temporary file and renaming it over the old one (an atomic replace, what
//! editors and the kubelet do) is the safe way, and docs/operations.md says so.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::event::{AccessKind, AccessMode, ModifyKind};
use notify::{EventKind, RecursiveMode, Watcher as _};
use tokio::sync::{mpsc, watch};

use crate::config::{inputs_digest_at, load, referenced_files, ConfigError, Settings};
use crate::metrics::ReloadResult;
use crate::runtime::Runtime;
use crate::state::State;

/// Events closer together than this are one edit; the file must also keep the same bytes
/// for this long before it is read.
const DEBOUNCE: Duration = Duration::from_millis(150);

/// The longest a stream of file events may put a reload off: edits that never pause for
/// `DEBOUNCE` are read after this long anyway.
const MAX_WAIT: Duration = Duration::from_secs(2);

/// How long a writer may keep the file open (modified, not closed) before it is read anyway.
const WRITER_WAIT: Duration = Duration::from_secs(5);

/// What asked for a reload. A signal reloads even an unchanged file (certificates it names may
/// have changed); a file event only when the bytes changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Trigger {
    FileEvent,
    Signal,
}

/// What the reloader hears.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    /// Something changed in a watched directory; `config`: an event naming the config file.
    Changed { config: bool },
    /// SIGHUP, or `Reloader::reload`.
    Signal,
    /// The config file was written to (inotify's IN_MODIFY): its writer has it open.
    Writing,
    /// A writer closed the config file (IN_CLOSE_WRITE).
    Closed,
}

impl Event {
    fn trigger(self) -> Trigger {
        match self {
            Event::Signal => Trigger::Signal,
            _ => Trigger::FileEvent,
        }
    }
}

/// Asks the running reloader for a reload, as SIGHUP does.
#[derive(Debug, Clone)]
pub struct Reloader(mpsc::UnboundedSender<Event>);

impl Reloader {
    /// Reload now, even if the file did not change.
    pub fn reload(&self) {
        let _ = self.0.send(Event::Signal);
    }
}

/// Why a reload did not happen.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("{0}")]
    Invalid(#[from] ConfigError),
    #[error("{0}")]
    Build(#[from] crate::runtime::BuildError),
}

/// Load `path` and, if it is valid, make it the live config in one swap. In-flight requests
/// keep the runtime they started with; limits whose name and rate did not change keep their
/// buckets.
pub fn reload(path: &Path, state: &State) -> Result<(), ReloadError> {
    // The lines of the requests served so far are written before anything changes.
    state
        .workers
        .on_every(|_| async { crate::access_log::flush_local() });
    let current = state.runtime.load_full();
    let result = load(path).map_err(ReloadError::from).and_then(|settings| {
        Runtime::build(settings, Some(&current), &state.workers, &state.metrics)
            .map_err(ReloadError::from)
    });
    match result {
        Ok(next) => {
            log_changes(&current.settings, &next.settings);
            state.metrics.loaded(&next.settings.source);
            // Counted before the generation is published: whoever waits for it (a test, the
            // dashboard) sees the counts of the reload that made it. Reloads run one at a time,
            // so the next generation is known.
            let generation = *state.generation.borrow() + 1;
            state.metrics.reloaded(ReloadResult::ok, generation);
            state.swap(next);
            tracing::info!(generation, "config reloaded");
            Ok(())
        }
        Err(e) => {
            state
                .metrics
                .reloaded(ReloadResult::failed, *state.generation.borrow());
            tracing::error!("config reload failed; still serving the previous config\n{e}");
            Err(e)
        }
    }
}

fn log_changes(old: &Settings, new: &Settings) {
    let names = |s: &Settings| -> Vec<(String, u64)> { s.fingerprints.clone() };
    let (before, after) = (names(old), names(new));
    let find = |list: &[(String, u64)], n: &str| list.iter().find(|(m, _)| m == n).map(|(_, f)| *f);
    let added: Vec<&str> = after
        .iter()
        .filter(|(n, _)| find(&before, n).is_none())
        .map(|(n, _)| n.as_str())
        .collect();
    let removed: Vec<&str> = before
        .iter()
        .filter(|(n, _)| find(&after, n).is_none())
        .map(|(n, _)| n.as_str())
        .collect();
    let changed: Vec<&str> = after
        .iter()
        .filter(|(n, f)| find(&before, n).is_some_and(|g| g != *f))
        .map(|(n, _)| n.as_str())
        .collect();
    tracing::info!(
        added = ?added,
        removed = ?removed,
        changed = ?changed,
        "routes and upstreams changed by the reload"
    );
    if old.listeners != new.listeners || old.admin != new.admin {
        tracing::warn!("listener or admin settings changed (addresses, TLS on or off, limits): they apply after a restart; certificates already follow the reload");
    }
}

/// Start watching `path` until `stop`, reloading on each change; the returned `Reloader`
/// asks for a reload as SIGHUP does (`watch_sighup`). The file watch is in place when this
/// returns. Must be called within a tokio runtime.
pub fn start(path: PathBuf, state: Arc<State>, stop: watch::Receiver<bool>) -> Reloader {
    let (tx, rx) = mpsc::unbounded_channel::<Event>();
    let mut watcher = watch_dir(&path, tx.clone());
    if let Some(w) = watcher.as_mut() {
        watch_inputs(w, &state.runtime.load().settings);
    }
    // An edit made before the watch was in place raised no event: look once now.
    let _ = tx.send(Event::Changed { config: false });
    tokio::spawn(async move {
        run(&path, state, rx, stop, watcher).await;
    });
    Reloader(tx)
}

async fn run(
    path: &Path,
    state: Arc<State>,
    mut rx: mpsc::UnboundedReceiver<Event>,
    mut stop: watch::Receiver<bool>,
    mut watcher: Option<notify::RecommendedWatcher>,
) {
    // What was last loaded, or last refused: a file event that leaves every input as it was
    // (another file in the directory changed) neither reloads nor counts a second failure.
    // Start from the inputs as they were read for the live snapshot (before it was compiled),
    // not as they are now: a change made since must still count as a change.
    let mut seen = state.runtime.load().settings.inputs_digest;
    loop {
        let first = tokio::select! {
            _ = stop.changed() => return,
            got = rx.recv() => match got { Some(e) => e, None => return },
        };
        let mut edit = Edit::new(first);
        if !edit.settle(path, &mut rx).await {
            return;
        }
        let trigger = edit.trigger;
        // Off the control runtime's threads: reading a config of tens of thousands of routes
        // takes a second and building it several, and the admin listener (`/healthz` for a
        // liveness probe) must answer meanwhile.
        let (file, shared) = (path.to_path_buf(), Arc::clone(&state));
        let tried = tokio::task::spawn_blocking(move || {
            let now = inputs_digest_at(&file, &std::fs::read_to_string(&file).unwrap_or_default());
            if trigger == Trigger::FileEvent && now == seen {
                return None;
            }
            Some((now, reload(&file, &shared).is_ok()))
        })
        .await;
        // Loaded: the digest of what the new snapshot was built from. Refused: what was tried,
        // so the same broken version is not tried (and counted) again.
        seen = match tried {
            Ok(None) => continue,
            Ok(Some((_, true))) => state.runtime.load().settings.inputs_digest,
            Ok(Some((now, false))) => now,
            Err(_) => seen,
        };
        if let Some(w) = watcher.as_mut() {
            watch_inputs(w, &state.runtime.load().settings);
        }
    }
}

/// The events of one edit, gathered until it is over.
struct Edit {
    trigger: Trigger,
    /// Since when a writer has held the config file modified and not closed.
    writing: Option<tokio::time::Instant>,
}

impl Edit {
    fn new(first: Event) -> Self {
        let mut edit = Self {
            trigger: first.trigger(),
            writing: None,
        };
        edit.absorb(first);
        edit
    }

    /// Note `event`; whether it restarts the quiet period (it is about the config file).
    fn absorb(&mut self, event: Event) -> bool {
        self.trigger = self.trigger.max(event.trigger());
        match event {
            Event::Writing => {
                self.writing.get_or_insert_with(tokio::time::Instant::now);
                true
            }
            Event::Closed => {
                self.writing = None;
                true
            }
            Event::Changed { config } => config,
            Event::Signal => false,
        }
    }

    /// Wait until the edit is over (see the module doc), for at most `MAX_WAIT` of events (and
    /// `WRITER_WAIT` of an open writer); a signal ends the wait at once: SIGHUP reloads now.
    /// `false`: the reloader is gone.
    async fn settle(&mut self, path: &Path, rx: &mut mpsc::UnboundedReceiver<Event>) -> bool {
        if self.trigger == Trigger::Signal {
            return true;
        }
        let give_up = tokio::time::Instant::now() + MAX_WAIT;
        let mut before = std::fs::read(path).ok();
        loop {
            // Quiet: no event about the file for DEBOUNCE.
            let mut quiet_from = tokio::time::Instant::now();
            loop {
                // An open writer is waited for in DEBOUNCE steps, up to WRITER_WAIT.
                let until = match self.writing {
                    Some(_) => quiet_from + DEBOUNCE,
                    None => (quiet_from + DEBOUNCE).min(give_up),
                };
                match tokio::time::timeout_at(until, rx.recv()).await {
                    Ok(Some(Event::Signal)) => {
                        self.trigger = Trigger::Signal;
                        return true;
                    }
                    Ok(Some(event)) => {
                        if self.absorb(event) {
                            quiet_from = tokio::time::Instant::now();
                        }
                    }
                    Ok(None) => return false,
                    Err(_) => break,
                }
            }
            if let Some(since) = self.writing {
                if since.elapsed() < WRITER_WAIT {
                    // Its writer still has it open: wait for the close (an event).
                    continue;
                }
                tracing::warn!(
                    "the config file has been open for writing for {WRITER_WAIT:?}: reading it                      as it is (write a new version by rename instead: docs/operations.md)"
                );
                self.writing = None;
            }
            let now = std::fs::read(path).ok();
            if now == before || tokio::time::Instant::now() >= give_up {
                return true;
            }
            before = now;
        }
    }
}

/// Also watch the directories of certificates and keys, so a renewed certificate is picked
/// up without touching the config (a watch added twice is harmless).
fn watch_inputs(watcher: &mut notify::RecommendedWatcher, settings: &Settings) {
    // The same list the inputs digest covers: the files the config's own text names, and the
    // candidate config with the files it names.
    let candidate = settings.candidate.as_ref();
    let candidate_files = candidate
        .and_then(|c| c.settings.as_ref().ok())
        .map(|c| referenced_files(&c.source))
        .unwrap_or_default();
    let files = referenced_files(&settings.source).into_iter();
    // The rate limit service's files: their directory, where a new one appears too.
    let rls = (settings.rls.iter()).flat_map(|r| r.domains.iter().map(|d| d.file.clone()));
    for file in files
        .chain(candidate.map(|c| c.path.clone()))
        .chain(candidate_files)
        .chain(rls)
    {
        if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
            let _ = watcher.watch(dir, RecursiveMode::NonRecursive);
        }
    }
}

/// Watch the directory of `path`; `None` (logged) when the platform refuses, SIGHUP still works.
fn watch_dir(path: &Path, tx: mpsc::UnboundedSender<Event>) -> Option<notify::RecommendedWatcher> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or_else(|| Path::new("."))
        .to_path_buf();
    let name = path.file_name().map(std::ffi::OsStr::to_os_string);
    let handler = move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        let config = event
            .paths
            .iter()
            .any(|p| p.file_name().is_some() && p.file_name() == name.as_deref());
        let what = match event.kind {
            EventKind::Access(AccessKind::Close(AccessMode::Write)) if config => Event::Closed,
            // Reads (ours too) change nothing.
            EventKind::Access(_) => return,
            EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Any) if config => Event::Writing,
            _ => Event::Changed { config },
        };
        let _ = tx.send(what);
    };
    let mut watcher = match notify::recommended_watcher(handler) {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch the config file; reload with SIGHUP");
            return None;
        }
    };
    if let Err(e) = watcher.watch(&dir, RecursiveMode::NonRecursive) {
        tracing::warn!(error = %e, dir = %dir.display(), "cannot watch the config directory; reload with SIGHUP");
        return None;
    }
    Some(watcher)
}

/// Reload on every SIGHUP. The handler is in place when this returns.
#[cfg(unix)]
pub fn watch_sighup(reloader: Reloader) {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::hangup()) {
        Ok(mut hup) => {
            tokio::spawn(async move {
                while hup.recv().await.is_some() {
                    tracing::info!("SIGHUP: reloading the config");
                    if reloader.0.send(Event::Signal).is_err() {
                        return;
                    }
                }
            });
        }
        Err(e) => tracing::warn!(error = %e, "cannot handle SIGHUP"),
    }
}

#[cfg(not(unix))]
pub fn watch_sighup(_reloader: Reloader) {}
