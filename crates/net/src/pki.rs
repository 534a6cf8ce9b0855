//! A cluster's certificates: one cluster CA, one certificate per node naming its node id (and,
//! for a daemon, the server role), and a revocation list. What `netram cluster init`,
//! `netram keygen` and `netram revoke` make, and what the embedded local cluster makes in
//! memory, so that the demo, the tests and the benches run authenticated like a real cluster.
//!
//! A node's identity is in its certificate's subject alternative names, as DNS names that
//! `webpki` checks and lists: `<id>.node.netram` (its node id, bound to its key by the CA's
//! signature) and `server.netram` (it may serve pages and forward parity: clients and servers
//! accept a server only under that name). Anything else an operator adds (`--dns`, `--ip`) is
//! for NBD clients that check a host name (`nbds://`).
//!
//! Files: a cluster directory holds `ca.pem`, `ca.key` (the CA's key: keep it off the nodes),
//! `crl.pem` and `issued.txt` (node id and serial of every certificate issued, for revoking a
//! node); a node's directory holds `ca.pem`, `crl.pem`, `node.pem` and `node.key`.
//! `cluster init` makes both in one directory (node 1, a server), so that one machine runs a
//! cluster with one command.

use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyIdMethod, KeyPair, KeyUsagePurpose,
    RevocationReason, RevokedCertParams, SanType, SerialNumber,
};
use std::fmt::Write as _;
use std::fs;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use time::{Duration, OffsetDateTime};

/// The name every server's certificate carries, and clients ask for.
pub const SERVER_NAME: &str = "server.netram";
/// A node id's name in a certificate.
pub fn node_name(node: u64) -> String {
    format!("{node}.node.netram")
}

pub const CA_CERT: &str = "ca.pem";
pub const CA_KEY: &str = "ca.key";
pub const CRL: &str = "crl.pem";
pub const ISSUED: &str = "issued.txt";
pub const NODE_CERT: &str = "node.pem";
pub const NODE_KEY: &str = "node.key";

/// Certificates and revocation lists are good for this long; a node leaves by revocation.
const VALIDITY: Duration = Duration::days(3650);

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("{path} exists already: refusing to overwrite a cluster's keys")]
    Exists { path: PathBuf },
    #[error("{path}: {what}")]
    Bad { path: PathBuf, what: String },
    #[error("node {0} has no certificate issued in this cluster directory")]
    UnknownNode(u64),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> PkiError + '_ {
    move |source| PkiError::Io {
        path: path.to_owned(),
        source,
    }
}

/// What one node's certificate says.
#[derive(Debug, Clone, Default)]
pub struct NodeSpec {
    pub node: u64,
    /// A daemon: serves pages and forwards parity deltas (and is also a client).
    pub server: bool,
    /// Further names and addresses, for NBD clients that check the host (`nbds://`).
    pub dns: Vec<String>,
    pub ips: Vec<IpAddr>,
}

/// A node's credentials as PEM text: its certificate, key, the cluster CA and the CRL.
#[derive(Debug, Clone)]
pub struct NodePem {
    pub cert: String,
    pub key: String,
    pub ca: String,
    pub crl: String,
    /// The certificate's serial number (for `issued.txt`).
    pub serial: Vec<u8>,
}

/// A cluster CA: its key and the parameters its certificate was made from (the issuer's name
/// and key identifier are all a signature needs).
pub struct ClusterCa {
    params: CertificateParams,
    key: KeyPair,
    cert_pem: String,
    revoked: Vec<Vec<u8>>,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

fn ca_params() -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "netram");
    dn.push(DnType::CommonName, "netram cluster CA");
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p.key_identifier_method = KeyIdMethod::Sha256;
    p
}

fn random_serial() -> Vec<u8> {
    use ring::rand::SecureRandom;
    let mut s = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut s)
        .expect("the operating system's random source");
    // Positive and without a leading zero byte: a DER INTEGER as it will be read back.
    s[0] = (s[0] & 0x7f) | 0x10;
    s.to_vec()
}

impl ClusterCa {
    /// A new CA with a fresh key.
    pub fn generate() -> Result<Self, PkiError> {
        let key = KeyPair::generate()?;
        let mut params = ca_params();
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::hours(1);
        params.not_after = now + VALIDITY;
        params.serial_number = Some(SerialNumber::from_slice(&random_serial()));
        let cert_pem = params.self_signed(&key)?.pem();
        Ok(Self {
            params,
            key,
            cert_pem,
            revoked: Vec::new(),
        })
    }

    fn issuer(&self) -> Issuer<'_, &KeyPair> {
        Issuer::from_params(&self.params, &self.key)
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Revokes certificates by serial number (the next [`ClusterCa::crl_pem`] lists them).
    pub fn revoke(&mut self, serial: &[u8]) {
        if !self.revoked.iter().any(|s| s == serial) {
            self.revoked.push(serial.to_vec());
        }
    }

