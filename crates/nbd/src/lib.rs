//! netram's NBD front end: a network block device whose blocks are pages in the cluster.
//!
//! This is how Distributed Anemone (paper 001, §2.1–2.2), Nswap and Markatos' pager reach
//! unmodified programs: the client machine gets a block device whose blocks live in other
//! machines' RAM, and the kernel swaps to it. Here the device is an NBD export served by
//! `netram nbd`, for the kernel's NBD client, nbdfuse, qemu or any NBD tool.
//!
//! * [`wire`]: the NBD protocol's bytes, I/O-free;
//! * [`device`]: byte ranges over the pager (read-modify-write, discards, block status);
//! * [`server`]: the handshake and the transmission phase of one connection;
//! * [`serve`]: the accept loop, one thread per connection, all sharing one device;
//! * [`fuse`]: the same device as one file through FUSE, for a loop device where the kernel
//!   has no NBD client.
//!
//! # Why the protocol is written here
//!
//! Evaluated (2026-11): `tokio-nbd` is GPL-2.0+ (netram is MIT/Apache), does not do structured
//! replies (so no BLOCK_STATUS), and runs on tokio, whose hand-offs `netram bench core` measured
//! costing more than blocking threads in the low-latency mode. `nbd` (0.2) calls itself "a first
//! sketch" and speaks simple replies only. The NBD server is the product here, small and fully
//! specified, so it is written by hand, with its parsers I/O-free so they can be fuzzed.

pub mod device;
pub mod fuse;
pub mod server;
pub mod wire;

pub use device::Device;
use netram_pager::{Disk, Transport};
use server::Socket;
use std::io;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where `netram nbd` listens.
#[derive(Debug)]
pub enum Listener {
    /// A unix socket, removed again when the server stops.
    Unix(UnixListener, PathBuf),
    Tcp(std::net::TcpListener),
}

impl std::os::fd::AsFd for Listener {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            Listener::Unix(l, _) => l.as_fd(),
            Listener::Tcp(l) => l.as_fd(),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Serves NBD on `listener` until `shutdown` is set, with at most `max_connections` at once.
/// Returns once every connection has ended.
pub fn serve<T, D>(
    listener: Listener,
    device: Arc<Device<T, D>>,
    shutdown: Arc<AtomicBool>,
    max_connections: usize,
) -> io::Result<()>
where
    T: Transport + Send + 'static,
    D: Disk + Send + 'static,
{
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let open: Arc<Open> = Arc::default();
    let live = Arc::new(AtomicUsize::new(0));
    let mut threads = Vec::new();
    let timeout = Timespec {
        tv_sec: 0,
        tv_nsec: 100_000_000,
    };
    while !shutdown.load(Ordering::SeqCst) {
        let mut fds = [PollFd::new(&listener, PollFlags::IN)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(e.into()),
        }
        let spawned = match &listener {
            Listener::Unix(l, _) => l
                .accept()
                .map(|(s, _)| start(s, &device, &shutdown, &open, &live, max_connections)),
            Listener::Tcp(l) => l.accept().map(|(s, _)| {
                let _ = s.set_nodelay(true);
                start(s, &device, &shutdown, &open, &live, max_connections)
            }),
        };
        match spawned {
            Ok(Some(t)) => threads.push(t),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!("accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        threads.retain(|t: &std::thread::JoinHandle<()>| !t.is_finished());
    }
    // Unblock connections waiting in `read`, then wait for them.
    for shut in open.lock().unwrap_or_else(|p| p.into_inner()).values() {
        shut();
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

/// How to shut down each open connection, by connection number; an entry (and the socket
/// handle it holds) goes away with its connection.
type Open = Mutex<std::collections::HashMap<u64, Box<dyn Fn() + Send>>>;

fn start<S: Socket, T, D>(
    socket: S,
    device: &Arc<Device<T, D>>,
    shutdown: &Arc<AtomicBool>,
    open: &Arc<Open>,
    live: &Arc<AtomicUsize>,
    max_connections: usize,
) -> Option<std::thread::JoinHandle<()>>
where
    T: Transport + Send + 'static,
    D: Disk + Send + 'static,
{
    if live.load(Ordering::SeqCst) >= max_connections {
        tracing::warn!("refusing an NBD connection: {max_connections} is the limit");
        return None; // dropping the socket closes it
    }
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    if let Ok(handle) = socket.try_clone() {
        open.lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Box::new(move || handle.shut()));
    }
    live.fetch_add(1, Ordering::SeqCst);
    let (device, shutdown, live2, open2) =
        (device.clone(), shutdown.clone(), live.clone(), open.clone());
    let spawned = std::thread::Builder::new()
        .name("netram-nbd-conn".into())
        .spawn(move || {
            if let Err(e) = server::serve_connection(socket, &device, &shutdown) {
                tracing::info!("NBD connection ended: {e}");
            }
            open2.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            live2.fetch_sub(1, Ordering::SeqCst);
        });
    match spawned {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::error!("cannot start an NBD connection thread: {e}");
            open.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            live.fetch_sub(1, Ordering::SeqCst);
            None
        }
    }
}
