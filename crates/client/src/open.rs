//! A client pager from what a user types: servers, a backing, a size. Shared by every front
//! end (`netram nbd`, the C ABI, `netram run`'s preload library) so that they refuse the same
//! bad input with the same words.

use crate::disk::FileDisk;
use crate::tcp::{ClientConfig, TcpTransport};
use netram_net::{Credentials, Security, TlsError};
use netram_pager::{Backing, Pager, PagerConfig, Scheme};
use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a node's credentials are looked for when none are named (`--tls`, `NETRAM_TLS`).
pub const DEFAULT_TLS_DIR: &str = "/etc/netram";

/// Why a node has no way to talk to the cluster.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error(
        "no credentials: give the node's directory with --tls DIR or NETRAM_TLS=DIR (`netram \
         cluster init DIR` makes one), or run in clear on loopback with --insecure \
         (NETRAM_INSECURE=1)"
    )]
    NoCredentials,
    #[error("--tls and --insecure both given: choose one")]
    Both,
    #[error("credentials in {}: {source}", .dir.display())]
    Load {
        dir: PathBuf,
        #[source]
        source: TlsError,
    },
}

/// How this node talks to the cluster: its credentials from `tls` (or [`DEFAULT_TLS_DIR`] if
/// it exists), or clear TCP when `insecure` says so.
pub fn security(tls: Option<&Path>, insecure: bool) -> Result<Security, SecurityError> {
    let dir = match (tls, insecure) {
        (Some(_), true) => return Err(SecurityError::Both),
        (None, true) => return Ok(Security::Insecure),
        (Some(d), false) => d.to_path_buf(),
        (None, false) if Path::new(DEFAULT_TLS_DIR).join("node.pem").exists() => {
            PathBuf::from(DEFAULT_TLS_DIR)
        }
        (None, false) => return Err(SecurityError::NoCredentials),
    };
    let creds = Credentials::load(&dir).map_err(|source| SecurityError::Load { dir, source })?;
    Ok(Security::Tls(Arc::new(creds)))
}

/// A pager that front ends open: TCP to the page servers, a spill file on local disk.
pub type ClientPager = Pager<TcpTransport, FileDisk>;

#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// `netram serve` addresses.
    pub servers: Vec<String>,
    pub backing: Backing,
    /// Pages in the pager's address space.
    pub pages: u64,
    pub cache_pages: usize,
    /// Directory of the spill file [default: the temp dir].
    pub spill_dir: Option<PathBuf>,
    pub low_latency: bool,
    /// How pages survive servers' deaths: none, mirror:N, parity:N, rs:K+M.
    pub redundancy: Scheme,
    /// Mutual TLS with this node's credentials, or clear TCP (loopback servers only).
    pub security: Security,
}

