//! Between a process and its machine's agent (in the daemon): the local socket's requests,
//! and [`Segment`], what a program holds (MIRAGE+ §3's `shmget`/`shmat`, as an API).
//!
//! A `SOCK_SEQPACKET` socket, one request or answer per packet, in text; descriptors travel
//! beside them (`SCM_RIGHTS`):
//!
//! ```text
//! create NAME BYTES DELTA_MS MODE [NODE,NODE,…]   → ok SEGMENT PAGES + the segment's memfd
//! attach NAME                                    → ok SEGMENT PAGES + the segment's memfd
//! view SEGMENT BASE PAGES + the process's uffd   → ok
//! lookup NAME                                    → ok SEGMENT PAGES UID MODE
//! unlink NAME                                    → ok  (System V's IPC_RMID)
//! join SEGMENT                                   → ok  (a forked child's own connection)
//! any                                            → err WHY
//! ```
//!
//! The agent trusts nothing in a request: the name is checked (1–255 bytes, no spaces or
//! control characters), sizes bounded, the caller's uid taken from the socket
//! (`SO_PEERCRED`), never from the request. A process's views go when its connection
//! closes.

use crate::agent::SegmentId;
use crate::memory::Mapped;
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::io::Errno;
use std::path::{Path, PathBuf};

/// The longest packet either side sends.
pub const MAX_PACKET: usize = 4096;
/// The largest segment (bytes): 64 GiB.
pub const MAX_SEGMENT_BYTES: u64 = 64 << 30;

/// A request, parsed and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Create {
        name: String,
        bytes: u64,
        delta_ms: u32,
        mode: u16,
        /// The sites admitted; `None`: every member.
        members: Option<Vec<u64>>,
    },
    Attach {
        name: String,
    },
    View {
        segment: SegmentId,
        base: usize,
        pages: u32,
    },
    Lookup {
        name: String,
    },
    Unlink {
        name: String,
    },
    Join {
        segment: SegmentId,
    },
}

/// Whether `name` may name a segment.
pub fn valid_name(name: &str) -> bool {
    (1..=netram_proto::dsm::MAX_NAME).contains(&name.len())
        && !name.chars().any(|c| c.is_whitespace() || c.is_control())
}

impl Request {
    /// Parses a packet; why not, if it is not a request.
    pub fn parse(packet: &[u8]) -> Result<Request, String> {
        let text = std::str::from_utf8(packet).map_err(|_| "not UTF-8".to_string())?;
        let words: Vec<&str> = text.split(' ').collect();
        let name = |w: &str| {
            if valid_name(w) {
                Ok(w.to_owned())
            } else {
                Err(format!("bad segment name {w:?}"))
            }
        };
        let num = |w: &str, what: &str| -> Result<u64, String> {
            w.parse::<u64>().map_err(|_| format!("bad {what} {w:?}"))
        };
        match words.as_slice() {
            ["create", n, bytes, delta, mode, rest @ ..] if rest.len() <= 1 => {
                let bytes = num(bytes, "size")?;
                if bytes == 0 || bytes > MAX_SEGMENT_BYTES {
                    return Err(format!(
                        "a segment is 1 byte to {} GiB",
                        MAX_SEGMENT_BYTES >> 30
                    ));
                }
                let delta_ms = u32::try_from(num(delta, "window")?)
                    .map_err(|_| "window too long".to_string())?;
                let mode = u16::from_str_radix(mode, 8)
                    .ok()
                    .filter(|m| *m <= 0o777)
                    .ok_or_else(|| format!("bad mode {mode:?}"))?;
                let members = match rest.first() {
                    None => None,
                    Some(list) => Some(
                        list.split(',')
                            .map(|n| num(n, "node id"))
                            .collect::<Result<Vec<u64>, String>>()?,
                    )
                    .filter(|m| m.len() <= 4096),
                };
                Ok(Request::Create {
                    name: name(n)?,
                    bytes,
                    delta_ms,
                    mode,
                    members,
                })
            }
            ["attach", n] => Ok(Request::Attach { name: name(n)? }),
            ["lookup", n] => Ok(Request::Lookup { name: name(n)? }),
            ["unlink", n] => Ok(Request::Unlink { name: name(n)? }),
            ["join", seg] => Ok(Request::Join {
                segment: u64::from_str_radix(seg, 16).map_err(|_| "bad segment".to_string())?,
            }),
            ["view", seg, base, pages] => Ok(Request::View {
                segment: u64::from_str_radix(seg, 16).map_err(|_| "bad segment".to_string())?,
                base: num(base, "address")? as usize,
                pages: u32::try_from(num(pages, "page count")?)
                    .map_err(|_| "too many pages".to_string())?,
            }),
            _ => Err("unknown request".into()),
        }
    }

