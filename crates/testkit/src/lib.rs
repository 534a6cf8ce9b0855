//! What netram's tests share that is not the product itself. Dev-only: no library crate
//! depends on it outside `[dev-dependencies]`.
//!
//! **Skipping is loud and counted.** A test that cannot run on this machine (a tool that is
//! not installed, no root) calls [`skip`] and returns: it says so on stderr, with the Debian
//! package that would let it run, and appends a line to the file named by `NETRAM_SKIP_LOG`.
//! `cargo xtask test` sets that variable, lists every skipped test at the end of the run and,
//! with `--no-skip` (what CI passes), fails if there is any. A plain `cargo test` still prints
//! the reason, but counts the test as passed: that is why the README's test command is the
//! xtask.

use std::io::Write;
use std::process::Command;

pub mod wire;

/// The environment variable naming the file skipped tests are appended to.
pub const SKIP_LOG: &str = "NETRAM_SKIP_LOG";

/// Records that the calling test is skipped because of `why`; `package` is what to install
/// (a Debian package), if that is the remedy. The caller returns right after.
pub fn skip(why: &str, package: Option<&str>) {
    let test = std::thread::current()
        .name()
        .unwrap_or("(unnamed test)")
        .to_owned();
    let remedy = package
        .map(|p| format!(" (apt-get install {p})"))
        .unwrap_or_default();
    eprintln!("SKIPPED {test}: {why}{remedy}");
    if let Some(path) = std::env::var_os(SKIP_LOG) {
        // One write of one line with O_APPEND: lines from tests running at once in threads and
        // processes do not interleave.
        let line = format!("{test}\t{why}{remedy}\n");
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = written {
            // The skip must not go uncounted: better to fail the test than to pass it.
            panic!("cannot record the skip in {}: {e}", path.to_string_lossy());
        }
    }
}

/// Whether every one of `tools` (tool, package) is on the PATH; skips naming the missing ones.
pub fn have_tools(tools: &[(&str, &str)]) -> bool {
    let missing: Vec<&(&str, &str)> = tools
        .iter()
        .filter(|(tool, _)| {
            !Command::new("sh")
                .args(["-c", &format!("command -v {tool} >/dev/null")])
                .status()
                .is_ok_and(|s| s.success())
        })
        .collect();
    if missing.is_empty() {
        return true;
    }
    let names: Vec<&str> = missing.iter().map(|(t, _)| *t).collect();
    let mut packages: Vec<&str> = missing.iter().map(|(_, p)| *p).collect();
    packages.dedup();
    skip(
        &format!("not installed: {}", names.join(", ")),
        Some(&packages.join(" ")),
    );
    false
}

/// Whether this process runs as root; if not, skips the calling test, saying what needs it.
pub fn have_root(what: &str) -> bool {
    // The effective uid, as the kernel sees it; no libc needed.
    let root = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        })
        .unwrap_or(false);
    if !root {
        skip(&format!("{what} needs root (CI runs as root)"), None);
    }
    root
}

/// A TCP relay in front of a server that can be told to hold every byte (the server hangs:
/// its connections stay open, nothing comes back). Its threads end when both sides close.
#[derive(Debug)]
pub struct Relay {
    /// Where clients connect.
    pub addr: String,
    /// While set, nothing is forwarded either way.
    pub frozen: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    /// Relays every connection made to [`Relay::addr`] to `to`.
    pub fn start(to: String) -> Relay {
        use std::net::{TcpListener, TcpStream};
        use std::sync::atomic::Ordering;
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let addr = listener.local_addr().expect("bound").to_string();
        let frozen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let held = frozen.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(&to) else {
                    return;
                };
                let pipe = |mut from: TcpStream, mut to: TcpStream| {
                    let held = held.clone();
                    std::thread::spawn(move || {
                        use std::io::{Read, Write};
                        let mut buf = vec![0u8; 1 << 16];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 {
                                break;
                            }
                            while held.load(Ordering::Relaxed) {
                                std::thread::sleep(std::time::Duration::from_millis(5));
                            }
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                };
                let (Ok(c), Ok(s)) = (client.try_clone(), server.try_clone()) else {
                    continue;
                };
                pipe(c, s);
                pipe(server, client);
            }
        });
        Relay { addr, frozen }
    }
}
