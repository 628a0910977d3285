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

/// `server_config_and_expiry` without the expiry.
#[cfg(test)]
pub fn server_config(certs: &[CertFiles]) -> Result<Arc<rustls::ServerConfig>, String> {
    server_config_and_expiry(certs).map(|(config, _)| config)
}

/// Build the server TLS config for one listener: the first entry is the default certificate
/// (used when the client sends no SNI or an unknown name); every entry is also selected by SNI
/// for the DNS names (SANs, including wildcards like `*.example.com`) its certificate carries.
/// When two certificates carry the same name, the earlier entry wins. ALPN: h2, http/1.1.
///
/// Also returns when each entry's leaf certificate expires (its `notAfter`, in seconds since
/// the Unix epoch), in order, for `/metrics`.
pub fn server_config_and_expiry(
    certs: &[CertFiles],
) -> Result<(Arc<rustls::ServerConfig>, Vec<i64>), String> {
    // An explicit provider: with more than one compiled in (any dependency may enable one),
    // `ServerConfig::builder()` panics unless a process-wide default was installed first.
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut resolver: Option<SniResolver> = None;
    let mut expiry = Vec::with_capacity(certs.len());
    for files in certs {
        let (key, names) = load(files, &provider)?;
        expiry.push(key.end_entity_cert().map_or(0, not_after));
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
    Ok((Arc::new(config), expiry))
}

/// The certificate's `notAfter`, in seconds since the Unix epoch (0 if it cannot be parsed,
/// which `load` has ruled out).
fn not_after(cert: &CertificateDer<'_>) -> i64 {
    x509_parser::parse_x509_certificate(cert)
        .map_or(0, |(_, parsed)| parsed.validity().not_after.timestamp())
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
        .map_err(|e| format!("cannot parse certificate {cert_path}: {}", pem_problem(&e)))?;
    let leaf = chain
        .first()
        .ok_or_else(|| format!("no certificate in {cert_path}"))?;
    let names =
        dns_names(leaf).map_err(|e| format!("cannot parse certificate {cert_path}: {e}"))?;

    let key_pem = read(&files.key, "private key")?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| match e {
        // Encrypted keys land here too: their PEM label is not one of the three we accept.
        pem::Error::NoItemsFound => format!(
            "no private key found in {key_path} (expected an unencrypted PEM PKCS#8, RSA or EC key)"
        ),
        e => format!("cannot parse private key {key_path}: {}", pem_problem(&e)),
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

/// pem::Error's own Display prints markers as byte arrays; say it in words.
fn pem_problem(e: &pem::Error) -> String {
    match e {
        pem::Error::MissingSectionEnd { end_marker } => format!(
            "the {} section has no END line",
            String::from_utf8_lossy(end_marker)
        ),
        pem::Error::IllegalSectionStart { line } => {
            format!("malformed BEGIN line {:?}", String::from_utf8_lossy(line))
        }
        pem::Error::Base64Decode(detail) => format!("invalid base64 ({detail})"),
        e => e.to_string(),
    }
}

/// The DNS names in the certificate's subjectAltName, lowercased. The subject CN is ignored, as
/// browsers and rustls clients ignore it.
fn dns_names(cert: &CertificateDer<'_>) -> Result<Vec<String>, String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).map_err(|e| e.to_string())?;
    let Some(san) = parsed
        .subject_alternative_name()
        .map_err(|e| e.to_string())?
    else {
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

/// The TLS client settings for https upstreams: the system's roots, or only the CA in `ca`.
pub fn client_config(ca: Option<&std::path::Path>) -> Result<Arc<rustls::ClientConfig>, String> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| format!("cannot read CA file {}: {e}", path.display()))?;
            for cert in certs {
                let cert =
                    cert.map_err(|e| format!("cannot parse CA file {}: {e}", path.display()))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("unusable CA certificate in {}: {e}", path.display()))?;
            }
            if roots.is_empty() {
                return Err(format!("no certificate in CA file {}", path.display()));
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(native.certs);
            if added == 0 {
                tracing::warn!("no system CA certificates found: https upstreams need `tls.ca`");
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::client::WebPkiServerVerifier;
    use rustls::pki_types::{ServerName, UnixTime};
    use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
    use std::net::SocketAddr;
    use std::sync::Mutex;
    use tokio::net::{TcpListener, TcpStream};
    use x509_parser::prelude::FromDer;

    /// Throwaway test keys (openssl genrsa -traditional / ecparam -noout), kept in their PKCS#1
    /// and SEC1 PEM forms because rcgen on ring can only generate and write PKCS#8.
    const RSA_PKCS1: &str = concat!(
        "-----BEGIN RSA PRIVATE KEY-----\n",
        "MIIEpAIBAAKCAQEAoDvV46A/fcdvBGXjRdDLewcjiaC/oJgTikZZXbr33bLlnWQO\n",
        "bKZDCYoAlA9OWcuYQzpoC4A6QLi+M17/sh7ZomVtuFarXh/KqIzoxsYHGJWc11s+\n",
        "XDjz0rCJpXB5FI4i5NBaNW2448sYcaxV8L9sgsU3tqdJpqP+d5lVUIy60Eyir1A+\n",
        "I8WPyDmyHjSGyHxnOdLt/06sR8sAWjrxwc4VLR8r1JPyz9SHcW92j2FTkQv9s7TO\n",
        "tWacDC5SjGdJn5Uf29rBoiBPwMXSax+Ww4TaIsOKcD05P71pAF/r/nJOVuMw5tWU\n",
        "qcRH7Zbl5qDMcWJwavLSdwlj0wRpADGYKEsXYQIDAQABAoIBAAGNv6Uidm0k/NBI\n",
        "So3whcGV6Wf+AQUDe9MwMOaFan5UhqYUxzBHOYYPQnz3tpxNABHnpYRriCe89ttY\n",
        "Xz66GSUvn4137yyqvqAtO3ED0MQB8uHHyhJH5dgv7f9r/dY81YJ+G/V8dfG6WYdE\n",
        "Jazvq+jgdPnnyTwPvJG1W5q8E5q96I1Hw4AG/DybUDhA53n4s0H1thKz1F0MnmpE\n",
        "Sod/h6Dmc2hxhW/uhBsN27fCFFB5znxu6cgMXe1b7MN9j1nVVdVMzhNE8H4f3jrw\n",
        "RMj1GQtu4E7CQysgAyS6w89294uqcYOS/uh2dI0BuRIHlpbU9cNIEIzLztWoCD1O\n",
        "U5poGQECgYEA3EoTL1vv0sC1PbQjfsYa0Xr0t/VMfd1DAKV1BdVWw5HbXqnDeyrD\n",
        "OyX8sK4ZrG6YHX90/DTlj+yZQy/W8ZQ2RvWSNeFSull+pBVIv0shJKndUbEgPZmG\n",
        "knA6mC4oAdXu+sOJ4AhjwQbQ6L0UurN9YeT4xfvJOU6zb+X905OefeECgYEAujV5\n",
        "krIwFnDZiJJVsOKgvUkut3RXGtWpaEyQFu2tDle7J5K6BfGcOyuyYVK4fvhw2mAV\n",
        "IoY37IjrOllew/dSMPWJLWYKFMcRmArtWlq362hUoVkbN1262t0GiRtItV/u9fge\n",
        "xTBgCwqvKdoY80RMqtslu6qRE7YyamAlFXeYyYECgYEAgv1hLxYiI1YH76sAOFAg\n",
        "flP41LJ+S5GYV/gK/+796sj+gum7na+t66wI+B5ukcQpm9DAhYAGyXBNKlB2JayW\n",
        "IdfAm11izgCNd5BYc7d++8guHHeQzlBOXyFxFjDMBVtrAZ3ojFkwyAT/kIVuoB4+\n",
        "/kkjTMcNvo/3zyAZsQfkhMECgYEApD+nDQ6//Atu1li93VkKD+0NmCS28KSm2akv\n",
        "MApWK+CW5UE3dSa5eDgDEHW258idQwKdoeZiTfI4Cy/pt1Hg3e63IaRwIAO4MTTy\n",
        "SFDdCnjsraW7rAqxV3y+1xGKAPKuBajm+2jATv0NpQ0MFQiZ19uWXQMHFSwRLGPC\n",
        "Uj08OAECgYBF6XCaAwWaYc9WydkxRUc2mOlltvF34PfqVkGE5B2cL2YByxjPmPD0\n",
        "P2aCYaRNjJTJ/unj02kQthdXTstW0DN1fQPMdQMxz54We2kFctZDZvquDVEuJwMC\n",
        "EfM8MIm7ERvjgLxWVgFGwNludoy2MsnV3m6mwnxkzoqulvHeKxPIGQ==\n",
        "-----END RSA PRIVATE KEY-----\n",
    );
    const EC_SEC1: &str = concat!(
        "-----BEGIN EC PRIVATE KEY-----\n",
        "MHcCAQEEIGERBeJIqJliJ+2bdKGhkOt+kq2n37UJU0EetobSbchToAoGCCqGSM49\n",
        "AwEHoUQDQgAEO+KhTJNJ0eRL2/NsGxC2pMKM/kuXwBYQGM01IzQtx8z20reSjfau\n",
        "7xyxIYiMN8Edeu5pbmxl18S2Bfr0UW4aqA==\n",
        "-----END EC PRIVATE KEY-----\n",
    );

    struct Pem {
        cert: String,
        key: String,
    }

    impl Pem {
        fn der(&self) -> CertificateDer<'static> {
            CertificateDer::from_pem_slice(self.cert.as_bytes()).unwrap()
        }
    }

    fn params(names: &[&str]) -> rcgen::CertificateParams {
        rcgen::CertificateParams::new(names.iter().map(ToString::to_string).collect::<Vec<_>>())
            .unwrap()
    }

    fn generated(alg: &'static rcgen::SignatureAlgorithm, names: &[&str]) -> Pem {
        let key = rcgen::KeyPair::generate_for(alg).unwrap();
        let cert = params(names).self_signed(&key).unwrap();
        Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    /// Lets rcgen sign with a PKCS#1 or SEC1 key, which it cannot load on ring, through rustls.
    struct Foreign {
        signer: Box<dyn rustls::sign::Signer>,
        public: Vec<u8>,
        alg: &'static rcgen::SignatureAlgorithm,
    }

    impl rcgen::PublicKeyData for Foreign {
        fn der_bytes(&self) -> &[u8] {
            &self.public
        }
        fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
            self.alg
        }
    }

    impl rcgen::SigningKey for Foreign {
        fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
            self.signer
                .sign(msg)
                .map_err(|_| rcgen::Error::RemoteKeyError)
        }
    }

    fn with_key(
        key_pem: &str,
        scheme: SignatureScheme,
        alg: &'static rcgen::SignatureAlgorithm,
        names: &[&str],
    ) -> Pem {
        let der = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).unwrap();
        let key = rustls::crypto::ring::sign::any_supported_type(&der).unwrap();
        let spki = key.public_key().unwrap();
        let (_, info) = x509_parser::x509::SubjectPublicKeyInfo::from_der(&spki).unwrap();
        let public = info.subject_public_key.data.to_vec();
        let signer = key.choose_scheme(&[scheme]).unwrap();
        let cert = params(names)
            .self_signed(&Foreign {
                signer,
                public,
                alg,
            })
            .unwrap();
        Pem {
            cert: cert.pem(),
            key: key_pem.to_owned(),
        }
    }

    fn write(dir: &Path, name: &str, pem: &Pem) -> CertFiles {
        let files = CertFiles {
            cert: dir.join(format!("{name}.crt")),
            key: dir.join(format!("{name}.key")),
        };
        std::fs::write(&files.cert, &pem.cert).unwrap();
        std::fs::write(&files.key, &pem.key).unwrap();
        files
    }

    async fn serve(cfg: Arc<rustls::ServerConfig>) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = acceptor(cfg);
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move { acceptor.accept(tcp).await });
            }
        });
        addr
    }

    /// Verifies like a real client against `trusted`, and remembers which certificate the server
    /// presented, even when verification then fails (an unknown name gets the default).
    #[derive(Debug)]
    struct Recorder {
        inner: Arc<WebPkiServerVerifier>,
        seen: Mutex<Option<CertificateDer<'static>>>,
    }

    impl ServerCertVerifier for Recorder {
        fn verify_server_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            intermediates: &[CertificateDer<'_>],
            server_name: &ServerName<'_>,
            ocsp: &[u8],
            now: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            *self.seen.lock().unwrap() = Some(end_entity.clone().into_owned());
            self.inner
                .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        }
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.inner.verify_tls12_signature(message, cert, dss)
        }
        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.inner.verify_tls13_signature(message, cert, dss)
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.inner.supported_verify_schemes()
        }
    }

    struct Outcome {
        /// The negotiated ALPN protocol, or the handshake error.
        alpn: std::io::Result<Option<Vec<u8>>>,
        presented: Option<CertificateDer<'static>>,
    }

    /// A real handshake over loopback. An IP address as `sni` sends no SNI at all.
    async fn connect(addr: SocketAddr, trusted: &[&Pem], sni: &str, alpn: &[&[u8]]) -> Outcome {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        for pem in trusted {
            roots.add(pem.der()).unwrap();
        }
        let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .unwrap();
        let recorder = Arc::new(Recorder {
            inner,
            seen: Mutex::default(),
        });
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(recorder.clone())
            .with_no_client_auth();
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = ServerName::try_from(sni.to_owned()).unwrap();
        let alpn = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(name, tcp)
            .await
            .map(|tls| tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec));
        let presented = recorder.seen.lock().unwrap().take();
        Outcome { alpn, presented }
    }

    const BOTH: &[&[u8]] = &[b"h2", b"http/1.1"];

    #[tokio::test]
    async fn sni_picks_the_certificate_and_unknown_names_get_the_default() {
        let dir = tempfile::tempdir().unwrap();
        let a = generated(&rcgen::PKCS_ECDSA_P256_SHA256, &["a.test"]);
        let b = generated(&rcgen::PKCS_ECDSA_P256_SHA256, &["*.b.test"]);
        let (fa, fb) = (write(dir.path(), "a", &a), write(dir.path(), "b", &b));
        let addr = serve(server_config(&[fa.clone(), fb.clone()]).unwrap()).await;
        let trusted = [&a, &b];

        for (sni, want) in [("a.test", &a), ("x.b.test", &b), ("X.B.Test", &b)] {
            let out = connect(addr, &trusted, sni, BOTH).await;
            assert!(out.alpn.is_ok(), "{sni}: {:?}", out.alpn);
            assert_eq!(out.presented, Some(want.der()), "{sni}");
        }
        // The wildcard covers exactly one label; everything else falls back to the first entry.
        for sni in ["unknown.test", "b.test", "y.x.b.test", "127.0.0.1"] {
            let out = connect(addr, &trusted, sni, BOTH).await;
            assert_eq!(out.presented, Some(a.der()), "{sni}");
        }

        let addr = serve(server_config(&[fb, fa]).unwrap()).await;
        let out = connect(addr, &trusted, "unknown.test", BOTH).await;
        assert_eq!(
            out.presented,
            Some(b.der()),
            "the first entry is the default"
        );
    }

    #[tokio::test]
    async fn alpn_prefers_h2_and_falls_back_to_http1() {
        let dir = tempfile::tempdir().unwrap();
        let a = generated(&rcgen::PKCS_ECDSA_P256_SHA256, &["a.test"]);
        let addr = serve(server_config(&[write(dir.path(), "a", &a)]).unwrap()).await;
        for (offered, want) in [
            (BOTH, Some(&b"h2"[..])),
            (&[&b"http/1.1"[..]][..], Some(&b"http/1.1"[..])),
            (&[][..], None),
        ] {
            let out = connect(addr, &[&a], "a.test", offered).await;
            assert_eq!(out.alpn.unwrap().as_deref(), want);
        }
    }

    #[tokio::test]
    async fn every_key_format_completes_a_handshake() {
        let dir = tempfile::tempdir().unwrap();
        let names = &["k.test"];
        let keys = [
            (
                "PRIVATE KEY",
                generated(&rcgen::PKCS_ECDSA_P256_SHA256, names),
            ),
            (
                "PRIVATE KEY",
                generated(&rcgen::PKCS_ECDSA_P384_SHA384, names),
            ),
            ("PRIVATE KEY", generated(&rcgen::PKCS_ED25519, names)),
            (
                "RSA PRIVATE KEY",
                with_key(
                    RSA_PKCS1,
                    SignatureScheme::RSA_PKCS1_SHA256,
                    &rcgen::PKCS_RSA_SHA256,
                    names,
                ),
            ),
            (
                "EC PRIVATE KEY",
                with_key(
                    EC_SEC1,
                    SignatureScheme::ECDSA_NISTP256_SHA256,
                    &rcgen::PKCS_ECDSA_P256_SHA256,
                    names,
                ),
            ),
        ];
        for (i, (label, pem)) in keys.iter().enumerate() {
            assert!(pem.key.starts_with(&format!("-----BEGIN {label}-----")));
            let addr =
                serve(server_config(&[write(dir.path(), &i.to_string(), pem)]).unwrap()).await;
            let out = connect(addr, &[pem], "k.test", BOTH).await;
            assert!(out.alpn.is_ok(), "key {i} ({label}): {:?}", out.alpn);
            assert_eq!(out.presented, Some(pem.der()), "key {i}");
        }
    }

    #[test]
    fn errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let a = write(
            dir.path(),
            "a",
            &generated(&rcgen::PKCS_ECDSA_P256_SHA256, &["a.test"]),
        );
        let b = write(
            dir.path(),
            "b",
            &generated(&rcgen::PKCS_ED25519, &["b.test"]),
        );
        let missing = dir.path().join("missing.pem");
        let err = |cert: &Path, key: &Path| {
            let files = CertFiles {
                cert: cert.to_owned(),
                key: key.to_owned(),
            };
            server_config(&[files]).unwrap_err()
        };
        let (ac, ak, bk) = (a.cert.display(), a.key.display(), b.key.display());
        let m = missing.display();

        assert!(err(&missing, &a.key).starts_with(&format!("cannot read certificate {m}: ")));
        assert!(err(&a.cert, &missing).starts_with(&format!("cannot read private key {m}: ")));
        assert!(err(&a.cert, &a.cert).starts_with(&format!("no private key found in {ac} ")));
        assert_eq!(err(&a.key, &a.key), format!("no certificate in {ak}"));
        assert_eq!(
            err(&a.cert, &b.key),
            format!("the key in {bk} does not match the certificate in {ac}")
        );
        std::fs::write(&missing, "-----BEGIN CERTIFICATE-----\nnot base64!\n").unwrap();
        assert!(err(&missing, &a.key).starts_with(&format!("cannot parse certificate {m}: ")));
        assert!(server_config(&[])
            .unwrap_err()
            .contains("at least one certificate"));
    }
}