    /// The packet.
    pub fn encode(&self) -> String {
        match self {
            Request::Create {
                name,
                bytes,
                delta_ms,
                mode,
                members,
            } => {
                let mut s = format!("create {name} {bytes} {delta_ms} {mode:o}");
                if let Some(m) = members {
                    let list: Vec<String> = m.iter().map(u64::to_string).collect();
                    s.push(' ');
                    s.push_str(&list.join(","));
                }
                s
            }
            Request::Attach { name } => format!("attach {name}"),
            Request::Lookup { name } => format!("lookup {name}"),
            Request::Unlink { name } => format!("unlink {name}"),
            Request::Join { segment } => format!("join {segment:x}"),
            Request::View {
                segment,
                base,
                pages,
            } => format!("view {segment:x} {base} {pages}"),
        }
    }
}

/// Sends one packet, with a descriptor if given.
pub fn send(sock: impl AsFd, packet: &[u8], fd: Option<BorrowedFd<'_>>) -> Result<(), Errno> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut ancillary = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = fd {
        fds = [fd];
        ancillary.push(SendAncillaryMessage::ScmRights(&fds));
    }
    rustix::net::sendmsg(
        sock,
        &[std::io::IoSlice::new(packet)],
        &mut ancillary,
        SendFlags::NOSIGNAL,
    )
    .map(drop)
}

/// A packet and the descriptor that came with it.
pub type Packet = (Vec<u8>, Option<OwnedFd>);

/// Receives one packet and the descriptor beside it, if any; `None` when the other side
/// closed.
pub fn recv(sock: impl AsFd) -> Result<Option<Packet>, Errno> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
    let mut buf = vec![0u8; MAX_PACKET];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut ancillary = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        match rustix::net::recvmsg(
            &sock,
            &mut [std::io::IoSliceMut::new(&mut buf)],
            &mut ancillary,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Err(Errno::INTR) => continue,
            r => break r?,
        }
    };
    let mut fd = None;
    for m in ancillary.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            // More than one descriptor is a confused or hostile sender: the rest close.
            for f in fds {
                fd.get_or_insert(f);
            }
        }
    }
    if got.bytes == 0 && fd.is_none() {
        return Ok(None);
    }
    if got.flags.contains(ReturnFlags::TRUNC) || got.flags.contains(ReturnFlags::CTRUNC) {
        return Err(Errno::MSGSIZE);
    }
    buf.truncate(got.bytes);
    Ok(Some((buf, fd)))
}

/// Where the agent of the daemon whose control socket is `control` listens.
pub fn socket_of(control: &Path) -> PathBuf {
    control.with_extension("shm.sock")
}

/// Why a segment could not be created or attached.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    #[error("cannot reach the netram daemon's shared-memory socket {path}: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is answered by uid {uid}, neither root nor this user: not trusted")]
    Untrusted { path: PathBuf, uid: u32 },
    #[error("the daemon refused: {0}")]
    Refused(String),
    #[error("the daemon answered {0:?}")]
    Confused(String),
    #[error("{0}")]
    Os(#[from] Errno),
}

/// A segment attached to this process: `len` bytes at `ptr`, coherent with every other
/// process that attached it, on this machine or another.
#[derive(Debug)]
pub struct Segment(Box<Attached>);

/// What a [`Segment`] holds, boxed so that its address stays put: the fork handler finds
/// every live one by it ([`follow_forks`]).
#[derive(Debug)]
struct Attached {
    mapped: Mapped,
    id: SegmentId,
    /// The daemon's socket, for a forked child's own connection.
    socket: PathBuf,
    /// Kept open: the daemon drops this process's view when it closes.
    sock: OwnedFd,
}

/// Every live attachment of this process, by address.
static LIVE: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

fn live() -> std::sync::MutexGuard<'static, Vec<usize>> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for Segment {
    fn drop(&mut self) {
        let me = &*self.0 as *const Attached as usize;
        live().retain(|&a| a != me);
    }
}

thread_local! {
    /// The attachments' lock, held across a fork by the forking thread (no other thread
    /// holds it in the child, where that thread does not exist).
    static HELD: std::cell::RefCell<Option<std::sync::MutexGuard<'static, Vec<usize>>>> =
        const { std::cell::RefCell::new(None) };
}

/// Makes every forked child of this process register its inherited attachments again before
/// `fork` returns in it (a child does not inherit its parent's userfaultfd registration: its
/// mapping would read holes as zeros and write unseen). A child that cannot exits with status
/// 127 rather than use them incoherently. Idempotent; the System V preload and the C ABI call
/// it when they first attach.
pub fn follow_forks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: plain functions without arguments, as pthread_atfork wants.
        unsafe {
            libc::pthread_atfork(
                Some(before_fork),
                Some(after_fork_parent),
                Some(after_fork_child),
            )
        };
    });
}

