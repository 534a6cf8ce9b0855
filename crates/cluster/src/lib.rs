//! An embedded local cluster: page servers on loopback ports, in this process. Used by
//! `netram demo`, the benchmarks and the tests of the front ends (`netram-uffd`, `netram-capi`);
//! the multi-process tests start real `netram serve` processes instead. Not part of the daemon
//! nor of any client library: nothing but those links it.
//!
//! It runs like a real cluster: a cluster CA made in memory at start (`netram_net::pki`),
//! a server certificate per server, a client certificate for this process's pagers
//! ([`LocalCluster::client`]) and, for programs it starts (`netram run`), the same credentials
//! in a directory ([`LocalCluster::tls_dir`]). [`LocalCluster::start_insecure`] is clear TCP,
//! for the benchmark that measures what TLS costs.

use netram_client::ClientConfig;
use netram_net::pki::{self, ClusterCa, NodeSpec};
use netram_net::{Credentials, Security, TlsError};
use netram_server::{Server, ServerConfig, ServerError};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

/// The node id of the embedded cluster's clients (servers are 1..=n).
pub const CLIENT_NODE: u64 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error("certificates: {0}")]
    Pki(#[from] pki::PkiError),
    #[error("credentials: {0}")]
    Tls(#[from] TlsError),
    #[error("credentials directory: {0}")]
    Dir(#[from] std::io::Error),
}

#[derive(Debug)]
pub struct LocalCluster {
    servers: Vec<Server>,
    /// The clients' way in: their credentials, or clear TCP.
    client: Security,
    /// The clients' credentials as files, for programs this process starts.
    dir: Option<tempfile::TempDir>,
}

impl LocalCluster {
    /// Starts `n` servers of `capacity_bytes` each on ephemeral loopback ports, with a fresh
    /// cluster CA: every connection is mutual TLS, every frame sealed.
    pub fn start(n: usize, capacity_bytes: u64, low_latency: bool) -> Result<Self, ClusterError> {
        Self::start_with(ClusterCa::generate()?, n, capacity_bytes, low_latency)
    }

    /// Like [`LocalCluster::start`], with servers issued by the CA of a cluster directory
    /// (`netram cluster init`): the programs a run starts with `NETRAM_TLS` naming that
    /// directory reach them as node 1.
    pub fn start_in(
        dir: &Path,
        n: usize,
        capacity_bytes: u64,
        low_latency: bool,
    ) -> Result<Self, ClusterError> {
        let mut c = Self::start_with(ClusterCa::load(dir)?, n, capacity_bytes, low_latency)?;
        c.client = Security::Tls(Arc::new(Credentials::load(dir)?));
        c.dir = None;
        Ok(c)
    }

    fn start_with(
        ca: ClusterCa,
        n: usize,
        capacity_bytes: u64,
        low_latency: bool,
    ) -> Result<Self, ClusterError> {
        let servers = (0..n)
            .map(|i| {
                let pem = ca.issue(&NodeSpec {
                    node: i as u64 + 1,
                    server: true,
                    ..NodeSpec::default()
                })?;
                let creds = Arc::new(Credentials::from_pem(&pem)?);
                Ok(Self::server(
                    i,
                    capacity_bytes,
                    low_latency,
                    Security::Tls(creds),
                )?)
            })
            .collect::<Result<Vec<_>, ClusterError>>()?;
        let pem = ca.issue(&NodeSpec {
            node: CLIENT_NODE,
            ..NodeSpec::default()
        })?;
        let dir = tempfile::Builder::new().prefix("netram-tls-").tempdir()?;
        pki::write_node(dir.path(), &pem)?;
        Ok(Self {
            servers,
            client: Security::Tls(Arc::new(Credentials::from_pem(&pem)?)),
            dir: Some(dir),
        })
    }

    /// Starts `n` servers in clear TCP (`--insecure`): for measuring what TLS costs.
    pub fn start_insecure(
        n: usize,
        capacity_bytes: u64,
        low_latency: bool,
    ) -> Result<Self, ClusterError> {
        let servers = (0..n)
            .map(|i| Self::server(i, capacity_bytes, low_latency, Security::Insecure))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            servers,
            client: Security::Insecure,
            dir: None,
        })
    }

    fn server(
        i: usize,
        capacity_bytes: u64,
        low_latency: bool,
        security: Security,
    ) -> Result<Server, ServerError> {
        let cfg = ServerConfig {
            listen: "127.0.0.1:0".parse().expect("loopback address"),
            capacity_bytes,
            lease_period: Duration::from_secs(2),
            low_latency,
            node: i as u64 + 1,
            security,
            ..Default::default()
        };
        Server::start(cfg, Arc::new(AtomicBool::new(false)))
    }

    pub fn addrs(&self) -> Vec<String> {
        self.servers.iter().map(|s| s.addr().to_string()).collect()
    }

    /// How this process's clients reach the servers.
    pub fn security(&self) -> Security {
        self.client.clone()
    }

    /// A client configuration that reaches the servers (a fresh identity each call).
    pub fn client(&self) -> ClientConfig {
        ClientConfig {
            security: self.client.clone(),
            ..ClientConfig::new()
        }
    }

    /// The clients' credentials as a directory (`NETRAM_TLS`, `--tls`), for programs this
    /// process starts; `None` in clear TCP.
    pub fn tls_dir(&self) -> Option<&Path> {
        self.dir.as_ref().map(|d| d.path())
    }

    pub fn stat(&self, server: usize, name: &str) -> u64 {
        self.servers[server]
            .stats()
            .into_iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v)
            .unwrap_or(0)
    }

    /// Stops every server and waits for their threads.
    pub fn stop(self) {
        for s in self.servers {
            s.stop();
        }
    }
}
