//! `upstreams.NAME.protocol`: the HTTP version requests go upstream in.

/// The HTTP version requests go upstream in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// HTTP/1.1, a request per connection at a time (keep-alive).
    #[default]
    Http1,
    /// HTTP/2 without TLS, by prior knowledge: streams multiplexed on a connection per target.
    H2c,
    /// HTTP/2 over TLS: ALPN must pick `h2`.
    H2,
    /// Over TLS, what ALPN picks (`h2`, else HTTP/1.1).
    Auto,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Http1 => "http1",
            Protocol::H2c => "h2c",
            Protocol::H2 => "h2",
            Protocol::Auto => "auto",
        }
    }
}
