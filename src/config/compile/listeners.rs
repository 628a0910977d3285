//! The `listeners` section: addresses, TLS certificates, timeouts and connection limits.

use std::collections::HashSet;
use std::time::Duration;

use super::{duration_or, parse_addr, values, Problems};
use crate::config::file;
use crate::config::settings::{Listener, ListenerSettings, TlsSettings};

pub(super) fn listeners(
    raw: &[file::Listener],
    positions: &[usize],
    p: &mut Problems,
) -> Vec<Listener> {
    let mut seen = HashSet::new();
    raw.iter()
        .enumerate()
        .filter_map(|(i, l)| {
            let i = positions.get(i).copied().unwrap_or(i);
            let address = p.take(format!("listeners[{i}].address"), parse_addr(&l.address))?;
            // Port 0 asks for a free port: two of them are two listeners.
            if address.port() != 0 && !seen.insert(address) {
                p.add(
                    format!("listeners[{i}].address"),
                    format!("`{address}` is listed twice"),
                );
            }
            let tls = l
                .tls
                .as_ref()
                .and_then(|t| tls(t, &format!("listeners[{i}].tls"), p));
            let settings = listener_settings(l, &format!("listeners[{i}]"), p);
            Some(Listener {
                address,
                tls,
                settings,
            })
        })
        .collect()
}

/// The listener's `timeouts` (header read, idle, TLS handshake, send), each longer than zero.
fn timeouts(
    l: &file::Listener,
    path: &str,
    p: &mut Problems,
    defaults: &ListenerSettings,
) -> [Duration; 4] {
    let timeouts = l.timeouts.as_ref();
    let mut timeout = |key: &str, raw: Option<&String>, default: Duration| {
        let value = duration_or(p, format!("{path}.timeouts.{key}"), raw, default);
        if value.is_zero() {
            p.add(format!("{path}.timeouts.{key}"), "must be longer than zero");
        }
        value
    };
    let header_read_timeout = timeout(
        "header_read",
        timeouts.and_then(|t| t.header_read.as_ref()),
        defaults.header_read_timeout,
    );
    let idle_timeout = timeout(
        "idle",
        timeouts.and_then(|t| t.idle.as_ref()),
        defaults.idle_timeout,
    );
    let tls_handshake_timeout = timeout(
        "tls_handshake",
        timeouts.and_then(|t| t.tls_handshake.as_ref()),
        defaults.tls_handshake_timeout,
    );
    let send_timeout = timeout(
        "send",
        timeouts.and_then(|t| t.send.as_ref()),
        defaults.send_timeout,
    );
    [
        header_read_timeout,
        idle_timeout,
        tls_handshake_timeout,
        send_timeout,
    ]
}

/// The listener's `http2` settings: the streams per connection, the stream and connection
/// windows, and the header list's size.
fn http2(l: &file::Listener, sizes: &mut Sizes<'_, '_>, defaults: &ListenerSettings) -> [u32; 4] {
    let h2 = l.http2.as_ref();
    [
        u32::try_from(sizes.count(
            "http2.max_concurrent_streams",
            h2.and_then(|h| h.max_concurrent_streams).map(u64::from),
            u64::from(defaults.h2_max_concurrent_streams),
        ))
        .unwrap_or(u32::MAX),
        sizes.window(
            "http2.stream_window",
            h2.and_then(|h| h.stream_window.as_ref()),
            u64::from(defaults.h2_stream_window),
        ),
        sizes.window(
            "http2.connection_window",
            h2.and_then(|h| h.connection_window.as_ref()),
            u64::from(defaults.h2_connection_window),
        ),
        sizes.window(
            "http2.max_header_list",
            h2.and_then(|h| h.max_header_list.as_ref()),
            u64::from(defaults.h2_max_header_list),
        ),
    ]
}

