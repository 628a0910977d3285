//! `tollgate health`: a tiny HTTP/1.1 GET of the admin `/healthz`, for container health checks.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(3);

/// Check `url` (`http://host:port/path`), or the admin address of the config at `config`.
pub fn check(config: &Path, url: Option<&str>) -> Result<(), String> {
    let (addr, path) = match url {
        Some(url) => parse_url(url)?,
        None => (admin_address(config)?, "/healthz".to_owned()),
    };
    let mut stream =
        TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| format!("{addr}: {e}"))?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("{addr}: {e}"))?;
    let mut head = [0u8; 64];
    let n = stream.read(&mut head).map_err(|e| format!("{addr}: {e}"))?;
    let status_line = String::from_utf8_lossy(&head[..n]);
    if status_line.starts_with("HTTP/1.1 200") || status_line.starts_with("HTTP/1.0 200") {
        Ok(())
    } else {
        let first = status_line.lines().next().unwrap_or("no answer");
        Err(format!("{addr}{path}: {first}"))
    }
}

/// GET `url` (`http://host:port/path?query`) with `headers`, asking the server to close: the
/// status and the body, read to the end (for `tollgate explain`).
pub fn get(url: &str, headers: &[(&str, &str)]) -> Result<(u16, String), String> {
    let (addr, path) = parse_url(url)?;
    let mut stream =
        TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| format!("{addr}: {e}"))?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    let mut head = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (name, value) in headers {
        let _ = write!(head, "{name}: {value}\r\n");
    }
    head.push_str("\r\n");
    stream
        .write_all(head.as_bytes())
        .map_err(|e| format!("{addr}: {e}"))?;
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .map_err(|e| format!("{addr}: {e}"))?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("{addr}: no HTTP answer"))?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let body = &raw[split + 4..];
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            format!(
                "{addr}: no HTTP status in `{}`",
                head.lines().next().unwrap_or("")
            )
        })?;
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_vec()
    };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// A chunked body's data.
fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let line = String::from_utf8_lossy(&rest[..eol]);
        let size =
            usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        let data = &rest[eol + 2..];
        if size == 0 || data.len() < size {
            break;
        }
        out.extend_from_slice(&data[..size]);
        rest = data[size..].strip_prefix(b"\r\n").unwrap_or(&data[size..]);
    }
    out
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