    /// The revocation list, signed now.
    pub fn crl_pem(&self) -> Result<String, PkiError> {
        let now = OffsetDateTime::now_utc();
        let crl = CertificateRevocationListParams {
            this_update: now - Duration::minutes(5),
            next_update: now + VALIDITY,
            crl_number: SerialNumber::from_slice(&random_serial()),
            issuing_distribution_point: None,
            revoked_certs: self
                .revoked
                .iter()
                .map(|s| RevokedCertParams {
                    serial_number: SerialNumber::from_slice(s),
                    revocation_time: now - Duration::minutes(5),
                    reason_code: Some(RevocationReason::Superseded),
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: KeyIdMethod::Sha256,
        }
        .signed_by(&self.issuer())?;
        Ok(crl.pem()?)
    }

    /// Issues a node's certificate and key.
    pub fn issue(&self, spec: &NodeSpec) -> Result<NodePem, PkiError> {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "netram");
        dn.push(DnType::CommonName, format!("netram node {}", spec.node));
        p.distinguished_name = dn;
        let now = OffsetDateTime::now_utc();
        p.not_before = now - Duration::hours(1);
        p.not_after = now + VALIDITY;
        let serial = random_serial();
        p.serial_number = Some(SerialNumber::from_slice(&serial));
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let mut names = vec![SanType::DnsName(node_name(spec.node).try_into()?)];
        if spec.server {
            p.extended_key_usages
                .push(ExtendedKeyUsagePurpose::ServerAuth);
            names.push(SanType::DnsName(SERVER_NAME.try_into()?));
        }
        for d in &spec.dns {
            names.push(SanType::DnsName(d.as_str().try_into()?));
        }
        names.extend(spec.ips.iter().map(|&ip| SanType::IpAddress(ip)));
        p.subject_alt_names = names;
        p.use_authority_key_identifier_extension = true;
        let cert = p.signed_by(&key, &self.issuer())?;
        Ok(NodePem {
            cert: cert.pem(),
            key: key.serialize_pem(),
            ca: self.cert_pem.clone(),
            crl: self.crl_pem()?,
            serial,
        })
    }

    /// Loads the CA of a cluster directory (its key, its certificate, what it revoked).
    pub fn load(dir: &Path) -> Result<Self, PkiError> {
        let read = |name: &str| {
            let path = dir.join(name);
            fs::read_to_string(&path).map_err(io_err(&path))
        };
        let key_path = dir.join(CA_KEY);
        let key = KeyPair::from_pem(&read(CA_KEY)?).map_err(|e| PkiError::Bad {
            path: key_path,
            what: e.to_string(),
        })?;
        let mut ca = Self {
            params: ca_params(),
            key,
            cert_pem: read(CA_CERT)?,
            revoked: Vec::new(),
        };
        for (node, serial, revoked) in read_issued(dir)? {
            let _ = node;
            if revoked {
                ca.revoke(&serial);
            }
        }
        Ok(ca)
    }
}

/// `issued.txt`: one line per certificate, `node serial-hex [revoked]`.
fn read_issued(dir: &Path) -> Result<Vec<(u64, Vec<u8>, bool)>, PkiError> {
    let path = dir.join(ISSUED);
    let text = match fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(io_err(&path)(e)),
    };
    let bad = |what: String| PkiError::Bad {
        path: path.clone(),
        what,
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let node = f
                .first()
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| bad(format!("bad line {l:?}")))?;
            let serial = f
                .get(1)
                .and_then(|s| from_hex(s))
                .ok_or_else(|| bad(format!("bad serial in {l:?}")))?;
            Ok((node, serial, f.get(2) == Some(&"revoked")))
        })
        .collect()
}