extern "C" fn before_fork() {
    let g = live();
    HELD.with(|h| *h.borrow_mut() = Some(g));
}

extern "C" fn after_fork_parent() {
    HELD.with(|h| drop(h.borrow_mut().take()));
}

extern "C" fn after_fork_child() {
    let _ = std::panic::catch_unwind(|| {
        HELD.with(|h| {
            let mut held = h.borrow_mut();
            for &a in held.iter().flat_map(|g| g.iter()) {
                // SAFETY: a live attachment (listed until its segment drops), this child's
                // copy; no other thread exists in the child to touch it.
                let att = unsafe { &mut *(a as *mut Attached) };
                if let Err(e) = att.follow_fork() {
                    eprintln!("netram: a forked child cannot follow its shared segments: {e}");
                    // SAFETY: ends the child before it uses a segment nobody keeps coherent.
                    unsafe { libc::_exit(127) };
                }
            }
            held.take();
        });
    });
}

impl Segment {
    /// Creates segment `name` of `bytes` bytes (rounded up to pages), with time window
    /// `delta_ms` and permission bits `mode`, through the daemon whose shared-memory socket is
    /// `socket`; `members`: the nodes that may attach it (`None`: every member).
    pub fn create(
        socket: &Path,
        name: &str,
        bytes: u64,
        delta_ms: u32,
        mode: u16,
        members: Option<Vec<u64>>,
    ) -> Result<Segment, SegmentError> {
        Self::open(
            socket,
            Request::Create {
                name: name.to_owned(),
                bytes,
                delta_ms,
                mode,
                members,
            },
        )
    }

    /// Attaches segment `name`, created on this machine or another.
    pub fn attach(socket: &Path, name: &str) -> Result<Segment, SegmentError> {
        Self::open(
            socket,
            Request::Attach {
                name: name.to_owned(),
            },
        )
    }

    fn open(socket: &Path, req: Request) -> Result<Segment, SegmentError> {
        Self::open_at(socket, req, None, false)
    }

    /// Attaches segment `name` at `addr` (where nothing is mapped, or replacing what is if
    /// `replace`: System V's `shmat` with an address, and `SHM_REMAP`), or where the kernel
    /// picks.
    pub fn attach_at(
        socket: &Path,
        name: &str,
        addr: Option<*mut u8>,
        replace: bool,
    ) -> Result<Segment, SegmentError> {
        Self::open_at(
            socket,
            Request::Attach {
                name: name.to_owned(),
            },
            addr,
            replace,
        )
    }

    fn open_at(
        socket: &Path,
        req: Request,
        addr: Option<*mut u8>,
        replace: bool,
    ) -> Result<Segment, SegmentError> {
        let sock = connect(socket)?;
        send(&sock, req.encode().as_bytes(), None)?;
        let (answer, fd) = ask(&sock)?;
        let (id, pages) = match answer.split(' ').collect::<Vec<_>>().as_slice() {
            ["ok", id, pages] => (u64::from_str_radix(id, 16).ok(), pages.parse::<u32>().ok()),
            _ => (None, None),
        };
        let (Some(id), Some(pages), Some(fd)) = (id, pages, fd) else {
            return Err(SegmentError::Confused(answer));
        };
        let mut mapped = Mapped::new_at(&fd, pages, addr, replace)?;
        view(&sock, id, &mut mapped)?;
        let seg = Segment(Box::new(Attached {
            mapped,
            id,
            socket: socket.to_path_buf(),
            sock,
        }));
        live().push(&*seg.0 as *const Attached as usize);
        Ok(seg)
    }

    /// Segment `name`'s size and permissions, if it exists (on any machine).
    pub fn lookup(socket: &Path, name: &str) -> Result<Option<Info>, SegmentError> {
        let sock = connect(socket)?;
        let req = Request::Lookup {
            name: name.to_owned(),
        };
        send(&sock, req.encode().as_bytes(), None)?;
        let answer = match ask(&sock) {
            Ok((a, _)) => a,
            Err(SegmentError::Refused(why)) if why.starts_with("no segment") => return Ok(None),
            Err(e) => return Err(e),
        };
        let w: Vec<&str> = answer.split(' ').collect();
        let parse = || -> Option<Info> {
            match w.as_slice() {
                ["ok", id, pages, uid, mode] => Some(Info {
                    segment: u64::from_str_radix(id, 16).ok()?,
                    pages: pages.parse().ok()?,
                    uid: uid.parse().ok()?,
                    mode: u16::from_str_radix(mode, 8).ok()?,
                }),
                _ => None,
            }
        };
        parse().map(Some).ok_or(SegmentError::Confused(answer))
    }

