//! Who is at the other end of a connection: mutual TLS 1.3 against the cluster's CA, before a
//! byte of netram's own protocol is read (GMS §6: a node must not have to trust every other).
//!
//! Every connection, client to server and server to server, opens with a TLS handshake in
//! which both ends present a certificate of the cluster (`pki.rs`); the revocation list is
//! checked on both sides. The HELLO and WELCOME then travel inside TLS, so a session's ids are
//! never seen on the wire, and both ends derive the keys of netram's sealed frames from the TLS
//! exporter (`record.rs`), leaving rustls behind for the frames themselves.
//!
//! Why mutual TLS rather than a Noise handshake (`snow`, a pre-shared key and a static key per
//! node, as WireGuard does): the costs on the GET path are the same once records are sealed by
//! netram (`record.rs`: the cipher alone), and the handshake's cost (about 0.35 ms, once per
//! connection) does not matter. What decides is the operator: one cluster CA issues a
//! certificate per node (its node id and role inside, signed, so that no one else can claim
//! them), a node is revoked with a standard CRL that every daemon reloads, nothing about the
//! other nodes has to be copied to every machine when one joins, and the NBD front end's TLS
//! (which nbd-client, qemu-nbd and libnbd speak with X.509 certificates) uses the same files.
//! With Noise, node ids bound to keys need either a list of every node's key on every node or
//! signatures over keys: a certificate authority written by hand.

use crate::pki::{self, NodePem, SERVER_NAME};
use crate::record::{RecordKey, KEY_LEN};
use rustls::client::danger::ServerCertVerifier;
use rustls::client::{Resumption, WebPkiServerVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// The schemes a node signs membership messages with (its key picks one) and accepts.
const SIGNATURE_SCHEMES: &[rustls::SignatureScheme] = &[
    rustls::SignatureScheme::ECDSA_NISTP256_SHA256,
    rustls::SignatureScheme::ED25519,
    rustls::SignatureScheme::ECDSA_NISTP384_SHA384,
];

/// The exporter label of netram's frame keys (RFC 8446 §7.5).
const EXPORTER_LABEL: &[u8] = b"EXPORTER-netram-frames-v1";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: {what}")]
    Bad { path: PathBuf, what: String },
    #[error("TLS: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("TLS configuration: {0}")]
    Verifier(String),
    #[error("the certificate names no node id ({0})")]
    NoNodeId(String),
    #[error("handshake: {0}")]
    Handshake(#[source] io::Error),
    #[error("the peer sent more than its handshake message before the frames began")]
    Overrun,
}

/// What a certificate says about its holder, once TLS has verified it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    pub node: u64,
    /// Certified as a server (`server.netram`): may store pages and forward parity deltas.
    pub server: bool,
    /// The certificate's serial number, to close its connections if it is revoked later.
    pub serial: Vec<u8>,
}

/// The identity a certificate carries.
pub fn identity_of(der: &CertificateDer<'_>) -> Result<PeerIdentity, TlsError> {
    let ee = webpki::EndEntityCert::try_from(der)
        .map_err(|e| TlsError::Verifier(format!("certificate: {e}")))?;
    let mut node = None;
    let mut server = false;
    let mut names = Vec::new();
    for n in ee.valid_dns_names() {
        names.push(n.to_string());
        if n == SERVER_NAME {
            server = true;
        } else if let Some(id) = n.strip_suffix(".node.netram") {
            node = id.parse::<u64>().ok().or(node);
        }
    }
    Ok(PeerIdentity {
        node: node.ok_or_else(|| TlsError::NoNodeId(names.join(", ")))?,
        server,
        serial: ee.serial().to_vec(),
    })
}

