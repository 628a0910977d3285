//! Checks that are waiting at the same moment on one worker go to Redis as one script call
//! (`bucket.lua`'s "batch" mode): under load a call carries many requests' checks, so Redis
//! runs one script (one command, one read, one write) for all of them instead of one each.
//!
//! There is no timer and no waiting for a batch to fill: a worker's requests queue their
//! checks as they run, and the batching task takes everything queued when it next runs (after
//! the requests of that turn of the event loop). A lone request goes alone, at once. Calls are
//! not serialised: a batch is sent while earlier ones are still out.
//!
//! The checks of a batch run one after the other inside one atomic script, so each keeps the
//! semantics of a "check" call of its own: charged all-or-nothing, and a later check of the
//! batch sees what an earlier one took from a shared bucket.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::conn::{parse_items, Conn, Reply};
use super::{bump, Bucket, Counters, Failure, Unavailable, BUCKET_SCRIPT};
use crate::limiter::Rate;

/// At most this many checks share one call.
const MAX_BATCH: usize = 128;

/// One request's check, waiting for its batch.
struct Job {
    /// The buckets' keys (moved into the call), and each bucket's rate, cost and enforcement.
    keys: Vec<String>,
    args: Vec<(Rate, u32, bool)>,
    reply: oneshot::Sender<Result<Reply, Failure>>,
}

/// The queue of one worker's checks (single-server mode: a batch's keys may live anywhere).
#[derive(Debug)]
pub(super) struct Batcher {
    jobs: mpsc::UnboundedSender<Job>,
}

impl Batcher {
    /// Start the batching task on the current runtime. `timeout` bounds one call; callers
    /// apply their own (the same) deadline as well.
    pub(super) fn start(conn: Conn, counters: Arc<Counters>, timeout: Duration) -> Self {
        let (jobs, queue) = mpsc::unbounded_channel();
        tokio::spawn(collect(conn, queue, counters, timeout));
        Self { jobs }
    }

    /// Check `buckets` as one, like a "check" call, in the next batch.
    pub(super) async fn check(&self, buckets: &[Bucket<'_>]) -> Result<Reply, Failure> {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            keys: buckets.iter().map(|b| b.key.clone()).collect(),
            args: buckets
                .iter()
                .map(|b| (b.rate.clone(), b.cost, b.enforced))
                .collect(),
            reply,
        };
        if self.jobs.send(job).is_err() {
            return Err(gone());
        }
        answer.await.unwrap_or_else(|_| Err(gone()))
    }
}

fn gone() -> Failure {
    Failure {
        kind: Unavailable::Error,
        detail: "the Redis batching task has stopped".into(),
    }
}

/// Take everything queued, send it as one call (without waiting for it), repeat.
async fn collect(
    conn: Conn,
    mut queue: mpsc::UnboundedReceiver<Job>,
    counters: Arc<Counters>,
    timeout: Duration,
) {
    while let Some(first) = queue.recv().await {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        tokio::spawn(send(conn.clone(), batch, counters.clone(), timeout));
    }
}

/// One script call for `batch`; every check gets its own part of the reply, or the failure.
async fn send(conn: Conn, mut batch: Vec<Job>, counters: Arc<Counters>, timeout: Duration) {
    bump(&counters.redis_calls);
    let keys: Vec<Vec<String>> = batch
        .iter_mut()
        .map(|job| std::mem::take(&mut job.keys))
        .collect();
    let buckets: Vec<Vec<Bucket<'_>>> = batch
        .iter()
        .zip(keys)
        .map(|(job, keys)| {
            keys.into_iter()
                .zip(&job.args)
                .map(|(key, (rate, cost, enforced))| Bucket {
                    key,
                    rate,
                    cost: *cost,
                    enforced: *enforced,
                })
                .collect()
        })
        .collect();
    let call = conn.run_batch(&BUCKET_SCRIPT, buckets.iter().map(|b| b.iter()));
    let outcome = match tokio::time::timeout(timeout, call).await {
        Ok(Ok(::redis::Value::Array(items))) => Ok(items),
        Ok(Ok(_)) => Err(Failure {
            kind: Unavailable::Error,
            detail: "unexpected reply from the bucket script".into(),
        }),
        Ok(Err(e)) => Err(Failure {
            kind: Unavailable::Error,
            detail: e.to_string(),
        }),
        Err(_) => Err(Failure {
            kind: Unavailable::Timeout,
            detail: format!("no answer within {timeout:?}"),
        }),
    };
    drop(buckets);
    let items = match outcome {
        Ok(items) => items,
        Err(failure) => {
            for job in batch {
                let _ = job.reply.send(Err(Failure {
                    kind: failure.kind,
                    detail: failure.detail.clone(),
                }));
            }
            return;
        }
    };
    let mut at = 0;
    for job in batch {
        let n = job.args.len();
        let part = items.get(at..at + 1 + 4 * n);
        at += 1 + 4 * n;
        let reply = part.and_then(|p| parse_items(p, n)).ok_or_else(|| Failure {
            kind: Unavailable::Error,
            detail: "unexpected reply from the bucket script".into(),
        });
        let _ = job.reply.send(reply);
    }
}
