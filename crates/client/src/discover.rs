//! The servers of this machine's cluster, from its daemon (Nswap §III, Anemone §2.4: clients
//! find servers by themselves). A front end given no server list asks the local `netram serve`
//! what it believes of the cluster (`GET /members` on its metrics address, `NETRAM_DAEMON`,
//! [`DEFAULT_DAEMON`]) and uses every live member but the daemon itself — the node that runs
//! the program is never its own backing store.
//!
//! The answer only names addresses: each connection still checks, over TLS, that the server
//! there holds a certificate of the cluster with the server role.

use netram_member::{Liveness, MemberList};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Where the local daemon answers `/members` unless `NETRAM_DAEMON` says otherwise: `netram
/// serve`'s default metrics address for its default port.
pub const DEFAULT_DAEMON: &str = "127.0.0.1:9077";
/// Bytes of an answer read at most.
const MAX_ANSWER: u64 = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum DiscoverError {
    #[error(
        "cannot reach the local daemon at {daemon} (is `netram serve` running here?): {source}"
    )]
    Unreachable {
        daemon: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the daemon at {daemon} answered badly: {why}")]
    BadAnswer { daemon: String, why: String },
}

/// The daemon to ask: `NETRAM_DAEMON`, or [`DEFAULT_DAEMON`].
pub fn daemon_addr() -> String {
    std::env::var(crate::env::var::DAEMON)
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| DEFAULT_DAEMON.to_string())
}

/// What the daemon at `daemon` believes of the cluster.
pub fn members(daemon: &str, timeout: Duration) -> Result<MemberList, DiscoverError> {
    let unreachable = |source| DiscoverError::Unreachable {
        daemon: daemon.to_string(),
        source,
    };
    let bad = |why: String| DiscoverError::BadAnswer {
        daemon: daemon.to_string(),
        why,
    };
    let addr = daemon
        .to_socket_addrs()
        .map_err(unreachable)?
        .next()
        .ok_or_else(|| unreachable(std::io::ErrorKind::NotFound.into()))?;
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(unreachable)?;
    s.set_read_timeout(Some(timeout)).map_err(unreachable)?;
    s.set_write_timeout(Some(timeout)).map_err(unreachable)?;
    s.write_all(b"GET /members HTTP/1.0\r\nHost: netram\r\n\r\n")
        .map_err(unreachable)?;
    let mut answer = Vec::new();
    s.take(MAX_ANSWER)
        .read_to_end(&mut answer)
        .map_err(unreachable)?;
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("no end of headers".into()))?;
    let status = String::from_utf8_lossy(answer.split(|&b| b == b'\n').next().unwrap_or_default())
        .trim()
        .to_string();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(bad(status));
    }
    serde_json::from_slice(&answer[split + 4..]).map_err(|e| bad(e.to_string()))
}

/// The servers to page to: every member alive or suspected (not yet declared down) but the
/// daemon itself, most free pages first.
pub fn servers(list: &MemberList) -> Vec<String> {
    let mut rows: Vec<_> = list
        .members
        .iter()
        .filter(|r| !r.is_self && r.state != Liveness::Down)
        .collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.free_pages));
    rows.iter().map(|r| r.addr.to_string()).collect()
}