/// A node's credentials, ready to open and accept connections.
pub struct Credentials {
    /// This node, as its own certificate says.
    pub identity: PeerIdentity,
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
    /// The revocation lists, to look up the serials of connections already established.
    crls: Vec<webpki::CertRevocationList<'static>>,
    /// Where the revocation list was read from, and when it was written: reloaded when it
    /// changes.
    crl_file: Option<(PathBuf, Option<SystemTime>)>,
    pem: NodePem,
    /// The cluster CA, to check the certificates that come with signed membership messages.
    roots: Arc<RootCertStore>,
    /// This node's certificate (DER) and its key, to sign membership messages.
    cert_der: CertificateDer<'static>,
    signer: Arc<dyn rustls::sign::SigningKey>,
    /// What [`Credentials::current`] found last, and when it looked.
    newer: std::sync::Mutex<(Option<Instant>, Option<Arc<Credentials>>)>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("identity", &self.identity)
            .field("crl_file", &self.crl_file)
            .finish_non_exhaustive()
    }
}

fn bad(path: &Path, what: impl std::fmt::Display) -> TlsError {
    TlsError::Bad {
        path: path.to_owned(),
        what: what.to_string(),
    }
}

impl Credentials {
    /// Credentials from PEM text (the embedded cluster's, made in memory).
    pub fn from_pem(pem: &NodePem) -> Result<Self, TlsError> {
        Self::build(pem.clone(), Path::new("(in memory)"), None)
    }

