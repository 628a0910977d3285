//! Connections spread evenly over the workers, and handed from one worker to another.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::net::TcpStream;
use tokio::sync::{mpsc, OwnedSemaphorePermit};

/// Spreads one listener's connections evenly over the workers, like Envoy's exact connection
/// balance. Each worker accepts on a `SO_REUSEPORT` socket of its own, and the kernel assigns
/// each new connection to one of those sockets by a hash of its addresses, like a coin toss
/// per connection: 64 connections split 36/28 or worse about 4 times in 10. A worker that
/// accepts a connection while another serves fewer passes it to the one serving fewest,
/// before anything is read from it.
///
/// Even matters because requests on keep-alive connections stay with the worker that took the
/// connection: an overloaded worker gets the same share of a core as an idle one, so its
/// clients wait while CPU goes elsewhere.
#[derive(Debug)]
pub struct WorkerBalancer {
    /// By worker number.
    pub(super) workers: Vec<Share>,
}

/// One worker's part of a listener's connections.
#[derive(Debug)]
pub(super) struct Share {
    /// Connections it serves.
    open: AtomicUsize,
    /// The same, in `tollgate_worker_connections` (all listeners together).
    gauge: prometheus_client::metrics::gauge::Gauge,
    /// Where other workers pass it connections.
    pub(super) inbox: mpsc::UnboundedSender<Handoff>,
}

/// A connection passed from the worker that accepted it to the one that serves it.
#[derive(Debug)]
pub struct Handoff {
    pub(super) stream: std::net::TcpStream,
    pub(super) peer: SocketAddr,
    pub(super) slot: OwnedSemaphorePermit,
}

impl WorkerBalancer {
    /// The balance of a listener served by `workers` workers, and each worker's inbox.
    pub fn new(
        workers: usize,
        metrics: &crate::metrics::Metrics,
    ) -> (Arc<Self>, Vec<mpsc::UnboundedReceiver<Handoff>>) {
        let (workers, receivers) = (0..workers)
            .map(|w| {
                let (inbox, receiver) = mpsc::unbounded_channel();
                let labels = crate::metrics::WorkerLabels {
                    worker: w.to_string(),
                };
                let gauge = metrics.worker_connections.get_or_create(&labels).clone();
                let open = AtomicUsize::new(0);
                (Share { open, gauge, inbox }, receiver)
            })
            .unzip();
        (Arc::new(Self { workers }), receivers)
    }

    /// The worker a connection `me` accepted goes to, counted as open there: `me`, unless
    /// another serves fewer.
    pub(super) fn assign(&self, me: usize) -> usize {
        let open = |w: &Share| w.open.load(Ordering::Relaxed);
        let mine = self.workers.get(me).map_or(0, open);
        let fewest = self
            .workers
            .iter()
            .enumerate()
            .map(|(w, share)| (open(share), w))
            .min()
            .filter(|&(n, _)| n < mine)
            .map_or(me, |(_, w)| w);
        self.seat(fewest);
        fewest
    }

    pub(super) fn seat(&self, worker: usize) {
        if let Some(w) = self.workers.get(worker) {
            w.open.fetch_add(1, Ordering::Relaxed);
            w.gauge.inc();
        }
    }

    pub(super) fn unseat(&self, worker: usize) {
        if let Some(w) = self.workers.get(worker) {
            w.open.fetch_sub(1, Ordering::Relaxed);
            w.gauge.dec();
        }
    }
}

/// A connection counted as open on its worker until it ends.
pub(super) struct Seat {
    pub(super) balance: Arc<WorkerBalancer>,
    pub(super) worker: usize,
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.balance.unseat(self.worker);
    }
}

/// Pass a connection worker `me` accepted to the worker serving fewest, if that is another
/// one; `None`: it was passed. What comes back is this worker's to serve (already counted).
pub(super) fn pass(
    balance: &WorkerBalancer,
    me: usize,
    stream: TcpStream,
    peer: SocketAddr,
    slot: OwnedSemaphorePermit,
) -> Option<(TcpStream, SocketAddr, OwnedSemaphorePermit)> {
    let to = balance.assign(me);
    if to == me {
        return Some((stream, peer, slot));
    }
    // Another worker than `me` comes from `assign`'s own list: in range.
    let share = &balance.workers[to];
    let handoff = match stream.into_std() {
        Ok(stream) => Handoff { stream, peer, slot },
        Err(e) => {
            // Nothing to serve: the socket is gone.
            tracing::debug!(error = %e, "cannot pass a connection to another worker");
            balance.unseat(to);
            return None;
        }
    };
    match share.inbox.send(handoff) {
        Ok(()) => None,
        Err(mpsc::error::SendError(back)) => {
            // That worker has stopped: serve it here.
            balance.unseat(to);
            let stream = TcpStream::from_std(back.stream).ok()?;
            balance.seat(me);
            Some((stream, back.peer, back.slot))
        }
    }
}
