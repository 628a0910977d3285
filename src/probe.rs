//! `tollgate health` and `tollgate explain --admin`: one HTTP/1.1 GET (of the admin `/healthz`,
//! for container health checks), through hyper.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;

/// How long the whole exchange may take.
const TIMEOUT: Duration = Duration::from_secs(3);

/// Check `url` (`http://host:port/path`), or the admin address of the config at `config`.
pub fn check(config: &Path, url: Option<&str>) -> Result<(), String> {
    let (addr, path) = match url {
        Some(url) => parse_url(url)?,
        None => (admin_address(config)?, "/healthz".to_owned()),
    };
    match fetch(addr, &path, &[])? {
        (200, _) => Ok(()),
        (status, _) => Err(format!("{addr}{path}: HTTP {status}")),
    }
}

/// GET `url` (`http://host:port/path?query`) with `headers`: the status and the body (for
/// `tollgate explain`).
pub fn get(url: &str, headers: &[(&str, &str)]) -> Result<(u16, String), String> {
    let (addr, path) = parse_url(url)?;
    let (status, body) = fetch(addr, &path, headers)?;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// One HTTP/1.1 GET through hyper, on a runtime of its own (the commands that call this
/// run none), within `TIMEOUT`.
fn fetch(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Result<(u16, Bytes), String> {
    type Error = Box<dyn std::error::Error + Send + Sync>;
    let mut request = http::Request::get(path)
        .header(http::header::HOST, addr.to_string())
        .header(http::header::CONNECTION, "close");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Empty::<Bytes>::new())
        .map_err(|e| format!("{addr}{path}: {e}"))?;
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let response = sender.send_request(request).await?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await?.to_bytes();
        Ok::<_, Error>((status, body))
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime
        .block_on(async { tokio::time::timeout(TIMEOUT, exchange).await })
        .map_err(|_| format!("{addr}: no answer within {} s", TIMEOUT.as_secs()))?
        .map_err(|e| format!("{addr}: {e}"))
}

/// The admin address, read leniently: only `admin.address` has to make sense, so a running
/// proxy whose file now holds a half-finished edit (which it refuses to load) still reports
/// healthy.
fn admin_address(config: &Path) -> Result<SocketAddr, String> {
    let text = std::fs::read_to_string(config).map_err(|e| format!("{}: {e}", config.display()))?;
    let root: serde_json::Value = serde_saphyr::from_str(&text)
        .map_err(|e| format!("{}: {}", config.display(), e.without_snippet()))?;
    let address = root
        .get("admin")
        .and_then(|a| a.get("address"))
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| format!("{}: no `admin.address` to ask", config.display()))?;
    let mut addr: SocketAddr = address.parse().map_err(|_| {
        format!(
            "{}: `admin.address` `{address}` is not an address",
            config.display()
        )
    })?;
    // A wildcard bind is reached on loopback.
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    Ok(addr)
}

fn parse_url(url: &str) -> Result<(SocketAddr, String), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("`{url}`: only http:// URLs are supported"))?;
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let addr = authority
        .to_socket_addrs()
        .map_err(|e| format!("`{url}`: {e}"))?
        .next()
        .ok_or_else(|| format!("`{url}`: no address"))?;
    let path = if path.is_empty() { "/" } else { path };
    Ok((addr, path.to_owned()))
}