    /// A node's credentials from its directory (`ca.pem`, `crl.pem`, `node.pem`, `node.key`,
    /// as `netram cluster init` and `netram keygen` write them).
    pub fn load(dir: &Path) -> Result<Self, TlsError> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read_to_string(&path).map_err(|source| TlsError::Io { path, source })
        };
        let crl_path = dir.join(pki::CRL);
        let crl = match std::fs::read_to_string(&crl_path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
            Err(source) => {
                return Err(TlsError::Io {
                    path: crl_path,
                    source,
                })
            }
        };
        let pem = NodePem {
            cert: read(pki::NODE_CERT)?,
            key: read(pki::NODE_KEY)?,
            ca: read(pki::CA_CERT)?,
            crl,
            serial: Vec::new(),
        };
        let mtime = std::fs::metadata(&crl_path).and_then(|m| m.modified()).ok();
        Self::build(pem, dir, Some((crl_path, mtime)))
    }

    fn build(
        pem: NodePem,
        dir: &Path,
        crl_file: Option<(PathBuf, Option<SystemTime>)>,
    ) -> Result<Self, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(pem.cert.as_bytes())
                .collect::<Result<_, _>>()
                .map_err(|e| bad(&dir.join(pki::NODE_CERT), e))?;
        let own = chain
            .first()
            .ok_or_else(|| bad(&dir.join(pki::NODE_CERT), "no certificate"))?;
        let identity = identity_of(own)?;
        let key = PrivateKeyDer::from_pem_slice(pem.key.as_bytes())
            .map_err(|e| bad(&dir.join(pki::NODE_KEY), e))?;
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(pem.ca.as_bytes()) {
            let ca = ca.map_err(|e| bad(&dir.join(pki::CA_CERT), e))?;
            roots.add(ca).map_err(|e| bad(&dir.join(pki::CA_CERT), e))?;
        }
        if roots.is_empty() {
            return Err(bad(&dir.join(pki::CA_CERT), "no CA certificate"));
        }
        let crls: Vec<CertificateRevocationListDer<'static>> =
            CertificateRevocationListDer::pem_slice_iter(pem.crl.as_bytes())
                .collect::<Result<_, _>>()
                .map_err(|e| bad(&dir.join(pki::CRL), e))?;
        let parsed = crls
            .iter()
            .map(|c| {
                webpki::OwnedCertRevocationList::from_der(c)
                    .map(webpki::CertRevocationList::from)
                    .map_err(|e| bad(&dir.join(pki::CRL), format!("{e:?}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let roots = Arc::new(roots);
        let signer = provider
            .key_provider
            .load_private_key(key.clone_key())
            .map_err(|e| bad(&dir.join(pki::NODE_KEY), e))?;
        let cert_der = own.clone().into_owned();
        let verify_clients =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
                .with_crls(crls.clone())
                .build()
                .map_err(|e| TlsError::Verifier(e.to_string()))?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verify_clients)
            .with_single_cert(chain.clone(), key.clone_key())?;
        // Nothing may follow the handshake on the stream but netram's records: no session
        // tickets (and no resumption: connections are long-lived).
        server.send_tls13_tickets = 0;
        server.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        let verify_servers: Arc<dyn ServerCertVerifier> =
            WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone())
                .with_crls(crls)
                .build()
                .map_err(|e| TlsError::Verifier(e.to_string()))?;
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(verify_servers)
            .with_client_auth_cert(chain, key)?;
        client.resumption = Resumption::disabled();
        Ok(Self {
            identity,
            client: Arc::new(client),
            server: Arc::new(server),
            crls: parsed,
            crl_file,
            pem,
            roots,
            cert_der,
            signer,
            newer: std::sync::Mutex::new((None, None)),
        })
    }

    /// The newest version of these credentials: the revocation list read again if its file
    /// changed, looked at no more than once a second. Clients take it for every new
    /// connection, so that a long-running client stops trusting a server revoked after it
    /// started (the daemon reloads its own, and closes revoked peers' open connections).
    pub fn current(self: &Arc<Self>) -> Arc<Credentials> {
        let mut newer = self.newer.lock().unwrap_or_else(|p| p.into_inner());
        let base = newer.1.clone().unwrap_or_else(|| self.clone());
        if newer
            .0
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return base;
        }
        newer.0 = Some(Instant::now());
        match base.reloaded() {
            None => base,
            Some(Ok(c)) => {
                tracing::info!("revocation list reloaded");
                let c = Arc::new(c);
                newer.1 = Some(c.clone());
                c
            }
            Some(Err(e)) => {
                tracing::error!("revocation list not reloaded, the previous one stays: {e}");
                base
            }
        }
    }

    /// The credentials with the revocation list read again, if its file changed since.
    pub fn reloaded(&self) -> Option<Result<Credentials, TlsError>> {
        let (path, seen) = self.crl_file.as_ref()?;
        let now = std::fs::metadata(path).and_then(|m| m.modified()).ok();
        if now == *seen {
            return None;
        }
        let crl = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(source) => {
                return Some(Err(TlsError::Io {
                    path: path.clone(),
                    source,
                }))
            }
        };
        let pem = NodePem {
            crl,
            ..self.pem.clone()
        };
        let dir = path.parent().unwrap_or(Path::new("."));
        Some(Self::build(pem, dir, Some((path.clone(), now))))
    }

    /// The TLS server configuration of this node: its certificate, and clients must present
    /// one of the cluster's (checked against the revocation list). The NBD front end's TLS
    /// uses it as it is.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.server.clone()
    }

    /// What this node's own certificate says of it (its node id, its role).
    pub fn identity(&self) -> Result<PeerIdentity, TlsError> {
        identity_of(&CertificateDer::from(self.cert_der()))
    }

    /// This node's certificate, as it goes with the messages it signs.
    pub fn cert_der(&self) -> &[u8] {
        self.cert_der.as_ref()
    }

    /// Signs `msg` with this node's key (membership messages, which travel over UDP, outside
    /// any TLS connection): the scheme (a TLS `SignatureScheme` number) and the signature.
    pub fn sign(&self, msg: &[u8]) -> Result<(u16, Vec<u8>), TlsError> {
        let signer = self
            .signer
            .choose_scheme(SIGNATURE_SCHEMES)
            .ok_or_else(|| {
                TlsError::Verifier("the node's key signs with no known scheme".into())
            })?;
        let sig = signer.sign(msg)?;
        Ok((u16::from(signer.scheme()), sig))
    }

    /// Checks a message signed by another node: its certificate must chain to the cluster CA,
    /// be in its validity and not be revoked, and the signature over `msg` must be its key's.
    /// Returns who signed it.
    pub fn verify_signed(
        &self,
        cert: &[u8],
        msg: &[u8],
        scheme: u16,
        sig: &[u8],
    ) -> Result<PeerIdentity, TlsError> {
        let id = self.verify_cert(cert)?;
        self.verify_signature(cert, msg, scheme, sig)?;
        Ok(id)
    }

    /// The first half of [`Credentials::verify_signed`]: the certificate chains to the
    /// cluster CA, is in its validity and is not revoked. A caller that checked a certificate
    /// may keep the answer for a while (as long as these credentials, whose revocation list it
    /// reflects) and check only the signature of the next message it signs.
    pub fn verify_cert(&self, cert: &[u8]) -> Result<PeerIdentity, TlsError> {
        let der = CertificateDer::from(cert);
        let ee = webpki::EndEntityCert::try_from(&der)
            .map_err(|e| TlsError::Verifier(format!("certificate: {e}")))?;
        let crls: Vec<&webpki::CertRevocationList<'_>> = self.crls.iter().collect();
        let revocation = if crls.is_empty() {
            None
        } else {
            Some(
                webpki::RevocationOptionsBuilder::new(&crls)
                    .map_err(|e| TlsError::Verifier(format!("{e:?}")))?
                    .with_status_policy(webpki::UnknownStatusPolicy::Allow)
                    .build(),
            )
        };
        ee.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &self.roots.roots,
            &[],
            rustls::pki_types::UnixTime::now(),
            webpki::KeyUsage::client_auth(),
            revocation,
            None,
        )
        .map_err(|e| TlsError::Verifier(format!("certificate: {e}")))?;
        identity_of(&der)
    }

    /// The second half of [`Credentials::verify_signed`]: the signature over `msg` is the
    /// key's of `cert` (which the caller checked with [`Credentials::verify_cert`]).
    pub fn verify_signature(
        &self,
        cert: &[u8],
        msg: &[u8],
        scheme: u16,
        sig: &[u8],
    ) -> Result<(), TlsError> {
        let der = CertificateDer::from(cert);
        let ee = webpki::EndEntityCert::try_from(&der)
            .map_err(|e| TlsError::Verifier(format!("certificate: {e}")))?;
        let alg: &dyn rustls::pki_types::SignatureVerificationAlgorithm =
            match rustls::SignatureScheme::from(scheme) {
                rustls::SignatureScheme::ECDSA_NISTP256_SHA256 => webpki::ring::ECDSA_P256_SHA256,
                rustls::SignatureScheme::ECDSA_NISTP384_SHA384 => webpki::ring::ECDSA_P384_SHA384,
                rustls::SignatureScheme::ED25519 => webpki::ring::ED25519,
                other => return Err(TlsError::Verifier(format!("signature scheme {other:?}"))),
            };
        ee.verify_signature(alg, msg, sig)
            .map_err(|e| TlsError::Verifier(format!("signature: {e}")))
    }

    /// Whether the revocation list names this serial number.
    pub fn is_revoked(&self, serial: &[u8]) -> bool {
        self.crls
            .iter()
            .any(|c| matches!(c.find_serial(serial), Ok(Some(_))))
    }
}

