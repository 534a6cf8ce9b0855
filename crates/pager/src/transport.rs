//! The two seams through which the pager reaches the world: a [`Transport`] to page servers and
//! a [`Disk`] for the local spill file. The daemon plugs in TCP sockets and a file; tests and the
//! simulator plug in memory.

use netram_proto::{Reply, Request};
use std::collections::HashMap;

/// What the pager knows of a server before its first request: its handshake.
#[derive(Debug, Clone)]
pub struct ServerInfo {
    /// How the server is named in errors and logs (its address).
    pub name: String,
    /// The address other servers reach it at: dynamic parity names holders and members by it.
    /// `None` when the name did not resolve.
    pub addr: Option<std::net::SocketAddr>,
    /// Requests the server lets this client have outstanding.
    pub window: u32,
    pub capacity_pages: u64,
    pub free_pages: u64,
    /// Whether the handshake succeeded; the reason if not (the server starts out dead).
    pub connected: Result<(), String>,
}

/// Why a server gave no usable reply. Any of these marks the server dead.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransportError {
    #[error("connection lost: {0}")]
    Disconnected(String),
    #[error("no reply within {0} ms")]
    Timeout(u64),
    #[error("protocol error: {0}")]
    Protocol(String),
}

/// Requests out, replies in, one connection per server.
///
/// `send` may queue the request; `recv` must first make sure every queued request (to any
/// server) is on its way, then wait for the next reply from `server`. Replies of one server may
/// come in any order; the pager matches them by request id.
pub trait Transport {
    fn servers(&self) -> Vec<ServerInfo>;
    fn send(&mut self, server: usize, req_id: u64, req: &Request<'_>)
        -> Result<(), TransportError>;
    /// The reply borrows the transport's receive buffer until it is dropped.
    fn recv(&mut self, server: usize) -> Result<(u64, Reply<'_>), TransportError>;
    /// Opens a new connection (and session) to a server the pager had declared dead, dropping
    /// the old one. The server is treated as empty afterwards: whatever the old session held is
    /// freed by its lease. A transport that cannot reconnect says so.
    fn reconnect(&mut self, server: usize) -> Result<ServerInfo, TransportError> {
        let _ = server;
        Err(TransportError::Disconnected(
            "this transport does not reconnect".into(),
        ))
    }
}

/// The local disk: one page-sized slot per page number.
pub trait Disk {
    fn write(&mut self, page: u64, data: &[u8]) -> std::io::Result<()>;
    fn read(&mut self, page: u64, out: &mut [u8]) -> std::io::Result<()>;
    /// The page is dead: its space may be given back.
    fn discard(&mut self, page: u64) -> std::io::Result<()>;
}

/// A disk in memory, for tests and the simulator.
#[derive(Debug, Default)]
pub struct MemDisk {
    pages: HashMap<u64, Box<[u8]>>,
}

impl MemDisk {
    pub fn len(&self) -> usize {
        self.pages.len()
    }
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }
}

impl Disk for MemDisk {
    fn write(&mut self, page: u64, data: &[u8]) -> std::io::Result<()> {
        self.pages.insert(page, data.into());
        Ok(())
    }
    fn read(&mut self, page: u64, out: &mut [u8]) -> std::io::Result<()> {
        match self.pages.get(&page) {
            Some(d) => {
                out.copy_from_slice(d);
                Ok(())
            }
            None => Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("page {page} was never written to disk"),
            )),
        }
    }
    fn discard(&mut self, page: u64) -> std::io::Result<()> {
        self.pages.remove(&page);
        Ok(())
    }
}
