//! Optional mutual TLS between nodes (rustls with the *ring* provider), on the epoll driver.
//!
//! TLS sits between the socket and a connection's protocol state machine, which never knows:
//! the driver reads ciphertext into the rustls session and hands the decrypted bytes to the
//! connection's read targets; the connection's outgoing slices go into the session's writer
//! and its records to the socket (`epoll.rs`).
//!
//! Trust is the cluster: every node presents a certificate chained to the cluster CA
//! (`security.ssl.internal.ca-file`) and verifies its peer's against that CA, in both
//! directions. Nodes are addressed by IP, and addresses change (containers, `0.0.0.0` binds),
//! so a consumer does not check its producer's certificate against the address it dialled;
//! it checks it against one fixed cluster name (`security.ssl.internal.server-name`, default
//! [`DEFAULT_SSL_SERVER_NAME`]), which every node certificate carries as a DNS subject
//! alternative name. The CA is the cluster's own: whatever it signed is a node. Producers do
//! not check a name on consumers' certificates (client certificates have none to check),
//! only the chain.
//!
//! [`ClusterCa`] makes such a CA and node certificates (the tests and `fluxgate tls-certs`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{AlertDescription, RootCertStore};

use crate::config::NetworkConfig;
pub use crate::config::DEFAULT_SSL_SERVER_NAME;

/// Most TLS bytes one connection's session holds on their way out. Plaintext goes into the
/// session only while its outgoing records are below this, so a peer that stops reading
/// holds this much per connection, no more (the protocol's own queue is bounded besides).
pub(crate) const OUTGOING_TLS_LIMIT: usize = 64 * 1024;

/// Most decrypted bytes a session holds before the driver takes them (rustls's limit).
pub(crate) const RECEIVED_PLAINTEXT_LIMIT: usize = 16 * 1024;

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TlsError {
    /// TLS is on and a file option is not set.
    #[error("TLS is on (security.ssl.internal.enabled) but `{0}` is not set")]
    MissingOption(&'static str),
    /// A PEM file could not be read or parsed.
    #[error("cannot read the {what} from {path}: {reason}")]
    Unreadable {
        /// What the file should hold.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O or PEM error.
        reason: String,
    },
    /// A PEM file holds no item of the kind expected.
    #[error("{path} holds no {what}")]
    Empty {
        /// What the file should hold.
        what: &'static str,
        /// The file.
        path: PathBuf,
    },
    /// rustls refused the certificates or key (e.g. the key does not match the certificate).
    #[error("TLS configuration refused: {0}")]
    Refused(String),
    /// Generating a certificate failed.
    #[error("generating a certificate failed: {0}")]
    Generate(String),
    /// Writing a generated file failed.
    #[error("cannot write {path}: {reason}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        reason: String,
    },
}

/// The TLS settings of one process: the rustls configurations of both sides of its
/// connections, loaded once at start.
#[derive(Clone)]
pub struct TlsContext {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
    server_name: ServerName<'static>,
    handshake_timeout: Duration,
}