    /// Takes segment `name`'s name away (System V's IPC_RMID): nobody attaches it by name any
    /// more; the processes attached keep it.
    pub fn unlink(socket: &Path, name: &str) -> Result<(), SegmentError> {
        let sock = connect(socket)?;
        let req = Request::Unlink {
            name: name.to_owned(),
        };
        send(&sock, req.encode().as_bytes(), None)?;
        ask(&sock).map(drop)
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.0.mapped.ptr
    }

    pub fn len(&self) -> usize {
        self.0.mapped.len
    }

    pub fn is_empty(&self) -> bool {
        self.0.mapped.len == 0
    }

    pub fn id(&self) -> SegmentId {
        self.0.id
    }
}

impl Attached {
    /// In a forked child: the mapping it inherited faults to no one, so it registers its own
    /// and hands it to the daemon over its own connection.
    fn follow_fork(&mut self) -> Result<(), SegmentError> {
        let sock = connect(&self.socket)?;
        send(
            &sock,
            Request::Join { segment: self.id }.encode().as_bytes(),
            None,
        )?;
        ask(&sock)?;
        self.mapped.register_again()?;
        view(&sock, self.id, &mut self.mapped)?;
        self.sock = sock;
        Ok(())
    }
}

/// A segment as a lookup finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Info {
    pub segment: SegmentId,
    pub pages: u32,
    pub uid: u32,
    pub mode: u16,
}

/// Connects to the daemon's shared-memory socket; only root's daemon or this user's own may
/// hand out memory to map.
fn connect(socket: &Path) -> Result<OwnedFd, SegmentError> {
    use rustix::net::{socket_with, AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let sock = socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let addr = SocketAddrUnix::new(socket)?;
    rustix::net::connect(&sock, &addr).map_err(|e| SegmentError::Connect {
        path: socket.to_path_buf(),
        source: e.into(),
    })?;
    let cred = rustix::net::sockopt::socket_peercred(&sock)?;
    let me = rustix::process::geteuid().as_raw();
    if cred.uid.as_raw() != 0 && cred.uid.as_raw() != me {
        return Err(SegmentError::Untrusted {
            path: socket.to_path_buf(),
            uid: cred.uid.as_raw(),
        });
    }
    Ok(sock)
}

/// Hands `mapped`'s userfaultfd to the daemon as a view of segment `id`.
fn view(sock: &OwnedFd, id: SegmentId, mapped: &mut Mapped) -> Result<(), SegmentError> {
    let uffd = mapped
        .take_uffd()
        .expect("a new registration's userfaultfd");
    let req = Request::View {
        segment: id,
        base: mapped.ptr as usize,
        pages: (mapped.len / netram_proto::PAGE_SIZE) as u32,
    };
    send(sock, req.encode().as_bytes(), Some(uffd.as_fd()))?;
    drop(uffd);
    let (answer, _) = ask(sock)?;
    if answer != "ok" {
        return Err(SegmentError::Confused(answer));
    }
    Ok(())
}

/// Reads an answer: `ok …` with its descriptor, or the daemon's refusal as an error.
fn ask(sock: &OwnedFd) -> Result<(String, Option<OwnedFd>), SegmentError> {
    let Some((packet, fd)) = recv(sock)? else {
        return Err(SegmentError::Confused("connection closed".into()));
    };
    let text = String::from_utf8_lossy(&packet).into_owned();
    match text.strip_prefix("err ") {
        Some(why) => Err(SegmentError::Refused(why.to_owned())),
        None => Ok((text, fd)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_as_they_encode_and_bad_ones_are_refused() {
        for r in [
            Request::Create {
                name: "m".into(),
                bytes: 4096,
                delta_ms: 3,
                mode: 0o640,
                members: Some(vec![1, 2]),
            },
            Request::Create {
                name: "sysv:0x1234".into(),
                bytes: 1,
                delta_ms: 0,
                mode: 0o600,
                members: None,
            },
            Request::Attach { name: "x".into() },
            Request::Lookup { name: "x".into() },
            Request::Unlink { name: "x".into() },
            Request::Join { segment: 7 },
            Request::View {
                segment: 0xabc,
                base: 0x7f00_0000_0000,
                pages: 9,
            },
        ] {
            assert_eq!(Request::parse(r.encode().as_bytes()), Ok(r));
        }
        for bad in [
            "",
            "create",
            "create a 0 0 600",
            "create a 99999999999999999 0 600",
            "create a 4096 0 999",
            "create a 4096 0 600 1,x",
            "attach",
            "attach a b",
            "attach \u{7}",
            "view zz 0 1",
            "destroy x",
        ] {
            assert!(Request::parse(bad.as_bytes()).is_err(), "{bad:?}");
        }
        let long = format!("attach {}", "n".repeat(256));
        assert!(Request::parse(long.as_bytes()).is_err());
    }
}