/// Why no pager could be opened: what the user asked for makes no sense, or nothing can be
/// reached.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("the size must be above zero")]
    NoPages,
    #[error(
        "no page servers were given and {0}: give them, run `netram serve` with the cluster's \
         seeds on this machine (asked on its control socket: NETRAM_DAEMON, \
         /run/netram/7077.sock by default as root), or use backing disk"
    )]
    Discover(#[from] crate::discover::DiscoverError),
    #[error("the local daemon at {0} knows no other live member of the cluster yet")]
    NoMembers(String),
    #[error("redundancy {0} needs page servers: it means nothing with backing disk")]
    RedundancyWithoutServers(Scheme),
    #[error(
        "redundancy {scheme} puts its pieces on {needed} distinct servers, and {given} were given"
    )]
    TooFewServers {
        scheme: Scheme,
        needed: usize,
        given: usize,
    },
    #[error("redundancy {scheme}: cannot resolve {server}: {source}")]
    Resolve {
        scheme: Scheme,
        server: String,
        #[source]
        source: std::io::Error,
    },
    #[error("redundancy {scheme}: {server} resolves to no address")]
    NoAddress { scheme: Scheme, server: String },
    #[error("no page server could be reached: {}", .0.join(", "))]
    Unreachable(Vec<String>),
    #[error(
        "{0} is not on this machine: servers elsewhere are reached only over TLS (give the \
         node's credentials, not --insecure)"
    )]
    InsecureBeyondLoopback(String),
    #[error("cannot create a spill file in {}: {source}", .dir.display())]
    SpillFile {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Connects to the servers (going on without those that cannot be reached, with a warning,
/// as long as one can) and creates the spill file.
/// The rule by which a pager compresses its pages before it seals them over a link of
/// `link_mbps` Mbit/s (`Pager::set_compression`; MIRAGE+ §3.4): a page is sent as its LZ4
/// block when the wire time that saves exceeds the codec's time, measured here (a
/// millisecond or so). `None` for 0: never. Logged, with the saving a page needs.
pub fn compression(link_mbps: u32) -> Option<netram_proto::compress::Rule> {
    if link_mbps == 0 {
        return None;
    }
    let rule = netram_proto::compress::Rule {
        link_bytes_per_us: f64::from(link_mbps) / 8.0,
        codec_us: netram_proto::compress::calibrate(),
    };
    match rule.budget() {
        Some(_) => tracing::info!(
            link_mbps,
            codec_us = format!("{:.2}", rule.codec_us),
            "pages compressed before they are sealed when they shrink by {} bytes or more",
            rule.min_saving()
        ),
        None => tracing::info!(
            link_mbps,
            codec_us = format!("{:.2}", rule.codec_us),
            "pages never compressed: at this speed no saving repays the codec"
        ),
    }
    Some(rule)
}

/// Gives a pager just opened the rule for a link of `link_mbps` Mbit/s ([`compression`]); a
/// pager that cannot take it (it does not seal, or sealed pages already) is said so in the log.
pub fn compress(pager: &mut ClientPager, link_mbps: u32) {
    let rule = compression(link_mbps);
    if !pager.set_compression(rule) && rule.is_some() {
        tracing::warn!(
            "pages will not be compressed: the pager does not seal them, or sealed some already"
        );
    }
}

pub fn open_pager(o: &OpenOptions) -> Result<ClientPager, OpenError> {
    open_from(o, false)
}

/// [`open_pager`]; `discovered`: the servers are the local daemon's members.
fn open_from(o: &OpenOptions, discovered: bool) -> Result<ClientPager, OpenError> {
    if o.pages == 0 {
        return Err(OpenError::NoPages);
    }
    if o.servers.is_empty() && o.backing != Backing::Disk {
        let daemon = crate::discover::daemon_addr();
        let list = crate::discover::members(&daemon, std::time::Duration::from_secs(2))?;
        let servers = crate::discover::servers(&list);
        if servers.is_empty() {
            return Err(OpenError::NoMembers(daemon));
        }
        tracing::info!(%daemon, servers = servers.join(","), "servers from the local daemon");
        return open_from(
            &OpenOptions {
                servers,
                ..o.clone()
            },
            true,
        );
    }
    if o.redundancy != Scheme::None && o.backing == Backing::Disk {
        return Err(OpenError::RedundancyWithoutServers(o.redundancy));
    }
    let needed = o.redundancy.servers_needed();
    if o.backing != Backing::Disk && o.servers.len() < needed {
        return Err(OpenError::TooFewServers {
            scheme: o.redundancy,
            needed,
            given: o.servers.len(),
        });
    }
    if matches!(o.redundancy, Scheme::Parity { .. }) {
        // Servers tell each other about overwrites by the addresses the client names them
        // by: each must be one address that every server can reach.
        for s in &o.servers {
            let mut addrs = s.to_socket_addrs().map_err(|source| OpenError::Resolve {
                scheme: o.redundancy,
                server: s.clone(),
                source,
            })?;
            if addrs.next().is_none() {
                return Err(OpenError::NoAddress {
                    scheme: o.redundancy,
                    server: s.clone(),
                });
            }
        }
    }
    if !o.security.is_secure() {
        for s in &o.servers {
            let loopback = s
                .to_socket_addrs()
                .map(|mut a| a.all(|a| a.ip().is_loopback()))
                .unwrap_or(false);
            if !loopback {
                return Err(OpenError::InsecureBeyondLoopback(s.clone()));
            }
        }
    }
    let client = ClientConfig {
        low_latency: o.low_latency,
        security: o.security.clone(),
        // The pager below seals its pages (`PagerConfig`'s default).
        sealed_pages: true,
        ..ClientConfig::new()
    };
    let mut transport = TcpTransport::connect(&o.servers, &client);
    if discovered {
        transport.set_discovered();
    }
    let dead: Vec<String> = transport
        .servers_unreachable()
        .into_iter()
        .map(|(name, why)| format!("{name} ({why})"))
        .collect();
    if !o.servers.is_empty() && dead.len() == o.servers.len() {
        return Err(OpenError::Unreachable(dead));
    }
    for d in &dead {
        tracing::warn!("page server unreachable, going on without it: {d}");
    }
    let dir = o.spill_dir.clone().unwrap_or_else(std::env::temp_dir);
    let disk = FileDisk::create_in(&dir).map_err(|source| OpenError::SpillFile {
        dir: dir.clone(),
        source,
    })?;
    let cfg = PagerConfig {
        pages: o.pages,
        cache_pages: o.cache_pages,
        backing: o.backing,
        redundancy: o.redundancy,
        // Parity group ids start at a point drawn from the seed: pagers of one process share
        // its identity at the holders, so each needs its own.
        seed: fastrand::u64(..),
        ..Default::default()
    };
    Ok(Pager::new(cfg, transport, disk))
}
