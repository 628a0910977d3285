//! Request-path errors; each one becomes exactly one status in `response::from_error`.

use std::sync::Arc;

use http::StatusCode;

/// Why a request could not be served normally. Startup and config errors live elsewhere
/// (`config::ConfigErrors`, `app::StartError`): they never reach a client.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("no route matches the request")]
    NoRoute,
    /// `OPTIONS *`: a question about the server itself, answered here (200 with `Allow`, as
    /// Apache httpd does), never forwarded.
    #[error("OPTIONS * is answered by tollgate")]
    ServerOptions,
    #[error("malformed request")]
    BadRequest,
    #[error("request target too long")]
    UriTooLong,
    #[error("method not allowed (CONNECT: tollgate is not a forward proxy)")]
    MethodNotAllowed,
    #[error("transfer coding not implemented")]
    NotImplemented,
    #[error("the request body was too slow")]
    RequestTimeout,
    #[error("the request body is larger than the route allows")]
    PayloadTooLarge,
    /// A gRPC call (`content-type: application/grpc`) over HTTP/1.x: gRPC needs HTTP/2's
    /// trailers, both ways.
    #[error("a gRPC call over HTTP/1.x: gRPC needs HTTP/2")]
    GrpcOverHttp1,
    #[error("too many requests in flight")]
    Overloaded,
    #[error("a body could not be buffered (no room in memory, and no temporary file)")]
    BufferUnavailable,
    #[error("upstream unreachable")]
    UpstreamUnreachable,
    #[error("upstream did not answer in time")]
    UpstreamTimeout,
    /// A response head that cannot be passed on (framing both ways, an unasked-for `101`).
    /// Never retried: the upstream has the request.
    #[error("the upstream's response is malformed")]
    UpstreamInvalid,
    #[error("the shared rate-limit store is unavailable and limit `{limit}` fails closed")]
    LimiterUnavailable { limit: Arc<str> },
    /// Every target of the upstream had its `max_in_flight` requests, and the request found
    /// the queue full or waited its `timeout`: nothing reached the backend.
    #[error("upstream `{upstream}` is at capacity ({})", refusal.why.as_str())]
    AtCapacity {
        upstream: Arc<str>,
        refusal: crate::capacity::Refusal,
    },
}

impl From<crate::body::BodyFailure> for ProxyError {
    /// A request body's own failure: the client's fault, whatever the upstream was doing.
    fn from(why: crate::body::BodyFailure) -> Self {
        use crate::body::BodyFailure;
        match why {
            BodyFailure::Idle | BodyFailure::Deadline => Self::RequestTimeout,
            BodyFailure::TooLarge => Self::PayloadTooLarge,
            BodyFailure::Malformed => Self::BadRequest,
        }
    }
}

impl ProxyError {
    /// After this error the connection cannot be trusted to be in sync (HTTP/1.1): close it.
    /// The error's name in traces (`error.type`).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NoRoute => "no_route",
            Self::ServerOptions => "server_options",
            Self::BadRequest => "bad_request",
            Self::UriTooLong => "uri_too_long",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::NotImplemented => "not_implemented",
            Self::RequestTimeout => "request_timeout",
            Self::PayloadTooLarge => "payload_too_large",
            Self::GrpcOverHttp1 => "grpc_over_http1",
            Self::Overloaded => "overloaded",
            Self::BufferUnavailable => "buffer_unavailable",
            Self::UpstreamUnreachable => "upstream_unreachable",
            Self::UpstreamTimeout => "upstream_timeout",
            Self::UpstreamInvalid => "upstream_invalid",
            Self::LimiterUnavailable { .. } => "limiter_unavailable",
            Self::AtCapacity { .. } => "at_capacity",
        }
    }

    pub fn closes_connection(&self) -> bool {
        match self {
            ProxyError::BadRequest
            | ProxyError::UriTooLong
            | ProxyError::NotImplemented
            | ProxyError::RequestTimeout
            | ProxyError::PayloadTooLarge
            | ProxyError::GrpcOverHttp1
            | ProxyError::BufferUnavailable => true,
            ProxyError::NoRoute
            | ProxyError::ServerOptions
            | ProxyError::MethodNotAllowed
            | ProxyError::UpstreamUnreachable
            | ProxyError::UpstreamTimeout
            | ProxyError::UpstreamInvalid
            | ProxyError::LimiterUnavailable { .. }
            | ProxyError::AtCapacity { .. }
            | ProxyError::Overloaded => false,
        }
    }

    /// The status a client sees. Exhaustive on purpose: a new variant must choose one.
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::NoRoute => StatusCode::NOT_FOUND,
            ProxyError::ServerOptions => StatusCode::OK,
            ProxyError::BadRequest => StatusCode::BAD_REQUEST,
            ProxyError::UriTooLong => StatusCode::URI_TOO_LONG,
            ProxyError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::NotImplemented => StatusCode::NOT_IMPLEMENTED,
            ProxyError::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ProxyError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::GrpcOverHttp1 => StatusCode::HTTP_VERSION_NOT_SUPPORTED,
            ProxyError::UpstreamUnreachable | ProxyError::UpstreamInvalid => {
                StatusCode::BAD_GATEWAY
            }
            ProxyError::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Overloaded
            | ProxyError::BufferUnavailable
            | ProxyError::LimiterUnavailable { .. }
            | ProxyError::AtCapacity { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}
