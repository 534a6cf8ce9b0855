//! The servers of this machine's cluster, from its daemon (Nswap §III, Anemone §2.4: clients
//! find servers by themselves). A front end given no server list asks the local `netram serve`
//! what it believes of the cluster (`GET /members` on its control socket: `NETRAM_DAEMON`, or
//! [`default_control`]) and uses every live member but the daemon itself — the node that runs
//! the program is never its own backing store.
//!
//! The daemon is trusted for what it says only if it is the daemon: the socket must be in a
//! directory that no other user may write (root's, or this user's own), and the process that
//! answers must run as root or as this user (`SO_PEERCRED`). A TCP port, which any local user
//! can take while the daemon is down, is never asked. What the daemon says is advice all the
//! same: each connection still checks, over TLS, that the server there holds a certificate of
//! the cluster with the server role, and a client fails a server only on its own evidence
//! (`crate::maintain`).

use netram_member::{Liveness, MemberList};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The port of a daemon started with its defaults: its control socket is [`default_control`]
/// of it.
pub const DEFAULT_PORT: u16 = 7077;
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
    #[error("the daemon at {daemon} is not trusted: {why}")]
    Untrusted { daemon: String, why: String },
    #[error("the daemon at {daemon} answered badly: {why}")]
    BadAnswer { daemon: String, why: String },
}

/// Where a daemon listening on `port` puts its control socket unless told otherwise: under
/// `/run/netram` when it runs as root, else under `$XDG_RUNTIME_DIR/netram`, else
/// `/tmp/netram-UID` (each a directory only its owner writes).
pub fn default_control(port: u16) -> PathBuf {
    let uid = rustix::process::geteuid().as_raw();
    let dir = if uid == 0 {
        PathBuf::from("/run/netram")
    } else if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR").filter(|x| !x.is_empty()) {
        PathBuf::from(x).join("netram")
    } else {
        PathBuf::from(format!("/tmp/netram-{uid}"))
    };
    dir.join(format!("{port}.sock"))
}

/// The daemon to ask: `NETRAM_DAEMON` (its control socket's path), or else the default
/// daemon's: root's (`/run/netram/7077.sock`, where a daemon run by the system is) if it is
/// there, else this user's own.
pub fn daemon_addr() -> String {
    if let Some(d) = std::env::var(crate::env::var::DAEMON)
        .ok()
        .filter(|s| !s.is_empty())
    {
        return d;
    }
    let system = Path::new("/run/netram").join(format!("{DEFAULT_PORT}.sock"));
    let own = default_control(DEFAULT_PORT);
    if system.exists() || !own.exists() {
        system.display().to_string()
    } else {
        own.display().to_string()
    }
}

/// Whether the socket at `path` can only have been put there by root or this user, and is a
/// socket (not a link to one elsewhere).
fn check_place(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let me = rustix::process::geteuid().as_raw();
    let trusted = |uid: u32| uid == 0 || uid == me;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let d = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !d.is_dir() {
        return Err(format!("{} is not a directory", dir.display()));
    }
    if !trusted(d.uid()) {
        return Err(format!(
            "its directory {} belongs to user {}, neither root nor this user",
            dir.display(),
            d.uid()
        ));
    }
    if d.mode() & 0o022 != 0 {
        return Err(format!(
            "its directory {} may be written by other users (mode {:o})",
            dir.display(),
            d.mode() & 0o7777
        ));
    }
    let s = std::fs::symlink_metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !s.file_type().is_socket() {
        return Err(format!("{} is not a socket", path.display()));
    }
    if !trusted(s.uid()) {
        return Err(format!(
            "the socket belongs to user {}, neither root nor this user",
            s.uid()
        ));
    }
    Ok(())
}

/// What the daemon whose control socket is `daemon` believes of the cluster, once it proved
/// to be a daemon this user may believe.
pub fn members(daemon: &str, timeout: Duration) -> Result<MemberList, DiscoverError> {
    let body = control_get(daemon, "/members", timeout)?;
    serde_json::from_slice(&body).map_err(|e| DiscoverError::BadAnswer {
        daemon: daemon.to_string(),
        why: e.to_string(),
    })
}

/// The GMS epoch's plan the daemon whose control socket is `daemon` adopted (`netram cache`
/// evicts by it).
pub fn gms_plan(daemon: &str, timeout: Duration) -> Result<netram_member::PlanView, DiscoverError> {
    let body = control_get(daemon, "/gms", timeout)?;
    serde_json::from_slice(&body).map_err(|e| DiscoverError::BadAnswer {
        daemon: daemon.to_string(),
        why: e.to_string(),
    })
}

/// The daemon's counters, as its `/metrics` gives them (Prometheus' text format), from its
/// control socket (`netram top`).
pub fn metrics(daemon: &str, timeout: Duration) -> Result<String, DiscoverError> {
    let body = control_get(daemon, "/metrics", timeout)?;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// The body of `GET path` from the daemon whose control socket is `daemon`, once it proved to
/// be a daemon this user may believe (a socket only root or this user could have put there,
/// served by root or this user).
fn control_get(daemon: &str, path: &str, timeout: Duration) -> Result<Vec<u8>, DiscoverError> {
    let unreachable = |source| DiscoverError::Unreachable {
        daemon: daemon.to_string(),
        source,
    };
    let untrusted = |why: String| DiscoverError::Untrusted {
        daemon: daemon.to_string(),
        why,
    };
    let bad = |why: String| DiscoverError::BadAnswer {
        daemon: daemon.to_string(),
        why,
    };
    let socket = Path::new(daemon);
    if !socket.is_absolute() && daemon.parse::<std::net::SocketAddr>().is_ok() {
        return Err(untrusted(
            "a TCP address: the daemon is asked on its control socket only (NETRAM_DAEMON and \
             --daemon take its path, e.g. /run/netram/7077.sock)"
                .into(),
        ));
    }
    if !socket.exists() {
        return Err(unreachable(std::io::ErrorKind::NotFound.into()));
    }
    check_place(socket).map_err(untrusted)?;
    let mut s = UnixStream::connect(socket).map_err(unreachable)?;
    let peer = rustix::net::sockopt::socket_peercred(&s)
        .map_err(|e| untrusted(format!("who answers cannot be told: {e}")))?;
    let me = rustix::process::geteuid().as_raw();
    if peer.uid.as_raw() != 0 && peer.uid.as_raw() != me {
        return Err(untrusted(format!(
            "it is served by user {}, neither root nor this user",
            peer.uid.as_raw()
        )));
    }
    s.set_read_timeout(Some(timeout)).map_err(unreachable)?;
    s.set_write_timeout(Some(timeout)).map_err(unreachable)?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: netram\r\nConnection: close\r\n\r\n").as_bytes(),
    )
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
    Ok(answer.split_off(split + 4))
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A directory other users may write is no place for a daemon's socket: whoever made the
    /// socket there, it is not believed.
    #[test]
    fn a_socket_in_a_directory_others_may_write_is_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sock");
        let _l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = members(path.to_str().unwrap(), Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, DiscoverError::Untrusted { .. }), "{e}");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(check_place(&path).is_ok());
    }

    #[test]
    fn a_tcp_address_is_not_asked() {
        let e = members("127.0.0.1:9077", Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, DiscoverError::Untrusted { .. }), "{e}");
    }
}