fn write_issued(dir: &Path, issued: &[(u64, Vec<u8>, bool)]) -> Result<(), PkiError> {
    let mut text = String::new();
    for (node, serial, revoked) in issued {
        let _ = writeln!(
            text,
            "{node} {}{}",
            to_hex(serial),
            if *revoked { " revoked" } else { "" }
        );
    }
    write_file(&dir.join(ISSUED), &text, 0o644)
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn from_hex(s: &str) -> Option<Vec<u8>> {
    s.len()
        .is_multiple_of(2)
        .then(|| {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
                .collect()
        })
        .flatten()
}

/// Writes a file readable only as `mode` allows (keys: 0600), replacing it atomically.
fn write_file(path: &Path, text: &str, mode: u32) -> Result<(), PkiError> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    // A name of this write's own: two writers of one file (two `netram keygen` at once) must
    // not take each other's temporary file away.
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let tmp = path.with_extension(format!(
        "tmp.{}.{}",
        std::process::id(),
        WRITES.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io_err(&tmp))?;
    io::Write::write_all(&mut f, text.as_bytes()).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    fs::rename(&tmp, path).map_err(io_err(path))
}

/// Holds the cluster directory for one read-modify-write of `issued.txt` and `crl.pem`
/// (released when the descriptor closes): `netram keygen` or `netram revoke` run at once
/// (an operator's script issuing credentials in parallel) would otherwise lose each other's
/// entries, or a revocation.
fn lock_cluster(cluster: &Path) -> Result<fs::File, PkiError> {
    let dir = fs::File::open(cluster).map_err(io_err(cluster))?;
    rustix::fs::flock(&dir, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| io_err(cluster)(e.into()))?;
    Ok(dir)
}

/// Writes a node's credentials into `dir` (created if need be).
pub fn write_node(dir: &Path, pem: &NodePem) -> Result<(), PkiError> {
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    write_file(&dir.join(CA_CERT), &pem.ca, 0o644)?;
    write_file(&dir.join(CRL), &pem.crl, 0o644)?;
    write_file(&dir.join(NODE_CERT), &pem.cert, 0o644)?;
    write_file(&dir.join(NODE_KEY), &pem.key, 0o600)
}

/// `netram cluster init DIR`: a new CA in `dir` (`ca.key`, which signs, `ca.pem`, an empty
/// `crl.pem` and the list of issued certificates), and node 1's credentials (a server) in
/// `node_dir`, to be copied to node 1 without the key that signs. `node_dir` may be `dir`
/// only for a cluster that lives and dies on one machine (the demo's, the benchmarks', the
/// tests'): a node that holds `ca.key` can issue any identity.
pub fn init_cluster(dir: &Path, node_dir: &Path) -> Result<(), PkiError> {
    if dir.join(CA_KEY).exists() {
        return Err(PkiError::Exists {
            path: dir.join(CA_KEY),
        });
    }
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let ca = ClusterCa::generate()?;
    write_file(&dir.join(CA_KEY), &ca.key.serialize_pem(), 0o600)?;
    write_file(&dir.join(CA_CERT), &ca.cert_pem, 0o644)?;
    let node = ca.issue(&NodeSpec {
        node: 1,
        server: true,
        ..NodeSpec::default()
    })?;
    write_file(&dir.join(CRL), &node.crl, 0o644)?;
    write_node(node_dir, &node)?;
    write_issued(dir, &[(1, node.serial, false)])
}

/// `netram keygen`: issues `spec`'s credentials from the cluster directory `cluster` into
/// `out`.
pub fn issue_node(cluster: &Path, spec: &NodeSpec, out: &Path) -> Result<(), PkiError> {
    let _lock = lock_cluster(cluster)?;
    let ca = ClusterCa::load(cluster)?;
    let pem = ca.issue(spec)?;
    write_node(out, &pem)?;
    let mut issued = read_issued(cluster)?;
    issued.push((spec.node, pem.serial, false));
    write_issued(cluster, &issued)
}

/// `netram revoke`: revokes every certificate issued to `node` and writes the new `crl.pem`
/// into the cluster directory; returns its path (to copy to every node: a daemon reloads it
/// within seconds, and closes the revoked node's connections).
pub fn revoke_node(cluster: &Path, node: u64) -> Result<PathBuf, PkiError> {
    let _lock = lock_cluster(cluster)?;
    let mut ca = ClusterCa::load(cluster)?;
    let mut issued = read_issued(cluster)?;
    let mut found = false;
    for (n, serial, revoked) in issued.iter_mut() {
        if *n == node {
            ca.revoke(serial);
            *revoked = true;
            found = true;
        }
    }
    if !found {
        return Err(PkiError::UnknownNode(node));
    }
    let path = cluster.join(CRL);
    write_file(&path, &ca.crl_pem()?, 0o644)?;
    write_issued(cluster, &issued)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `netram keygen` and `netram revoke` run at once against one cluster directory lose
    /// nothing: every certificate is listed, every revocation kept (without the lock one of
    /// two writers failed, its temporary file taken by the other: seen in CI).
    #[test]
    fn credentials_issued_and_revoked_at_once_are_all_kept() {
        let dir = std::env::temp_dir().join(format!("netram-pki-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        init_cluster(&dir, &dir.join("node-1")).unwrap();
        let spec = |node| NodeSpec {
            node,
            server: false,
            dns: Vec::new(),
            ips: Vec::new(),
        };
        std::thread::scope(|s| {
            for node in 2..10u64 {
                let dir = &dir;
                s.spawn(move || {
                    issue_node(dir, &spec(node), &dir.join(format!("node-{node}"))).unwrap()
                });
            }
        });
        std::thread::scope(|s| {
            for node in [3u64, 5, 7] {
                let dir = &dir;
                s.spawn(move || revoke_node(dir, node).unwrap());
            }
        });
        let mut issued = read_issued(&dir).unwrap();
        issued.sort();
        let nodes: Vec<(u64, bool)> = issued.iter().map(|(n, _, r)| (*n, *r)).collect();
        let want: Vec<(u64, bool)> = (1..10u64).map(|n| (n, [3, 5, 7].contains(&n))).collect();
        assert_eq!(nodes, want);
        let _ = fs::remove_dir_all(&dir);
    }
}
