//! The limit netram is held to: a plain TCP exchange on loopback, a 32-byte request and a
//! 4 KiB reply, with blocking sockets and TCP_NODELAY, written the simple way.

use netram_node::latency::PmQos;
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
    /// Both sides poll the socket without sleeping (plus the PM QoS request, when held).
    Poll,
}

/// An echo-style server on an ephemeral loopback port, serving one connection until it closes.
struct RawServer {
    addr: std::net::SocketAddr,
    thread: JoinHandle<()>,
}

fn read_exact_polling(s: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        match rustix::net::recv(&*s, &mut buf[at..], rustix::net::RecvFlags::DONTWAIT) {
            Ok((0, _)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok((n, _)) => at += n,
            Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => std::hint::spin_loop(),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

impl RawServer {
    fn start(wait: Wait) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let thread = std::thread::spawn(move || {
            let Ok((s, _)) = listener.accept() else {
                return;
            };
            let _ = s.set_nodelay(true);
            let reply = vec![0x5au8; REPLY_LEN];
            let mut req = [0u8; REQUEST_LEN];
            let mut w = s.try_clone().expect("clone socket");
            match wait {
                Wait::Block => {
                    let mut r = BufReader::with_capacity(64 * 1024, s);
                    while r.read_exact(&mut req).is_ok() {
                        if w.write_all(&reply).is_err() {
                            break;
                        }
                    }
                }
                Wait::Poll => {
                    let mut s = s;
                    while read_exact_polling(&mut s, &mut req).is_ok() {
                        if w.write_all(&reply).is_err() {
                            break;
                        }
                    }
                }
            }
        });
        Ok(Self { addr, thread })
    }
}

/// Round-trip times of `iters` depth-1 exchanges after `warmup` unmeasured ones, in ns.
pub fn rtt(iters: usize, warmup: usize, wait: Wait) -> std::io::Result<Vec<u64>> {
    let _qos = (wait == Wait::Poll).then(PmQos::hold).flatten();
    let server = RawServer::start(wait)?;
    let mut s = TcpStream::connect(server.addr)?;
    s.set_nodelay(true)?;
    let req = [0x11u8; REQUEST_LEN];
    let mut reply = vec![0u8; REPLY_LEN];
    let mut samples = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        let t = Instant::now();
        s.write_all(&req)?;
        match wait {
            Wait::Block => s.read_exact(&mut reply)?,
            Wait::Poll => read_exact_polling(&mut s, &mut reply)?,
        }
        if i >= warmup {
            samples.push(t.elapsed().as_nanos() as u64);
        }
    }
    drop(s);
    let _ = server.thread.join();
    Ok(samples)
}

/// Exchanges per second with `depth` requests kept in flight on one connection, for about
/// `duration`.
pub fn pipelined(depth: usize, duration: Duration) -> std::io::Result<f64> {
    let server = RawServer::start(Wait::Block)?;
    let s = TcpStream::connect(server.addr)?;
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
    let _ = server.thread.join();
    Ok(done as f64 / secs)
}