impl fmt::Debug for TlsContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsContext")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl TlsContext {
    /// The context `config` describes: `None` when `security.ssl.internal.enabled` is off;
    /// an error when it is on and a file is missing, unreadable or refused.
    pub fn from_config(config: &NetworkConfig) -> Result<Option<Self>, TlsError> {
        if !config.ssl_enabled {
            return Ok(None);
        }
        let required =
            |file: &Option<PathBuf>, key| file.clone().ok_or(TlsError::MissingOption(key));
        let cert_file = required(&config.ssl_cert_file, "security.ssl.internal.cert-file")?;
        let key_file = required(&config.ssl_key_file, "security.ssl.internal.key-file")?;
        let ca_file = required(&config.ssl_ca_file, "security.ssl.internal.ca-file")?;
        let chain = load_certificates(&cert_file, "certificate chain")?;
        let key =
            PrivateKeyDer::from_pem_file(&key_file).map_err(|error| TlsError::Unreadable {
                what: "private key",
                path: key_file.clone(),
                reason: error.to_string(),
            })?;
        let mut roots = RootCertStore::empty();
        for ca in load_certificates(&ca_file, "CA certificate")? {
            roots
                .add(ca)
                .map_err(|error| TlsError::Refused(format!("{}: {error}", ca_file.display())))?;
        }
        let server_name = ServerName::try_from(config.ssl_server_name.clone())
            .map_err(|error| TlsError::Refused(format!("server name: {error}")))?;
        Self::new(chain, key, roots, server_name, config.ssl_handshake_timeout)
            .map(Some)
            .map_err(|error| TlsError::Refused(error.to_string()))
    }

    fn new(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        roots: RootCertStore,
        server_name: ServerName<'static>,
        handshake_timeout: Duration,
    ) -> Result<Self, rustls::Error> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = Arc::new(roots);
        let client_verifier =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
                .build()
                .map_err(|error| rustls::Error::General(error.to_string()))?;
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(chain.clone(), key.clone_key())?;
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)?;
        Ok(Self {
            server: Arc::new(server),
            client: Arc::new(client),
            server_name,
            handshake_timeout,
        })
    }

    /// Longest a handshake may take (`security.ssl.internal.handshake-timeout`).
    pub(crate) fn handshake_timeout(&self) -> Duration {
        self.handshake_timeout
    }

    /// A session for a connection this node opened (it consumes).
    pub(crate) fn client_session(&self) -> Result<rustls::Connection, rustls::Error> {
        let mut session =
            rustls::ClientConnection::new(self.client.clone(), self.server_name.clone())?;
        session.set_buffer_limit(Some(OUTGOING_TLS_LIMIT));
        Ok(session.into())
    }

    /// A session for a connection this node accepted (it produces).
    pub(crate) fn server_session(&self) -> Result<rustls::Connection, rustls::Error> {
        let mut session = rustls::ServerConnection::new(self.server.clone())?;
        session.set_buffer_limit(Some(OUTGOING_TLS_LIMIT));
        Ok(session.into())
    }
}

fn load_certificates(
    path: &Path,
    what: &'static str,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let unreadable = |reason: String| TlsError::Unreadable {
        what,
        path: path.to_owned(),
        reason,
    };
    let certificates = CertificateDer::pem_file_iter(path)
        .map_err(|error| unreadable(error.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| unreadable(error.to_string()))?;
    if certificates.is_empty() {
        return Err(TlsError::Empty {
            what,
            path: path.to_owned(),
        });
    }
    Ok(certificates)
}

/// Whether a TLS failure says the peer's (or our) certificate was not accepted: the peer is
/// not a node of this cluster, or we are not one of its. Other failures (garbage bytes, a
/// plain-TCP peer, a broken record) are transport failures.
pub(crate) fn is_identity_failure(error: &rustls::Error) -> bool {
    matches!(
        error,
        rustls::Error::InvalidCertificate(_)
            | rustls::Error::NoCertificatesPresented
            | rustls::Error::AlertReceived(
                AlertDescription::BadCertificate
                    | AlertDescription::UnknownCA
                    | AlertDescription::CertificateRequired
                    | AlertDescription::CertificateUnknown
                    | AlertDescription::CertificateExpired
                    | AlertDescription::CertificateRevoked
                    | AlertDescription::UnsupportedCertificate
                    | AlertDescription::AccessDenied
                    // What rustls sends for a certificate whose signature does not verify
                    // (one from another CA of the same name) or an unsupported signature
                    // algorithm; otherwise only a Finished message that does not verify,
                    // a handshake that was tampered with.
                    | AlertDescription::DecryptError
            )
    )
}

/// A certificate and its private key, PEM-encoded.
#[derive(Clone)]
pub struct PemPair {
    /// The certificate.
    pub cert_pem: String,
    /// Its private key (PKCS#8).
    pub key_pem: String,
}

