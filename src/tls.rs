//! TLS for listeners: a rustls server config built from PEM files, with certificates chosen by SNI.
//!
//! No request logic lives here. The config is built once per listener (and again on reload), so
//! all file reading, parsing and key checks happen at load time, and a broken file is reported
//! with its path before the listener ever serves a handshake with it.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use x509_parser::extensions::GeneralName;

/// One certificate chain and its key, as PEM file paths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Build the server TLS config for one listener: the first entry is the default certificate
/// (used when the client sends no SNI or an unknown name); every entry is also selected by SNI
/// for the DNS names (SANs, including wildcards like `*.example.com`) its certificate carries.
/// When two certificates carry the same name, the earlier entry wins. ALPN: h2, http/1.1.
pub fn server_config(certs: &[CertFiles]) -> Result<Arc<rustls::ServerConfig>, String> {
    // An explicit provider, so nothing depends on a process-wide default being installed (the
    // Redis client pulls rustls in too, and two installers would race).
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut resolver: Option<SniResolver> = None;
    for files in certs {
        let (key, names) = load(files, &provider)?;
        resolver
            .get_or_insert_with(|| SniResolver::new(Arc::clone(&key)))
            .add(&key, &names);
    }
    let resolver = resolver.ok_or("a TLS listener needs at least one certificate")?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("cannot set up TLS: {e}"))?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The handshake half of a listener, for the accept loop and tests.
pub fn acceptor(cfg: Arc<rustls::ServerConfig>) -> tokio_rustls::TlsAcceptor {
    tokio_rustls::TlsAcceptor::from(cfg)
}

/// Read one chain and key, check they belong together, and list the names the chain serves.
fn load(
    files: &CertFiles,
    provider: &CryptoProvider,
) -> Result<(Arc<CertifiedKey>, Vec<String>), String> {
    let (cert_path, key_path) = (files.cert.display(), files.key.display());
    let cert_pem = read(&files.cert, "certificate")?;
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("cannot parse certificate {cert_path}: {e}"))?;
    let leaf = chain
        .first()
        .ok_or_else(|| format!("no certificate in {cert_path}"))?;
    let names = dns_names(leaf).map_err(|e| format!("cannot parse certificate {cert_path}: {e}"))?;

    let key_pem = read(&files.key, "private key")?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| match e {
        // Encrypted keys land here too: their PEM label is not one of the three we accept.
        pem::Error::NoItemsFound => format!(
            "no private key found in {key_path} (expected an unencrypted PEM PKCS#8, RSA or EC key)"
        ),
        e => format!("cannot parse private key {key_path}: {e}"),
    })?;
    // from_der also compares the key's public half with the leaf's, so a mismatched pair fails
    // here rather than in every handshake.
    let certified = CertifiedKey::from_der(chain, key, provider).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => {
            format!("the key in {key_path} does not match the certificate in {cert_path}")
        }
        e => format!("cannot use the private key in {key_path}: {e}"),
    })?;
    Ok((Arc::new(certified), names))
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {what} {}: {e}", path.display()))
}

/// The DNS names in the certificate's subjectAltName, lowercased. The subject CN is ignored, as
/// browsers and rustls clients ignore it.
fn dns_names(cert: &CertificateDer<'_>) -> Result<Vec<String>, String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).map_err(|e| e.to_string())?;
    let Some(san) = parsed.subject_alternative_name().map_err(|e| e.to_string())? else {
        return Ok(Vec::new());
    };
    Ok(san
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::DNSName(dns) => Some(normalize(dns)),
            _ => None,
        })
        .collect())
}

/// DNS names compare case-insensitively, and a trailing root dot names the same host.
fn normalize(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// Picks a certificate by the client's SNI: exact name first, then a one-label wildcard, then the
/// listener's default.
#[derive(Debug)]
struct SniResolver {
    exact: HashMap<String, Arc<CertifiedKey>>,
    /// Keyed by the part after `*.`: `*.example.com` is stored as `example.com`.
    wildcard: HashMap<String, Arc<CertifiedKey>>,
    default: Arc<CertifiedKey>,
}

impl SniResolver {
    fn new(default: Arc<CertifiedKey>) -> Self {
        Self {
            exact: HashMap::new(),
            wildcard: HashMap::new(),
            default,
        }
    }

    fn add(&mut self, key: &Arc<CertifiedKey>, names: &[String]) {
        for name in names {
            let (map, name) = match name.strip_prefix("*.") {
                Some(parent) => (&mut self.wildcard, parent),
                None => (&mut self.exact, name.as_str()),
            };
            // or_insert: the first certificate listed for a name keeps it.
            map.entry(name.to_owned())
                .or_insert_with(|| Arc::clone(key));
        }
    }

    fn lookup(&self, server_name: Option<&str>) -> Arc<CertifiedKey> {
        let Some(name) = server_name else {
            return Arc::clone(&self.default);
        };
        // One small allocation per handshake, next to the handshake's own cost, buys a plain
        // HashMap lookup.
        let name = normalize(name);
        let wildcard = || {
            let (_, parent) = name.split_once('.')?;
            self.wildcard.get(parent)
        };
        Arc::clone(
            self.exact
                .get(&name)
                .or_else(wildcard)
                .unwrap_or(&self.default),
        )
    }
}

impl ResolvesServerCert for SniResolver {
    fn resolve(&self, client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.lookup(client_hello.server_name()))
    }
}
