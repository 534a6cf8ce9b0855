//! The limit netram is held to: a plain TCP exchange on loopback, a 32-byte request and a
//! 4 KiB reply, with blocking sockets and TCP_NODELAY, written the simple way.

use netram_client::latency::{PmQos, DEFAULT_SPIN};
use std::io::{BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub const REQUEST_LEN: usize = 32;
pub const REPLY_LEN: usize = 4096;

/// How the raw exchange waits for data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Blocking reads: each side sleeps until data arrives.
    Block,
    /// Each side polls its socket for up to [`DEFAULT_SPIN`] before it blocks: the same policy
    /// as netram's low-latency mode (the PM QoS request is the caller's to hold).
    Poll,
}

/// Reads exactly `buf.len()` bytes, polling without blocking for up to `spin` first.
fn read_exact_wait(s: &mut TcpStream, buf: &mut [u8], spin: Duration) -> std::io::Result<()> {
    let mut at = 0;
    let until = Instant::now() + spin;
    while at < buf.len() && Instant::now() < until {
        match rustix::net::recv(&*s, &mut buf[at..], rustix::net::RecvFlags::DONTWAIT) {
            Ok((0, _)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok((n, _)) => at += n,
            Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => std::hint::spin_loop(),
            Err(e) => return Err(e.into()),
        }
    }
    s.read_exact(&mut buf[at..])
}

/// A connection to a raw server thread on an ephemeral loopback port, kept open so that raw and
/// netram exchanges can be measured in alternating blocks on the same machine state.
pub struct RawPeer {
    stream: Option<TcpStream>,
    spin: Duration,
    server: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RawPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawPeer").field("spin", &self.spin).finish()
    }
}

impl RawPeer {
    pub fn start(wait: Wait) -> std::io::Result<Self> {
        let spin = if wait == Wait::Poll {
            DEFAULT_SPIN
        } else {
            Duration::ZERO
        };
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let server = std::thread::spawn(move || {
            let Ok((mut s, _)) = listener.accept() else {
                return;
            };
            let _ = s.set_nodelay(true);
            let reply = vec![0x5au8; REPLY_LEN];
            let mut req = [0u8; REQUEST_LEN];
            while read_exact_wait(&mut s, &mut req, spin).is_ok() {
                if s.write_all(&reply).is_err() {
                    break;
                }
            }
        });
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream: Some(stream),
            spin,
            server: Some(server),
        })
    }

    /// Times `n` depth-1 exchanges, appending nanoseconds to `out`.
    pub fn exchange(&mut self, n: usize, out: &mut Vec<u64>) -> std::io::Result<()> {
        let s = self.stream.as_mut().expect("open until dropped");
        let req = [0x11u8; REQUEST_LEN];
        let mut reply = vec![0u8; REPLY_LEN];
        for _ in 0..n {
            let t = Instant::now();
            s.write_all(&req)?;
            read_exact_wait(s, &mut reply, self.spin)?;
            out.push(t.elapsed().as_nanos() as u64);
        }
        Ok(())
    }
}

impl Drop for RawPeer {
    fn drop(&mut self) {
        drop(self.stream.take());
        if let Some(t) = self.server.take() {
            let _ = t.join();
        }
    }
}

/// Exchanges per second with `depth` requests kept in flight on one connection, for about
/// `duration`.
pub fn pipelined(depth: usize, duration: Duration) -> std::io::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || {
        let Ok((s, _)) = listener.accept() else {
            return;
        };
        let _ = s.set_nodelay(true);
        let reply = vec![0x5au8; REPLY_LEN];
        let mut req = [0u8; REQUEST_LEN];
        let Ok(mut w) = s.try_clone() else { return };
        let mut r = BufReader::with_capacity(64 * 1024, s);
        while r.read_exact(&mut req).is_ok() {
            if w.write_all(&reply).is_err() {
                break;
            }
        }
    });
    let s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let mut w = s.try_clone()?;
    let mut r = BufReader::with_capacity(256 * 1024, s);
    let req = [0x11u8; REQUEST_LEN];
    let mut reply = vec![0u8; REPLY_LEN];
    for _ in 0..depth {
        w.write_all(&req)?;
    }
    let start = Instant::now();
    let mut done = 0u64;
    while start.elapsed() < duration {
        for _ in 0..256 {
            r.read_exact(&mut reply)?;
            w.write_all(&req)?;
            done += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    for _ in 0..depth {
        r.read_exact(&mut reply)?;
    }
    drop(w);
    drop(r);
    let _ = server.join();
    Ok(done as f64 / secs)
}

/// The same depth-1 exchange through tokio: a multi-threaded runtime serving the connection and
/// a current-thread runtime driving the client. It measures what an async runtime's hand-offs
/// between the socket's readiness and the task cost here, to ground netram's choice of plain
/// threads (`crates/server/src/lib.rs`).
pub fn rtt_tokio(iters: usize, warmup: usize, pm_qos: bool) -> std::io::Result<Vec<u64>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _qos = pm_qos.then(PmQos::hold).flatten();
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_io()
        .build()?;
    let listener = server_rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    server_rt.spawn(async move {
        let Ok((mut s, _)) = listener.accept().await else {
            return;
        };
        let _ = s.set_nodelay(true);
        let reply = vec![0x5au8; REPLY_LEN];
        let mut req = [0u8; REQUEST_LEN];
        while s.read_exact(&mut req).await.is_ok() {
            if s.write_all(&reply).await.is_err() {
                break;
            }
        }
    });
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let samples = client_rt.block_on(async move {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        let req = [0x11u8; REQUEST_LEN];
        let mut reply = vec![0u8; REPLY_LEN];
        let mut samples = Vec::with_capacity(iters);
        for i in 0..warmup + iters {
            let t = Instant::now();
            s.write_all(&req).await?;
            s.read_exact(&mut reply).await?;
            if i >= warmup {
                samples.push(t.elapsed().as_nanos() as u64);
            }
        }
        Ok::<_, std::io::Error>(samples)
    })?;
    server_rt.shutdown_timeout(Duration::from_secs(1));
    Ok(samples)
}
