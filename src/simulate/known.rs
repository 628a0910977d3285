//! What a logged request tells of each identity source: its value, its absence, or nothing
//! (the line does not log it), and the bucket key a limit's `key` gives from that.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::net::IpAddr;

use http::Request;

use super::line::Record;
use crate::identity::logged::{self, Logged};
use crate::identity::{self, ClientId, Exemption, KeySpec, Source};

/// One source of a logged request.
#[derive(Debug, PartialEq, Eq)]
pub enum Value<'a> {
    Present(Cow<'a, [u8]>),
    Absent,
    /// The line does not log this source.
    Unknown,
}

/// A logged request, routed: its screened request (host and path in the form the live
/// limits read) and its line.
#[derive(Debug)]
pub struct Known<'a> {
    pub rec: &'a Record,
    pub req: &'a Request<()>,
    /// The route compares paths without case: its limits read the path lower-cased.
    pub fold_path: bool,
}

impl<'a> Known<'a> {
    fn value(&self, source: &Source) -> Value<'a> {
        let present = |v: Cow<'a, [u8]>| {
            if v.is_empty() {
                Value::Absent
            } else {
                Value::Present(v)
            }
        };
        match source {
            Source::Ip(prefix) => match self.rec.client {
                Some(ip) => Value::Present(Cow::Owned(ip_octets(ip, *prefix))),
                None => Value::Unknown,
            },
            Source::Global => Value::Present(Cow::Borrowed(b"global")),
            Source::Method => present(Cow::Owned(self.req.method().as_str().as_bytes().to_vec())),
            Source::Host => match identity::host(self.req.uri(), self.req.headers()) {
                Some(h) => present(Cow::Owned(h.to_ascii_lowercase().into_bytes())),
                None => Value::Absent,
            },
            Source::Path => {
                let path = identity::without_trailing_slash(self.req.uri().path());
                let path = if self.fold_path {
                    path.to_ascii_lowercase()
                } else {
                    path.to_owned()
                };
                present(Cow::Owned(path.into_bytes()))
            }
            Source::Header(_)
            | Source::Query(_)
            | Source::Cookie(_)
            | Source::Bearer
            | Source::Jwt(_) => match self.rec.key(&source.to_string()) {
                Logged::Digest(d) => Value::Present(Cow::Owned(d.to_be_bytes().to_vec())),
                Logged::Absent => Value::Absent,
                Logged::Unknown => Value::Unknown,
            },
        }
    }

    /// The identity `spec` gives this request, with the alternative that gave it (`None`:
    /// the anonymous bucket); `Err` names a source the line does not log.
    pub fn resolve(&self, spec: &KeySpec) -> Result<(ClientId, Option<usize>), Source> {
        'alternatives: for (i, alt) in spec.0.iter().enumerate() {
            let mut h = blake3::Hasher::new();
            h.update(&[i as u8]);
            for source in &alt.0 {
                match self.value(source) {
                    Value::Present(v) => {
                        let name = source.to_string();
                        h.update(&(name.len() as u64).to_le_bytes());
                        h.update(name.as_bytes());
                        h.update(&(v.len() as u64).to_le_bytes());
                        h.update(&v);
                    }
                    Value::Absent => continue 'alternatives,
                    Value::Unknown => return Err(source.clone()),
                }
            }
            let mut first = [0u8; 16];
            first.copy_from_slice(&h.finalize().as_bytes()[..16]);
            return Ok((ClientId(u128::from_be_bytes(first)), Some(i)));
        }
        Ok((ClientId::anonymous(), None))
    }

    /// Whether an entry of `exempt` holds; `Err` names a source the line does not log.
    pub fn is_exempt(&self, exempt: &[Exemption]) -> Result<bool, Source> {
        for e in exempt {
            let holds = match e {
                Exemption::Net(net) => match self.rec.client {
                    Some(ip) => net.contains(&ip),
                    None => return Err(Source::Ip(128)),
                },
                Exemption::Equals(source, want) => match self.value(source) {
                    Value::Present(v) if logged::is_logged(source) => {
                        *v == logged::digest(want.as_bytes()).to_be_bytes()
                    }
                    Value::Present(v) => *v == *want.as_bytes(),
                    Value::Absent => false,
                    Value::Unknown => return Err(source.clone()),
                },
            };
            if holds {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// How the identity of alternative `alt` of `spec` reads in a report: the address, host,
    /// method or path as logged, a digest prefix for what the log holds only as a digest.
    pub fn label(&self, spec: &KeySpec, alt: Option<usize>) -> String {
        let Some(alt) = alt.and_then(|i| spec.0.get(i)) else {
            return "anonymous".to_owned();
        };
        let parts: Vec<String> = alt
            .0
            .iter()
            .map(|source| match (source, self.value(source)) {
                (Source::Global, _) => "global".to_owned(),
                (Source::Ip(prefix), _) => match self.rec.client {
                    Some(IpAddr::V6(v6)) if *prefix < 128 => {
                        let bits = u128::from(v6) & mask(*prefix);
                        format!("ip={}/{prefix}", std::net::Ipv6Addr::from(bits))
                    }
                    Some(ip) => format!("ip={}", ip.to_canonical()),
                    None => "ip=?".to_owned(),
                },
                (s, Value::Present(v)) if logged::is_logged(s) => {
                    let mut label = format!("{s}=");
                    for b in v.iter() {
                        let _ = write!(label, "{b:02x}");
                    }
                    label
                }
                (s, Value::Present(v)) => format!("{s}={}", String::from_utf8_lossy(&v)),
                (s, _) => format!("{s}=?"),
            })
            .collect();
        parts.join("+")
    }
}

fn mask(prefix: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0)
}

/// The address as the `ip` source counts it: IPv4 whole, IPv6 cut to `prefix` bits.
fn ip_octets(ip: IpAddr, prefix: u8) -> Vec<u8> {
    match ip.to_canonical() {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => (u128::from(v6) & mask(prefix)).to_be_bytes().to_vec(),
    }
}