fn listener_settings(l: &file::Listener, path: &str, p: &mut Problems) -> ListenerSettings {
    let defaults = ListenerSettings::default();
    let [header_read_timeout, idle_timeout, tls_handshake_timeout, send_timeout] =
        timeouts(l, path, p, &defaults);
    let [h2_max_concurrent_streams, h2_stream_window, h2_connection_window, h2_max_header_list] =
        http2(l, &mut Sizes { path, p }, &defaults);
    let mut sizes = Sizes { path, p };
    ListenerSettings {
        header_read_timeout,
        idle_timeout,
        tls_handshake_timeout,
        send_timeout,
        max_connections: sizes.count(
            "max_connections",
            l.max_connections.map(|v| v as u64),
            defaults.max_connections as u64,
        ) as usize,
        max_requests_per_connection: sizes.count(
            "max_requests_per_connection",
            l.max_requests_per_connection,
            defaults.max_requests_per_connection,
        ),
        max_header_bytes: sizes.bytes(
            "max_header_bytes",
            l.max_header_bytes.as_ref(),
            defaults.max_header_bytes as u64,
            8192,
        ) as usize,
        max_headers: sizes.count(
            "max_headers",
            l.max_headers.map(|v| v as u64),
            defaults.max_headers as u64,
        ) as usize,
        max_uri_bytes: sizes.bytes(
            "max_uri_bytes",
            l.max_uri_bytes.as_ref(),
            defaults.max_uri_bytes as u64,
            64,
        ) as usize,
        h2_max_concurrent_streams,
        h2_stream_window,
        h2_connection_window,
        proxy_protocol: l.proxy_protocol,
        share_port: l.share_port,
        h2_max_header_list,
    }
}

const H2_MAX_WINDOW: u64 = (1 << 31) - 1;

/// Reads the size and count keys of one listener, reporting bad values under `path`.
struct Sizes<'a, 'b> {
    path: &'a str,
    p: &'b mut Problems,
}

impl Sizes<'_, '_> {
    fn bytes(&mut self, key: &str, raw: Option<&String>, default: u64, min: u64) -> u64 {
        let field = format!("{}.{key}", self.path);
        let value = raw
            .and_then(|s| self.p.take(field.clone(), values::size(s)))
            .unwrap_or(default);
        if value < min {
            self.p.add(field, format!("must be at least {min} bytes"));
        }
        value
    }

    /// An HTTP/2 window or list size: 1 KiB to 2^31-1 bytes (RFC 9113 6.9.1).
    fn window(&mut self, key: &str, raw: Option<&String>, default: u64) -> u32 {
        let value = self.bytes(key, raw, default, 1024);
        if value > H2_MAX_WINDOW {
            self.p.add(
                format!("{}.{key}", self.path),
                format!("must be at most {H2_MAX_WINDOW} bytes (2^31-1, the HTTP/2 limit)"),
            );
        }
        u32::try_from(value.min(H2_MAX_WINDOW)).unwrap_or(u32::MAX)
    }

    fn count(&mut self, key: &str, raw: Option<u64>, default: u64) -> u64 {
        if raw == Some(0) {
            self.p
                .add(format!("{}.{key}", self.path), "must be at least 1");
        }
        raw.unwrap_or(default).max(1)
    }
}

/// Load the listener's certificates now, so `check` and a reload catch a bad file.
pub(super) fn tls(t: &file::Tls, path: &str, p: &mut Problems) -> Option<TlsSettings> {
    let first = crate::tls::CertFiles {
        cert: t.cert.clone().into(),
        key: t.key.clone().into(),
    };
    let more = t.certificates.iter().map(|c| crate::tls::CertFiles {
        cert: c.cert.clone().into(),
        key: c.key.clone().into(),
    });
    let files: Vec<_> = std::iter::once(first).chain(more).collect();
    let (config, not_after) = p.take(
        path.to_owned(),
        crate::tls::server_config_and_expiry(&files),
    )?;
    Some(TlsSettings {
        files,
        config,
        not_after,
    })
}
