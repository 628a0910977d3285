//! The limiter's connection lent to the operators' entries (`control`): a script run on the
//! shared connection, off the request path, with a deadline of its own.

use std::time::Duration;

use ::redis::{Script, Value};
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

    /// Run `script` on `keys` and `args` through the shared connection (EVALSHA, loading the
    /// script on NOSCRIPT). On a cluster every key must share a slot.
    pub async fn run_script(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
    ) -> Result<Value, String> {
        let mut call = script.prepare_invoke();
        for k in keys {
            call.key(*k);
        }
        for a in args {
            call.arg(*a);
        }
        let timeout = self.timeout.max(MIN_TIMEOUT);
        let on = self.shared.now();
        let deadline = Instant::now() + timeout;
        let result = by_deadline(deadline, timeout, on.conn.invoke(&call)).await;
        self.shared.settle(&on, &result);
        result.map_err(|f| f.detail)
    }
}