/// The keys of a connection's sealed frames, for what this end sends and what it receives.
#[derive(Debug)]
pub struct FrameKeys {
    pub send: RecordKey,
    pub recv: RecordKey,
}

fn frame_keys(conn: &Connection, client: bool) -> Result<FrameKeys, TlsError> {
    let material = match conn {
        Connection::Client(c) => c.export_keying_material([0u8; 2 * KEY_LEN], EXPORTER_LABEL, None),
        Connection::Server(s) => s.export_keying_material([0u8; 2 * KEY_LEN], EXPORTER_LABEL, None),
    }?;
    let (c2s, s2c) = material.split_at(KEY_LEN);
    let c2s: &[u8; KEY_LEN] = c2s.try_into().expect("16 bytes");
    let s2c: &[u8; KEY_LEN] = s2c.try_into().expect("16 bytes");
    Ok(if client {
        FrameKeys {
            send: RecordKey::new(c2s),
            recv: RecordKey::new(s2c),
        }
    } else {
        FrameKeys {
            send: RecordKey::new(s2c),
            recv: RecordKey::new(c2s),
        }
    })
}

/// Runs TLS I/O on a blocking stream until `done` says so, within `deadline`.
fn drive(
    conn: &mut Connection,
    stream: &mut TcpStream,
    deadline: Instant,
    mut done: impl FnMut(&mut Connection) -> bool,
) -> Result<(), TlsError> {
    while !done(conn) {
        let left = deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                TlsError::Handshake(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "handshake deadline",
                ))
            })?;
        stream
            .set_read_timeout(Some(left))
            .map_err(TlsError::Handshake)?;
        match conn.complete_io(stream) {
            Ok((0, 0)) if conn.wants_read() => {
                return Err(TlsError::Handshake(io::ErrorKind::UnexpectedEof.into()))
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // A TLS alert or a certificate refused surfaces as InvalidData from rustls.
                return Err(TlsError::Handshake(e));
            }
        }
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes of application data, then checks that nothing else came.
fn read_message(
    conn: &mut Connection,
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
) -> Result<(), TlsError> {
    let mut got = 0;
    drive(conn, stream, deadline, |c| loop {
        match c.reader().read(&mut buf[got..]) {
            Ok(0) if got < buf.len() => return false,
            Ok(n) => {
                got += n;
                if got == buf.len() {
                    return true;
                }
            }
            Err(_) => return false,
        }
    })?;
    let mut more = [0u8; 1];
    match conn.reader().read(&mut more) {
        Ok(0) | Err(_) => {}
        Ok(_) => return Err(TlsError::Overrun),
    }
    Ok(())
}

