//! Request-path errors; each one becomes exactly one status in `response::from_error`.

use std::sync::Arc;

use http::StatusCode;

/// Why a request could not be served normally. Startup and config errors live elsewhere
/// (`config::ConfigErrors`, `app::StartError`): they never reach a client.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("no route matches the request")]
    NoRoute,
    #[error("malformed request")]
    BadRequest,
    #[error("upstream unreachable")]
    UpstreamUnreachable,
    #[error("upstream did not answer in time")]
    UpstreamTimeout,
    #[error("the shared rate-limit store is unavailable and limit `{limit}` fails closed")]
    LimiterUnavailable { limit: Arc<str> },
}

impl ProxyError {
    /// The status a client sees. Exhaustive on purpose: a new variant must choose one.
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::NoRoute => StatusCode::NOT_FOUND,
            ProxyError::BadRequest => StatusCode::BAD_REQUEST,
            ProxyError::UpstreamUnreachable => StatusCode::BAD_GATEWAY,
            ProxyError::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::LimiterUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}
