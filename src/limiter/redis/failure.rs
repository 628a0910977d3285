//! Why a Redis check failed: the kind the failure policy sees, and the detail the log gets.

use std::time::Duration;

use tokio::time::Instant;

/// Why Redis could not decide: the caller applies the limit's failure policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    #[error("the Redis circuit breaker is open")]
    BreakerOpen,
    #[error("Redis did not answer within the timeout")]
    Timeout,
    #[error("Redis answered with an error or could not be reached")]
    Error,
}

/// A failed call, with what the log should say about it.
#[derive(Debug, Clone)]
pub(super) struct Failure {
    pub(super) kind: Unavailable,
    pub(super) detail: String,
    /// On a cluster, the slot whose call failed, when a check spanned several.
    pub(super) slot: Option<u16>,
}

impl Failure {
    pub(super) fn new(kind: Unavailable, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            slot: None,
        }
    }

    pub(super) fn timed_out(timeout: Duration) -> Self {
        Self::new(
            Unavailable::Timeout,
            format!("no answer within {timeout:?}"),
        )
    }

    pub(super) fn unexpected_reply() -> Self {
        Self::new(
            Unavailable::Error,
            "unexpected reply from the bucket script",
        )
    }
}

/// `call` cut at `deadline` (`timeout` after the check started): its error or its lateness as
/// a `Failure`.
pub(super) async fn by_deadline<T>(
    deadline: Instant,
    timeout: Duration,
    call: impl std::future::Future<Output = Result<T, ::redis::RedisError>>,
) -> Result<T, Failure> {
    match tokio::time::timeout_at(deadline, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(Failure::new(Unavailable::Error, e.to_string())),
        Err(_) => Err(Failure::timed_out(timeout)),
    }
}
