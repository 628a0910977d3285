//! The limiter's connection lent to the operators' entries (`control`): commands on the shared
//! connection, off the request path, each with a deadline of its own.

use std::time::Duration;

use ::redis::{Cmd, Value};
use tokio::time::Instant;

use super::failure::by_deadline;
use super::RedisLimiter;

/// The shortest deadline a control call gets: a check's timeout (tens of milliseconds) is
/// tuned for the request path, not for a poll that may wait a little.
const MIN_TIMEOUT: Duration = Duration::from_millis(250);

impl RedisLimiter {
    /// The prefix of every key tollgate writes (`limiter.redis.key_prefix`).
    pub fn key_prefix(&self) -> &str {
        &self.key_prefix
    }

    /// Send `cmd` through the shared connection (on a cluster, to its key's master).
    pub async fn command(&self, cmd: &Cmd) -> Result<Value, String> {
        let timeout = self.timeout.max(MIN_TIMEOUT);
        let on = self.shared.now();
        let deadline = Instant::now() + timeout;
        let result = by_deadline(deadline, timeout, on.conn.query(cmd)).await;
        self.shared.settle(&on, &result);
        result.map_err(|f| f.detail)
    }

    /// EVAL `source` on `keys` and `args`: for a change made now and then, not worth a script
    /// kept loaded (and counted among the bucket script's loads). On a cluster every key must
    /// share a slot.
    pub async fn eval(&self, source: &str, keys: &[&str], args: &[&str]) -> Result<Value, String> {
        let mut cmd = ::redis::cmd("EVAL");
        cmd.arg(source).arg(keys.len()).arg(keys).arg(args);
        self.command(&cmd).await
    }
}