fn write_message(
    conn: &mut Connection,
    stream: &mut TcpStream,
    msg: &[u8],
    deadline: Instant,
) -> Result<(), TlsError> {
    conn.writer().write_all(msg).map_err(TlsError::Handshake)?;
    drive(conn, stream, deadline, |c| !c.wants_write())
}

/// The client's side: TLS as `creds`, checking the server's certificate (`server.netram`),
/// then `hello` out and `reply.len()` bytes (the WELCOME) back, all inside TLS. Returns the
/// server's identity and the frame keys; `None` when the server answered in clear before TLS
/// (`reply` then holds that WELCOME, which the caller accepts only as "busy").
pub fn connect(
    stream: &mut TcpStream,
    creds: &Credentials,
    hello: &[u8],
    reply: &mut [u8],
    deadline: Instant,
) -> Result<Option<(PeerIdentity, FrameKeys)>, TlsError> {
    let name = ServerName::try_from(SERVER_NAME).expect("a DNS name");
    let mut conn: Connection = ClientConnection::new(creds.client.clone(), name)?.into();
    // A server at its connection limit answers at once, in clear, before any TLS (it spends
    // no handshake on a connection it will not serve): a WELCOME where the ServerHello would
    // be. Unauthenticated, it can only mean "busy, try later" (the caller accepts nothing
    // else in clear), which anyone on the path could achieve as well by cutting the
    // connection.
    while conn.wants_write() {
        conn.write_tls(stream).map_err(TlsError::Handshake)?;
    }
    let left = deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
        .unwrap_or(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(left))
        .map_err(TlsError::Handshake)?;
    let mut first = [0u8; 1];
    if matches!(stream.peek(&mut first), Ok(1)) && first[0] == netram_proto::MAGIC[0] {
        stream.read_exact(reply).map_err(TlsError::Handshake)?;
        return Ok(None);
    }
    drive(&mut conn, stream, deadline, |c| !c.is_handshaking())?;
    let peer = peer_identity(&conn)?;
    write_message(&mut conn, stream, hello, deadline)?;
    read_message(&mut conn, stream, reply, deadline)?;
    let keys = frame_keys(&conn, true)?;
    Ok(Some((peer, keys)))
}

/// A server's connection between its TLS handshake and its WELCOME.
pub struct Accepted {
    conn: Connection,
    /// Who connected, as its certificate says.
    pub peer: PeerIdentity,
}

impl std::fmt::Debug for Accepted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accepted")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