impl fmt::Debug for PemPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key stays out of logs.
        f.debug_struct("PemPair").finish_non_exhaustive()
    }
}

/// A certificate authority for one cluster's nodes (for tests, benchmarks and small
/// deployments; `fluxgate tls-certs` writes one). ECDSA P-256 keys.
pub struct ClusterCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: PemPair,
}

impl fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

impl ClusterCa {
    /// A fresh self-signed CA named `common_name`.
    pub fn generate(common_name: &str) -> Result<Self, TlsError> {
        let generate = |error: rcgen::Error| TlsError::Generate(error.to_string());
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(generate)?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, common_name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let key = rcgen::KeyPair::generate().map_err(generate)?;
        let cert = params.self_signed(&key).map_err(generate)?;
        let pem = PemPair {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        };
        Ok(Self {
            issuer: rcgen::Issuer::new(params, key),
            pem,
        })
    }

    /// The CA's certificate and key.
    pub fn pem(&self) -> &PemPair {
        &self.pem
    }

    /// A node certificate named `common_name`, valid for `server_name` (a DNS subject
    /// alternative name) as both a TLS server and a TLS client.
    pub fn issue_node(&self, common_name: &str, server_name: &str) -> Result<PemPair, TlsError> {
        let generate = |error: rcgen::Error| TlsError::Generate(error.to_string());
        let mut params =
            rcgen::CertificateParams::new(vec![server_name.to_owned()]).map_err(generate)?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, common_name);
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = rcgen::KeyPair::generate().map_err(generate)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(generate)?;
        Ok(PemPair {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// The files [`write_cluster_files`] wrote.
#[derive(Clone, Debug)]
pub struct ClusterFiles {
    /// The CA certificate (`security.ssl.internal.ca-file` of every node).
    pub ca_file: PathBuf,
    /// The CA's private key (keep it off the nodes; it issues more node certificates).
    pub ca_key_file: PathBuf,
    /// Per node: its certificate and key files (`security.ssl.internal.cert-file`,
    /// `security.ssl.internal.key-file`).
    pub nodes: Vec<(PathBuf, PathBuf)>,
}

/// Writes a fresh cluster CA (`ca.pem`, `ca-key.pem`) and `nodes` node certificates
/// (`node-I.pem`, `node-I-key.pem`) valid for `server_name` into `dir` (created if missing).
/// Private keys are written readable by their owner only.
pub fn write_cluster_files(
    dir: &Path,
    nodes: usize,
    server_name: &str,
) -> Result<ClusterFiles, TlsError> {
    let write = |name: &str, contents: &str, private: bool| -> Result<PathBuf, TlsError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(name);
        let failed = |error: std::io::Error| TlsError::Write {
            path: path.clone(),
            reason: error.to_string(),
        };
        // Into a file of its own, made here with its mode (never one left by an earlier run or
        // planted by another user: its mode, its open descriptors, or a link to elsewhere would
        // let others read the key), then renamed over the name: the name's old file, link or
        // not, is only unlinked.
        // The mode is set again once open: the process's umask may have narrowed it (a
        // certificate others must read). Synced before the rename, so that a crash never
        // leaves the name holding a partly written key.
        let mode = if private { 0o600 } else { 0o644 };
        let fresh = dir.join(format!(".{name}.{}.tmp", std::process::id()));
        let _ = std::fs::remove_file(&fresh);
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&fresh)
            .and_then(|mut file| {
                file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))?;
                file.write_all(contents.as_bytes())?;
                file.sync_all()
            })
            .and_then(|()| std::fs::rename(&fresh, &path));
        if let Err(error) = written {
            let _ = std::fs::remove_file(&fresh);
            return Err(failed(error));
        }
        Ok(path)
    };
    std::fs::create_dir_all(dir).map_err(|error| TlsError::Write {
        path: dir.to_owned(),
        reason: error.to_string(),
    })?;
    let ca = ClusterCa::generate("fluxgate cluster CA")?;
    let ca_file = write("ca.pem", &ca.pem().cert_pem, false)?;
    let ca_key_file = write("ca-key.pem", &ca.pem().key_pem, true)?;
    let nodes = (0..nodes)
        .map(|index| {
            let pair = ca.issue_node(&format!("fluxgate node {index}"), server_name)?;
            Ok((
                write(&format!("node-{index}.pem"), &pair.cert_pem, false)?,
                write(&format!("node-{index}-key.pem"), &pair.key_pem, true)?,
            ))
        })
        .collect::<Result<_, TlsError>>()?;
    Ok(ClusterFiles {
        ca_file,
        ca_key_file,
        nodes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_off_needs_nothing_and_on_names_the_missing_option() {
        let mut config = NetworkConfig::default();
        assert!(TlsContext::from_config(&config).unwrap().is_none());
        config.set("security.ssl.internal.enabled", "true").unwrap();
        assert_eq!(
            TlsContext::from_config(&config).unwrap_err(),
            TlsError::MissingOption("security.ssl.internal.cert-file")
        );
    }

    #[test]
    fn generated_files_load_and_a_mismatched_key_is_refused() {
        let dir = std::env::temp_dir().join(format!("fluxgate-tls-unit-{}", std::process::id()));
        let files = write_cluster_files(&dir, 2, DEFAULT_SSL_SERVER_NAME).unwrap();
        let mut config = NetworkConfig::default();
        config.set("fluxgate.security.ssl.enabled", "on").unwrap();
        let set = |config: &mut NetworkConfig, key: &str, path: &Path| {
            config.set(key, path.to_str().unwrap()).unwrap()
        };
        set(
            &mut config,
            "security.ssl.internal.cert-file",
            &files.nodes[0].0,
        );
        set(
            &mut config,
            "security.ssl.internal.key-file",
            &files.nodes[0].1,
        );
        set(&mut config, "security.ssl.internal.ca-file", &files.ca_file);
        assert!(TlsContext::from_config(&config).unwrap().is_some());
        set(
            &mut config,
            "security.ssl.internal.key-file",
            &files.nodes[1].1,
        );
        assert!(matches!(
            TlsContext::from_config(&config),
            Err(TlsError::Refused(_))
        ));
        set(
            &mut config,
            "security.ssl.internal.key-file",
            &files.ca_file,
        );
        assert!(matches!(
            TlsContext::from_config(&config),
            Err(TlsError::Unreadable { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn private_keys_are_left_readable_by_their_owner_only_and_never_through_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("fluxgate-tls-modes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A key file an earlier run (or another user) left readable by all: it kept its mode.
        let stale = dir.join("ca-key.pem");
        std::fs::write(&stale, "old").unwrap();
        std::fs::set_permissions(&stale, std::fs::Permissions::from_mode(0o644)).unwrap();
        let files = write_cluster_files(&dir, 1, DEFAULT_SSL_SERVER_NAME).unwrap();
        let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&files.ca_key_file), 0o600);
        assert_eq!(mode(&files.nodes[0].1), 0o600);
        assert_eq!(mode(&files.ca_file), 0o644);
        // A link planted where a key goes is replaced, not written through.
        let target = dir.join("elsewhere.pem");
        std::fs::remove_file(&files.nodes[0].1).unwrap();
        std::os::unix::fs::symlink(&target, &files.nodes[0].1).unwrap();
        let files = write_cluster_files(&dir, 1, DEFAULT_SSL_SERVER_NAME).unwrap();
        assert!(!target.exists(), "nothing was written through the link");
        let key = std::fs::symlink_metadata(&files.nodes[0].1).unwrap();
        assert!(key.file_type().is_file(), "the key is a file of its own");
        assert_eq!(key.permissions().mode() & 0o777, 0o600);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
