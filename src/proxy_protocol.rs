//! The PROXY protocol (v1 text and v2 binary, HAProxy's spec) on listeners that ask for it:
//! the load balancer in front says who the client is before the first HTTP byte. Parsing is
//! the `ppp` crate's; this module only reads exactly the header's bytes off the socket.

use std::net::SocketAddr;

use ppp::v1;
use ppp::v2;
use ppp::HeaderResult;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

const V2_SIGNATURE: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
/// The longest v1 line, `\r\n` included (the spec's limit).
const V1_MAX: usize = 107;

/// Read the PROXY header at the start of `stream` and return the client address it names;
/// `None` for `UNKNOWN`/`LOCAL` headers (health checks of the balancer itself: the TCP peer
/// stands). Never reads past the header.
pub async fn read(stream: &mut TcpStream) -> Result<Option<SocketAddr>, String> {
    let mut head = vec![0u8; 12];
    stream
        .read_exact(&mut head)
        .await
        .map_err(|e| e.to_string())?;
    if head == V2_SIGNATURE {
        let mut fixed = [0u8; 4];
        stream
            .read_exact(&mut fixed)
            .await
            .map_err(|e| e.to_string())?;
        head.extend_from_slice(&fixed);
        let len = usize::from(u16::from_be_bytes([fixed[2], fixed[3]]));
        let mut rest = vec![0u8; len];
        stream
            .read_exact(&mut rest)
            .await
            .map_err(|e| e.to_string())?;
        head.extend_from_slice(&rest);
    } else if head.starts_with(b"PROXY ") {
        while !head.ends_with(b"\r\n") {
            if head.len() >= V1_MAX {
                return Err("PROXY v1 line longer than 107 bytes".into());
            }
            head.push(stream.read_u8().await.map_err(|e| e.to_string())?);
        }
    } else {
        return Err("no PROXY protocol header".into());
    }
    source(&HeaderResult::parse(&head))
}

fn source(parsed: &HeaderResult<'_>) -> Result<Option<SocketAddr>, String> {
    match parsed {
        HeaderResult::V1(Ok(h)) => Ok(match h.addresses {
            v1::Addresses::Tcp4(a) => Some(SocketAddr::from((a.source_address, a.source_port))),
            v1::Addresses::Tcp6(a) => Some(SocketAddr::from((a.source_address, a.source_port))),
            v1::Addresses::Unknown => None,
        }),
        HeaderResult::V2(Ok(h)) => Ok(match (h.command, h.addresses) {
            (v2::Command::Local, _) => None,
            (_, v2::Addresses::IPv4(a)) => {
                Some(SocketAddr::from((a.source_address, a.source_port)))
            }
            (_, v2::Addresses::IPv6(a)) => {
                Some(SocketAddr::from((a.source_address, a.source_port)))
            }
            (_, _) => None,
        }),
        HeaderResult::V1(Err(e)) => Err(format!("bad PROXY v1 header: {e:?}")),
        HeaderResult::V2(Err(e)) => Err(format!("bad PROXY v2 header: {e:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    async fn roundtrip(header: &[u8]) -> (Result<Option<SocketAddr>, String>, Vec<u8>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut sent = header.to_vec();
        sent.extend_from_slice(b"GET / HTTP/1.1\r\n");
        let client = tokio::spawn(async move {
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.write_all(&sent).await.unwrap();
            c
        });
        let (mut s, _) = listener.accept().await.unwrap();
        let result = read(&mut s).await;
        let _c = client.await.unwrap();
        let mut rest = vec![0u8; 16];
        s.read_exact(&mut rest).await.unwrap();
        (result, rest)
    }

    #[tokio::test]
    async fn v1_and_v2_name_the_client_and_leave_the_request() {
        let (r, rest) = roundtrip(b"PROXY TCP4 192.0.2.7 198.51.100.1 56324 443\r\n").await;
        assert_eq!(r.unwrap(), Some("192.0.2.7:56324".parse().unwrap()));
        assert_eq!(rest, b"GET / HTTP/1.1\r\n");
        let v2 = v2::Builder::with_addresses(
            v2::Version::Two | v2::Command::Proxy,
            v2::Protocol::Stream,
            (
                "[2001:db8::7]:4711".parse::<SocketAddr>().unwrap(),
                "[2001:db8::1]:443".parse::<SocketAddr>().unwrap(),
            ),
        )
        .build()
        .unwrap();
        let (r, rest) = roundtrip(&v2).await;
        assert_eq!(r.unwrap(), Some("[2001:db8::7]:4711".parse().unwrap()));
        assert_eq!(rest, b"GET / HTTP/1.1\r\n");
        let (r, _) = roundtrip(b"PROXY UNKNOWN\r\n").await;
        assert_eq!(r.unwrap(), None);
    }

    #[tokio::test]
    async fn anything_else_is_refused() {
        let (r, _) = roundtrip(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(r.is_err());
    }
}