/// The server's side: TLS as `creds`, requiring a client certificate of the cluster (not
/// revoked), then `hello.len()` bytes (the HELLO) inside TLS.
pub fn accept(
    stream: &mut TcpStream,
    creds: &Credentials,
    hello: &mut [u8],
    deadline: Instant,
) -> Result<Accepted, TlsError> {
    let mut conn: Connection = rustls::ServerConnection::new(creds.server.clone())?.into();
    drive(&mut conn, stream, deadline, |c| !c.is_handshaking())?;
    let peer = peer_identity(&conn)?;
    read_message(&mut conn, stream, hello, deadline)?;
    Ok(Accepted { conn, peer })
}

impl Accepted {
    /// Sends the WELCOME inside TLS; from here on the stream carries sealed frames.
    pub fn welcome(
        mut self,
        stream: &mut TcpStream,
        welcome: &[u8],
        deadline: Instant,
    ) -> Result<FrameKeys, TlsError> {
        write_message(&mut self.conn, stream, welcome, deadline)?;
        frame_keys(&self.conn, false)
    }
}

fn peer_identity(conn: &Connection) -> Result<PeerIdentity, TlsError> {
    let certs = conn
        .peer_certificates()
        .ok_or_else(|| TlsError::Verifier("the peer presented no certificate".into()))?;
    identity_of(
        certs
            .first()
            .ok_or_else(|| TlsError::Verifier("the peer presented no certificate".into()))?,
    )
}

#[cfg(test)]
mod signed_tests {
    use super::*;
    use crate::pki::{ClusterCa, NodeSpec};

    fn node(ca: &ClusterCa, id: u64) -> Credentials {
        let pem = ca
            .issue(&NodeSpec {
                node: id,
                server: true,
                ..Default::default()
            })
            .unwrap();
        Credentials::from_pem(&pem).unwrap()
    }

    #[test]
    fn a_signed_message_names_its_signer_and_nothing_else_passes() {
        let mut ca = ClusterCa::generate().unwrap();
        let (a, b) = (node(&ca, 3), node(&ca, 4));
        let (scheme, sig) = a.sign(b"gossip").unwrap();
        let who = b
            .verify_signed(a.cert_der(), b"gossip", scheme, &sig)
            .unwrap();
        assert_eq!(who.node, 3);
        // Another message, another signature, another key's certificate: refused.
        assert!(b
            .verify_signed(a.cert_der(), b"gossiP", scheme, &sig)
            .is_err());
        let mut bad = sig.clone();
        bad[10] ^= 1;
        assert!(b
            .verify_signed(a.cert_der(), b"gossip", scheme, &bad)
            .is_err());
        assert!(b
            .verify_signed(b.cert_der(), b"gossip", scheme, &sig)
            .is_err());
        assert!(b
            .verify_signed(b"not a cert", b"gossip", scheme, &sig)
            .is_err());
        // A node of another cluster signs validly, but its certificate is not ours.
        let other = ClusterCa::generate().unwrap();
        let stranger = node(&other, 3);
        let (scheme, sig) = stranger.sign(b"gossip").unwrap();
        assert!(b
            .verify_signed(stranger.cert_der(), b"gossip", scheme, &sig)
            .is_err());
        // Revoked: refused by a node that has the new list.
        let pem = ca
            .issue(&NodeSpec {
                node: 5,
                server: true,
                ..Default::default()
            })
            .unwrap();
        let five = Credentials::from_pem(&pem).unwrap();
        ca.revoke(&pem.serial);
        let crl = ca.crl_pem().unwrap();
        let c = Credentials::from_pem(&NodePem {
            crl,
            ..ca.issue(&NodeSpec {
                node: 6,
                server: true,
                ..Default::default()
            })
            .unwrap()
        })
        .unwrap();
        let (scheme, sig) = five.sign(b"gossip").unwrap();
        assert!(b
            .verify_signed(five.cert_der(), b"gossip", scheme, &sig)
            .is_ok());
        assert!(c
            .verify_signed(five.cert_der(), b"gossip", scheme, &sig)
            .is_err());
    }
}
