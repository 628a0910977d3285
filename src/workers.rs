//! The worker threads serving the proxy listeners: how many, and running a task on each.

use parking_lot::Mutex;

/// The set of worker threads, owned by the proxy's state. Each worker serves its share of the
/// connections on a single-threaded runtime of its own; per-worker resources (upstream pools,
/// Redis connections) are indexed by the worker's number, which a connection carries.
#[derive(Debug)]
pub struct Workers {
    count: usize,
    /// The runtimes of the workers started so far, by number.
    runtimes: Mutex<Vec<(usize, tokio::runtime::Handle)>>,
}

impl Workers {
    /// The set of `count` workers (at least one), none started yet.
    pub fn new(count: usize) -> Self {
        Self {
            count: count.max(1),
            runtimes: Mutex::new(Vec::new()),
        }
    }

    /// How many workers serve requests.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Called once by each worker as it starts, with its runtime.
    pub fn started(&self, id: usize, runtime: tokio::runtime::Handle) {
        self.runtimes.lock().push((id, runtime));
    }

    /// Run `task(id)` on every worker started so far, each in a task of its own on its worker.
    pub fn on_every<F, Fut>(&self, task: F)
    where
        F: Fn(usize) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        for (id, runtime) in self.runtimes.lock().iter() {
            runtime.spawn(task(*id));
        }
    }
}
