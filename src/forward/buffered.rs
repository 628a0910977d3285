//! Bodies held whole on their way through: a request's received before it goes upstream, a
//! response's read ahead of a slow client (see `buffer`).

use http::{Response, Version};
use http_body::Body as _;
use http_body_util::{Either, Full};

use crate::body::{Guarded, HoldError};
use crate::buffer::{self, ReadAhead, Store};
use crate::error::ProxyError;
use crate::pool::Pooled;
use crate::response::Body;

/// Receive the request body whole, and say its length upstream; the length comes back with it.
pub async fn hold(
    body: Guarded,
    parts: &mut http::request::Parts,
    store: &Store,
) -> Result<(Guarded, u64), ProxyError> {
    let (held, len) = body.hold(store).await.map_err(|e| match e {
        HoldError::Body(why) => ProxyError::from(why),
        HoldError::Store(e) => {
            tracing::warn!(error = %e, dir = %store.temp_dir.display(), "cannot buffer a request body");
            ProxyError::BufferUnavailable
        }
    })?;
    let headers = &mut parts.headers;
    headers.remove(http::header::TRANSFER_ENCODING);
    // The body is here already: the upstream has nothing to wait for.
    headers.remove(http::header::EXPECT);
    headers.insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(len));
    Ok((held, len))
}

/// The upstream response as the client gets it: read ahead (`buffer::read_ahead`), or
/// streamed as the client reads. An HTTP/1.0 upstream's answer goes out in the client's
/// protocol: the client keeps its keep-alive; read ahead, a body that ends with the upstream's
/// connection is read whole first (up to the memory bound) so it gets a Content-Length.
pub async fn body_out(
    mut res: Response<Pooled>,
    read_ahead: bool,
    store: &Store,
) -> Result<Response<Body>, ProxyError> {
    let close_delimited = res.version() == Version::HTTP_10
        && !res.headers().contains_key(http::header::CONTENT_LENGTH);
    *res.version_mut() = Version::HTTP_11;
    if !read_ahead || res.body().is_end_stream() {
        return Ok(res.map(|b| Either::Left(Either::Left(b))));
    }
    let (parts, body) = res.into_parts();
    let body = match buffer::read_ahead(body, store, close_delimited).await {
        Ok(ReadAhead::Complete(bytes)) => Either::Right(Full::new(bytes)),
        Ok(ReadAhead::Spooled(spooled)) => Either::Left(Either::Right(spooled)),
        Err(e) => {
            tracing::warn!(error = %e, dir = %store.temp_dir.display(), "cannot buffer a response body");
            return Err(ProxyError::BufferUnavailable);
        }
    };
    Ok(Response::from_parts(parts, body))
}
