//! The NBD server's protocol: the fixed-newstyle handshake, run by a thread per connection
//! over a unix or TCP socket, and the serving of a batch of transmission-phase requests, which
//! the transmission loop (`crate::transmit`) runs for every connection.
//!
//! Bad input gets the answer the protocol gives it, and the connection goes on: an unknown option
//! gets NBD_REP_ERR_UNSUP, a request out of range or with bad flags EINVAL (ENOSPC for a write
//! past the end), an unknown command EINVAL. Only what cannot be resynchronised closes the
//! connection: a bad magic, an option or a write larger than the limits, a client that vanishes.
//! Other connections are not affected, and no acknowledged write is lost: a write is answered
//! only once the pager holds it (and, with FUA, once it is on its backing).

use crate::device::{Device, DeviceError, Waits, MAX_REQUEST};
use crate::transmit::{Plain, Stream};
use crate::wire::*;
use netram_pager::{Disk, Transport};
use netram_policy::admission::Source;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Option data larger than this closes the connection (no option served needs a tenth of it).
const MAX_OPTION_LEN: u32 = 64 * 1024;
/// The one export; `""` (the default name) reaches it too.
pub const EXPORT_NAME: &str = "netram";
/// The context id of `base:allocation`, the only meta context served.
const BASE_ALLOCATION_ID: u32 = 1;
/// Extents in one BLOCK_STATUS reply at most.
const MAX_EXTENTS: usize = 16 * 1024;

const TRANSMISSION_FLAGS: u16 = TFLAG_HAS_FLAGS
    | TFLAG_SEND_FLUSH
    | TFLAG_SEND_FUA
    | TFLAG_SEND_TRIM
    | TFLAG_SEND_WRITE_ZEROES
    | TFLAG_SEND_DF
    | TFLAG_CAN_MULTI_CONN
    | TFLAG_SEND_CACHE
    | TFLAG_SEND_FAST_ZERO;

/// A socket whose read and write sides can be used through two handles, and that can be shut
/// down from another thread (to end a connection blocked in `read` when the server stops).
pub trait Socket: Read + Write + Send + Sized + 'static {
    fn try_clone(&self) -> io::Result<Self>;
    fn shut(&self);
    fn set_write_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()>;
    /// Who is at the other end, for the limit of connections per client: the address for TCP,
    /// the user id for a unix socket (over TLS, the certificate's node once it is known:
    /// [`Socket::node`]).
    fn peer(&self) -> String;
    /// Where it comes from, for the limits of handshakes in progress.
    fn source(&self) -> Source;
    /// Whether the client hung up (a connection it aborted may be waiting for its thread to
    /// notice: it must not count against a new one).
    fn hung_up(&self) -> bool;
    /// The node whose certificate the client proved (over TLS only).
    fn node(&self) -> Option<u64> {
        None
    }
    /// The TCP connection under this socket, to start TLS on (NBD_OPT_STARTTLS).
    fn into_tcp(self) -> Option<std::net::TcpStream> {
        None
    }
    /// The socket for the transmission loop: non-blocking, with nothing else holding it.
    fn into_stream(self) -> io::Result<Box<dyn Stream>>;
}

impl Socket for std::net::TcpStream {
    fn try_clone(&self) -> io::Result<Self> {
        std::net::TcpStream::try_clone(self)
    }
    fn shut(&self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }
    fn set_write_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        std::net::TcpStream::set_write_timeout(self, t)
    }
    fn peer(&self) -> String {
        self.peer_addr()
            .map(|a| a.ip().to_string())
            .unwrap_or_default()
    }
    fn source(&self) -> Source {
        match self.peer_addr() {
            Ok(a) => Source::Ip(a.ip()),
            Err(_) => Source::Ip(std::net::Ipv4Addr::UNSPECIFIED.into()),
        }
    }
    fn hung_up(&self) -> bool {
        hung_up(self)
    }
    fn into_tcp(self) -> Option<std::net::TcpStream> {
        Some(self)
    }
    fn into_stream(self) -> io::Result<Box<dyn Stream>> {
        self.set_nonblocking(true)?;
        Ok(Box::new(Plain(self)))
    }
}

impl Socket for std::os::unix::net::UnixStream {
    fn try_clone(&self) -> io::Result<Self> {
        std::os::unix::net::UnixStream::try_clone(self)
    }
    fn shut(&self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }
    fn set_write_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        std::os::unix::net::UnixStream::set_write_timeout(self, t)
    }
    fn peer(&self) -> String {
        rustix::net::sockopt::socket_peercred(self)
            .map(|c| format!("uid {}", c.uid.as_raw()))
            .unwrap_or_default()
    }
    /// The socket's owner (the user `netram nbd` runs as) and root are trusted: they may open
    /// as many connections as the totals allow. Anyone else the socket's file mode lets in is
    /// a stranger, bounded like a remote client.
    fn source(&self) -> Source {
        match rustix::net::sockopt::socket_peercred(self) {
            Ok(c) => {
                let uid = c.uid.as_raw();
                Source::Local {
                    uid,
                    trusted: uid == 0 || uid == rustix::process::geteuid().as_raw(),
                }
            }
            Err(_) => Source::Local {
                uid: u32::MAX,
                trusted: false,
            },
        }
    }
    fn hung_up(&self) -> bool {
        hung_up(self)
    }
    fn into_stream(self) -> io::Result<Box<dyn Stream>> {
        self.set_nonblocking(true)?;
        Ok(Box::new(Plain(self)))
    }
}

/// Whether the peer of `fd` closed its end (poll without waiting).
pub(crate) fn hung_up(fd: &impl std::os::fd::AsFd) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(fd, PollFlags::RDHUP)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut fds, Some(&now)), Ok(n) if n > 0)
        && fds[0]
            .revents()
            .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR)
}

/// What a connection asks of the server's accept loop during its haggling.
pub trait Gate {
    /// Over TLS, once the client's certificate is verified: whether its node may use this
    /// device at all (else every option is answered NBD_REP_ERR_POLICY with the reason).
    fn admit_node(&self, node: u64) -> Result<(), String>;
    /// The haggling is over and the client (its node over TLS, else its address or user)
    /// wants the transmission phase: a place among the established connections, or why not.
    fn establish(&self, client: &str) -> Result<(), String>;
}

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("protocol: {0}")]
    Wire(#[from] WireError),
    #[error("{0}")]
    Closed(String),
}

/// How the option haggling ended.
enum Haggled {
    /// On to the transmission phase.
    Go(Session),
    /// The client aborted.
    Done,
    /// The client asked for TLS, and it was agreed: the haggling starts again inside it.
    StartTls,
}

/// What the handshake settled.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Session {
    structured: bool,
    base_allocation: bool,
}

fn known_export(name: &str) -> bool {
    name.is_empty() || name == EXPORT_NAME
}

struct Conn<S: Socket> {
    r: BufReader<S>,
    w: BufWriter<S>,
    out: Vec<u8>,
}

impl<S: Socket> Conn<S> {
    fn new(socket: S) -> io::Result<Self> {
        let w = socket.try_clone()?;
        Ok(Self {
            r: BufReader::with_capacity(256 * 1024, socket),
            w: BufWriter::with_capacity(256 * 1024, w),
            out: Vec::with_capacity(64 * 1024),
        })
    }

    fn send(&mut self) -> io::Result<()> {
        self.w.write_all(&self.out)?;
        self.out.clear();
        self.w.flush()
    }
}

/// A connection whose handshake is over, for the transmission loop (`crate::transmit`).
pub(crate) struct Negotiated {
    pub stream: Box<dyn Stream>,
    /// What the handshake's reader had taken in beyond the handshake (requests sent at once).
    pub buffered: Vec<u8>,
    pub session: Session,
}

impl<S: Socket> Conn<S> {
    /// The connection for the transmission loop, once its handshake is over.
    fn negotiated(self, session: Session) -> Result<Negotiated, ConnError> {
        let Conn { r, w, .. } = self;
        drop(w);
        let buffered = r.buffer().to_vec();
        let stream = r.into_inner().into_stream()?;
        Ok(Negotiated {
            stream,
            buffered,
            session,
        })
    }
}

/// Runs one connection's handshake; sets `negotiated` once it is over (the accept loop closes
/// connections that take too long to get there) and returns the connection for the
/// transmission loop, or `None` if the client left. With `tls`, the client must start TLS
/// before any other option (NBD_REP_ERR_TLS_REQD otherwise) and present a certificate that
/// `tls` accepts.
pub(crate) fn handshake<S, T, D>(
    socket: S,
    device: &Device<T, D>,
    negotiated: &AtomicBool,
    gate: &dyn Gate,
    tls: Option<Arc<rustls::ServerConfig>>,
    handshake_timeout: Duration,
) -> Result<Option<Negotiated>, ConnError>
where
    S: Socket,
    T: Transport,
    D: Disk,
{
    let mut c = Conn::new(socket)?;
    let client_flags = greet(&mut c)?;
    let must = if tls.is_some() {
        Refuse::TlsRequired
    } else {
        Refuse::Nothing
    };
    let session = match options(&mut c, device, client_flags, &must, gate)? {
        Haggled::Go(session) => session,
        Haggled::Done => return Ok(None),
        Haggled::StartTls => {
            let config = tls.expect("STARTTLS is agreed only with a TLS configuration");
            // Bytes the client sent after its STARTTLS, before the TLS handshake, would be
            // taken as if they came inside TLS (the STARTTLS injection attack): refuse them.
            if !c.r.buffer().is_empty() {
                return Err(ConnError::Closed(
                    "the client sent data after NBD_OPT_STARTTLS before the TLS handshake".into(),
                ));
            }
            let Conn { r, w, .. } = c;
            drop(w);
            let tcp = r
                .into_inner()
                .into_tcp()
                .ok_or_else(|| ConnError::Closed("TLS is offered only on TCP".into()))?;
            let socket = crate::tls::TlsSocket::accept(tcp, config, handshake_timeout)
                .map_err(|e| ConnError::Closed(format!("TLS handshake: {e}")))?;
            // A device belongs to its node: a certificate of the cluster is not enough.
            let must = match socket.node().map(|n| gate.admit_node(n)) {
                Some(Ok(())) => Refuse::Nothing,
                Some(Err(why)) => Refuse::Policy(why),
                None => Refuse::Policy("the client's certificate names no node".into()),
            };
            let mut c = Conn::new(socket)?;
            return match options(&mut c, device, client_flags, &must, gate)? {
                Haggled::Go(session) => {
                    negotiated.store(true, Ordering::SeqCst);
                    c.negotiated(session).map(Some)
                }
                Haggled::Done => Ok(None),
                Haggled::StartTls => unreachable!("STARTTLS is refused inside TLS"),
            };
        }
    };
    negotiated.store(true, Ordering::SeqCst);
    c.negotiated(session).map(Some)
}

fn export_info(device_size: u64) -> Vec<u8> {
    let mut d = INFO_EXPORT.to_be_bytes().to_vec();
    d.extend_from_slice(&device_size.to_be_bytes());
    d.extend_from_slice(&TRANSMISSION_FLAGS.to_be_bytes());
    d
}

fn refuse_option(out: &mut Vec<u8>, option: u32, kind: u32, why: &str) {
    option_reply(out, option, kind, why.as_bytes());
}

/// Sends the server's greeting and reads the client's flags.
fn greet<S: Socket>(c: &mut Conn<S>) -> Result<u32, ConnError> {
    c.out.extend_from_slice(&NBDMAGIC.to_be_bytes());
    c.out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    c.out
        .extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    c.send()?;
    let mut flags = [0u8; 4];
    c.r.read_exact(&mut flags)?;
    let client_flags = parse_client_flags(flags)?;
    if client_flags & CLIENT_FIXED_NEWSTYLE == 0 {
        return Err(ConnError::Closed(
            "client does not speak fixed newstyle".into(),
        ));
    }
    Ok(client_flags)
}

/// What every option but ABORT is answered with, if anything.
enum Refuse {
    Nothing,
    /// TLS is offered and not started yet, so only STARTTLS and ABORT are served (the NBD
    /// protocol's "TLS-only" server, which NBD clients that do not ask for TLS understand as a
    /// refusal).
    TlsRequired,
    /// This client may not use the device: NBD_REP_ERR_POLICY, with why.
    Policy(String),
}

/// Runs option haggling; `refuse` says what the client may not do. The client's entry into
/// the transmission phase (GO, EXPORT_NAME) takes its place among the established connections
/// (`gate`), or is refused.
fn options<S: Socket, T: Transport, D: Disk>(
    c: &mut Conn<S>,
    device: &Device<T, D>,
    client_flags: u32,
    refuse: &Refuse,
    gate: &dyn Gate,
) -> Result<Haggled, ConnError> {
    let mut session = Session::default();
    let client =
        c.r.get_ref()
            .node()
            .map_or_else(|| c.r.get_ref().peer(), |n| format!("node {n}"));
    loop {
        let mut h = [0u8; OPTION_HEADER_LEN];
        c.r.read_exact(&mut h)?;
        let (option, len) = parse_option_header(&h, MAX_OPTION_LEN)?;
        let mut data = vec![0u8; len as usize];
        c.r.read_exact(&mut data)?;
        if let Refuse::Policy(why) = refuse {
            match option {
                OPT_ABORT => {
                    option_reply(&mut c.out, option, REP_ACK, &[]);
                    let _ = c.send();
                    return Ok(Haggled::Done);
                }
                OPT_EXPORT_NAME => return Err(ConnError::Closed(why.clone())),
                _ => option_reply(&mut c.out, option, REP_ERR_POLICY, why.as_bytes()),
            }
            c.send()?;
            continue;
        }
        if matches!(refuse, Refuse::TlsRequired) {
            match option {
                OPT_STARTTLS if data.is_empty() => {
                    option_reply(&mut c.out, option, REP_ACK, &[]);
                    c.send()?;
                    return Ok(Haggled::StartTls);
                }
                OPT_STARTTLS => option_reply(
                    &mut c.out,
                    option,
                    REP_ERR_INVALID,
                    b"this option takes no data",
                ),
                OPT_ABORT => {
                    option_reply(&mut c.out, option, REP_ACK, &[]);
                    let _ = c.send();
                    return Ok(Haggled::Done);
                }
                // The protocol has no error reply for this option: closing is the answer.
                OPT_EXPORT_NAME => {
                    return Err(ConnError::Closed(
                        "NBD_OPT_EXPORT_NAME before TLS: this server requires TLS".into(),
                    ))
                }
                _ => option_reply(
                    &mut c.out,
                    option,
                    REP_ERR_TLS_REQD,
                    b"this server requires TLS (nbds://, with the cluster's certificates)",
                ),
            }
            c.send()?;
            continue;
        }
        match option {
            OPT_EXPORT_NAME => {
                let name = String::from_utf8_lossy(&data);
                if !known_export(&name) {
                    // The protocol has no error reply for this option: closing is the answer.
                    return Err(ConnError::Closed(format!("unknown export {name:?}")));
                }
                gate.establish(&client).map_err(ConnError::Closed)?;
                c.out.extend_from_slice(&device.size().to_be_bytes());
                c.out.extend_from_slice(&TRANSMISSION_FLAGS.to_be_bytes());
                if client_flags & CLIENT_NO_ZEROES == 0 {
                    c.out.extend_from_slice(&[0u8; 124]);
                }
                c.send()?;
                return Ok(Haggled::Go(session));
            }
            OPT_ABORT => {
                option_reply(&mut c.out, option, REP_ACK, &[]);
                let _ = c.send(); // the client may already be gone
                return Ok(Haggled::Done);
            }
            OPT_LIST if data.is_empty() => {
                let mut d = (EXPORT_NAME.len() as u32).to_be_bytes().to_vec();
                d.extend_from_slice(EXPORT_NAME.as_bytes());
                option_reply(&mut c.out, option, REP_SERVER, &d);
                option_reply(&mut c.out, option, REP_ACK, &[]);
            }
            OPT_INFO | OPT_GO => match parse_info_request(option, &data) {
                Ok(req) if known_export(&req.name) => {
                    option_reply(&mut c.out, option, REP_INFO, &export_info(device.size()));
                    if req.requests.contains(&INFO_BLOCK_SIZE) {
                        // Any alignment works (partial pages are read-modify-written); a page is
                        // what is cheap.
                        let mut d = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
                        d.extend_from_slice(&1u32.to_be_bytes());
                        d.extend_from_slice(&(netram_proto::PAGE_SIZE as u32).to_be_bytes());
                        d.extend_from_slice(&MAX_REQUEST.to_be_bytes());
                        option_reply(&mut c.out, option, REP_INFO, &d);
                    }
                    if req.requests.contains(&INFO_NAME) {
                        let mut d = INFO_NAME.to_be_bytes().to_vec();
                        d.extend_from_slice(EXPORT_NAME.as_bytes());
                        option_reply(&mut c.out, option, REP_INFO, &d);
                    }
                    if option == OPT_GO {
                        if let Err(why) = gate.establish(&client) {
                            // What was said of the export stands; the GO itself is refused
                            // and the client may try again later or abort.
                            c.out.clear();
                            option_reply(&mut c.out, option, REP_ERR_POLICY, why.as_bytes());
                            c.send()?;
                            continue;
                        }
                        option_reply(&mut c.out, option, REP_ACK, &[]);
                        c.send()?;
                        return Ok(Haggled::Go(session));
                    }
                    option_reply(&mut c.out, option, REP_ACK, &[]);
                }
                Ok(req) => refuse_unknown_export(&mut c.out, option, &req.name),
                Err(e) => refuse_option(&mut c.out, option, REP_ERR_INVALID, &e.to_string()),
            },
            OPT_STRUCTURED_REPLY if data.is_empty() => {
                session.structured = true;
                option_reply(&mut c.out, option, REP_ACK, &[]);
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                match parse_meta_context_request(option, &data) {
                    Ok(_) if option == OPT_SET_META_CONTEXT && !session.structured => {
                        option_reply(
                            &mut c.out,
                            option,
                            REP_ERR_INVALID,
                            b"meta contexts need structured replies",
                        );
                    }
                    Ok(req) if known_export(&req.name) => {
                        let listing = option == OPT_LIST_META_CONTEXT;
                        let wanted = req.queries.iter().any(|q| {
                            q == "base:allocation" || (listing && (q == "base:" || q.is_empty()))
                        }) || (listing && req.queries.is_empty());
                        if wanted {
                            let mut d = BASE_ALLOCATION_ID.to_be_bytes().to_vec();
                            d.extend_from_slice(b"base:allocation");
                            option_reply(&mut c.out, option, REP_META_CONTEXT, &d);
                            if !listing {
                                session.base_allocation = true;
                            }
                        }
                        option_reply(&mut c.out, option, REP_ACK, &[]);
                    }
                    Ok(req) => refuse_unknown_export(&mut c.out, option, &req.name),
                    Err(e) => refuse_option(&mut c.out, option, REP_ERR_INVALID, &e.to_string()),
                }
            }
            OPT_LIST | OPT_STRUCTURED_REPLY => {
                option_reply(
                    &mut c.out,
                    option,
                    REP_ERR_INVALID,
                    b"this option takes no data",
                );
            }
            // Inside TLS already, or on a server that does not offer it (a unix socket, or
            // `--insecure` on loopback).
            OPT_STARTTLS => option_reply(
                &mut c.out,
                option,
                REP_ERR_POLICY,
                b"TLS is not offered on this connection",
            ),
            _ => option_reply(&mut c.out, option, REP_ERR_UNSUP, b"unknown option"),
        }
        c.send()?;
    }
}

/// Which command flags each command accepts.
fn allowed_flags(kind: u16) -> u16 {
    match kind {
        CMD_READ => CMD_FLAG_DF,
        CMD_WRITE => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        CMD_TRIM => CMD_FLAG_FUA,
        CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
        _ => 0,
    }
}

/// Requests taken at once from what the client has already sent, and their bytes (write data
/// and read lengths) at most: what one batch holds in memory is bounded by this plus one
/// request, whatever the client pipelines; the rest waits in the socket.
pub(crate) const PIPELINE_MAX: usize = 64;
pub(crate) const PIPELINE_BYTES_MAX: usize = 16 << 20;
/// Bytes of consecutive writes staged together (a single larger write goes alone).
const WRITE_GROUP_BYTES_MAX: usize = 8 << 20;

/// The refusal of an option naming an export that does not exist.
fn refuse_unknown_export(out: &mut Vec<u8>, option: u32, name: &str) {
    refuse_option(out, option, REP_ERR_UNKNOWN, &format!("no export {name:?}"));
}

fn refuse(session: &Session, req: &Request, (errno, why): Refusal, out: &mut Vec<u8>) {
    tracing::debug!(
        kind = req.kind,
        offset = req.offset,
        len = req.len,
        "request refused: {why}"
    );
    if session.structured {
        error_chunk(out, req.cookie, errno, &why);
    } else {
        simple_reply(out, req.cookie, errno as u32);
    }
}

/// Runs a batch in order, appending every reply to `out`. Consecutive valid READs become one
/// pipelined read of all their pages, consecutive valid WRITEs one batched write.
pub(crate) async fn run_batch<W: Waits, T: Transport, D: Disk>(
    device: &Device<T, D>,
    session: &Session,
    batch: &[(Request, std::ops::Range<usize>)],
    payload: &[u8],
    data: &mut Vec<u8>,
    out: &mut Vec<u8>,
) {
    let is_read = |r: &Request| r.kind == CMD_READ && check(device, r).is_ok();
    let is_write = |r: &Request| r.kind == CMD_WRITE && check(device, r).is_ok();
    let done = |req: &Request, out: &mut Vec<u8>| {
        if session.structured {
            chunk_header(out, req.cookie, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0);
        } else {
            simple_reply(out, req.cookie, 0);
        }
    };
    let mut i = 0;
    while i < batch.len() {
        // Consecutive writes, up to a bound on their bytes, go to the pager as one batch.
        let mut bytes = 0usize;
        let writes = batch[i..]
            .iter()
            .take_while(|(r, d)| {
                bytes += d.len();
                is_write(r) && (bytes <= WRITE_GROUP_BYTES_MAX || d.len() == bytes)
            })
            .count();
        if writes > 0 {
            let group = &batch[i..i + writes];
            let ranges: Vec<(u64, &[u8])> = group
                .iter()
                .map(|(r, d)| (r.offset, &payload[d.clone()]))
                .collect();
            let fua = group.iter().any(|(r, _)| r.flags & CMD_FLAG_FUA != 0);
            match device.write_many_in::<W>(&ranges, fua).await {
                Ok(()) => group.iter().for_each(|(req, _)| done(req, out)),
                Err(e) => {
                    let refusal = device_error(e);
                    group
                        .iter()
                        .for_each(|(req, _)| refuse(session, req, refusal.clone(), out));
                }
            }
            i += writes;
            continue;
        }
        let reads = batch[i..].iter().take_while(|(r, _)| is_read(r)).count();
        if reads == 0 {
            let (req, _) = &batch[i];
            let result = match check(device, req) {
                Ok(()) => execute::<W, T, D>(device, session, req, out).await,
                Err(refusal) => Err(refusal),
            };
            if let Err(refusal) = result {
                refuse(session, req, refusal, out);
            }
            i += 1;
            continue;
        }
        let group = &batch[i..i + reads];
        let ranges: Vec<(u64, u32)> = group.iter().map(|(r, _)| (r.offset, r.len)).collect();
        match device.read_ranges_in::<W>(&ranges, data).await {
            Ok(()) => {
                let mut at = 0;
                for (req, _) in group {
                    let n = req.len as usize;
                    if session.structured {
                        chunk_header(
                            out,
                            req.cookie,
                            REPLY_FLAG_DONE,
                            REPLY_TYPE_OFFSET_DATA,
                            8 + req.len,
                        );
                        out.extend_from_slice(&req.offset.to_be_bytes());
                    } else {
                        simple_reply(out, req.cookie, 0);
                    }
                    out.extend_from_slice(&data[at..at + n]);
                    at += n;
                }
            }
            Err(e) => {
                let refusal = device_error(e);
                for (req, _) in group {
                    refuse(session, req, refusal.clone(), out);
                }
            }
        }
        i += reads;
    }
}

type Refusal = (Errno, String);

fn device_error(e: DeviceError) -> Refusal {
    tracing::warn!("I/O error: {e}");
    (Errno::Io, e.to_string())
}

/// Whether a request may run at all: a known command, flags it accepts, inside the device.
fn check<T: Transport, D: Disk>(device: &Device<T, D>, req: &Request) -> Result<(), Refusal> {
    let known = matches!(
        req.kind,
        CMD_READ
            | CMD_WRITE
            | CMD_FLUSH
            | CMD_TRIM
            | CMD_CACHE
            | CMD_WRITE_ZEROES
            | CMD_BLOCK_STATUS
    );
    if !known {
        return Err((Errno::Inval, format!("unknown command {}", req.kind)));
    }
    if req.flags & !allowed_flags(req.kind) != 0 {
        return Err((
            Errno::Inval,
            format!(
                "flags {:#x} are not valid for command {}",
                req.flags, req.kind
            ),
        ));
    }
    let end = req.offset.checked_add(u64::from(req.len));
    let in_range = end.is_some_and(|e| e <= device.size());
    if req.kind != CMD_FLUSH && !in_range {
        let errno = if matches!(req.kind, CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM) {
            Errno::NoSpc
        } else {
            Errno::Inval
        };
        return Err((
            errno,
            format!(
                "{} bytes at {} run past the end ({} bytes)",
                req.len,
                req.offset,
                device.size()
            ),
        ));
    }
    // The advertised maximum block size. TRIM and WRITE_ZEROES of any length are served, in
    // steps (`device::STEP_BYTES`); a CACHE beyond it would only churn the cache.
    if matches!(req.kind, CMD_READ | CMD_CACHE) && req.len > MAX_REQUEST {
        return Err((
            Errno::Inval,
            format!(
                "{} of {} bytes is larger than the {MAX_REQUEST}-byte limit",
                if req.kind == CMD_READ {
                    "read"
                } else {
                    "cache"
                },
                req.len
            ),
        ));
    }
    Ok(())
}

/// Runs one checked request and appends its successful reply to `out`; a refusal is the
/// caller's to send.
async fn execute<W: Waits, T: Transport, D: Disk>(
    device: &Device<T, D>,
    session: &Session,
    req: &Request,
    out: &mut Vec<u8>,
) -> Result<(), Refusal> {
    let (offset, len) = (req.offset, u64::from(req.len));
    let fua = req.flags & CMD_FLAG_FUA != 0;
    let done = |out: &mut Vec<u8>| {
        if session.structured {
            chunk_header(out, req.cookie, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0);
        } else {
            simple_reply(out, req.cookie, 0);
        }
    };
    match req.kind {
        CMD_READ => unreachable!("reads run in groups (run_batch)"),
        CMD_WRITE => unreachable!("writes run in groups (run_batch)"),
        CMD_WRITE_ZEROES => {
            device
                .write_zeroes_in::<W>(offset, len, fua)
                .await
                .map_err(device_error)?;
            done(out);
        }
        CMD_TRIM => {
            device
                .trim_in::<W>(offset, len)
                .await
                .map_err(device_error)?;
            if fua {
                device.flush_in::<W>().await.map_err(device_error)?;
            }
            done(out);
        }
        CMD_FLUSH => {
            device.flush_in::<W>().await.map_err(device_error)?;
            done(out);
        }
        CMD_CACHE => {
            device
                .cache_in::<W>(offset, len)
                .await
                .map_err(device_error)?;
            done(out);
        }
        CMD_BLOCK_STATUS => {
            if !session.structured || !session.base_allocation {
                return Err((
                    Errno::Inval,
                    "BLOCK_STATUS needs structured replies and base:allocation".into(),
                ));
            }
            if len == 0 {
                return Err((Errno::Inval, "BLOCK_STATUS of zero bytes".into()));
            }
            let max = if req.flags & CMD_FLAG_REQ_ONE != 0 {
                1
            } else {
                MAX_EXTENTS
            };
            let extents = device.block_status(offset, len, max);
            chunk_header(
                out,
                req.cookie,
                REPLY_FLAG_DONE,
                REPLY_TYPE_BLOCK_STATUS,
                4 + 8 * extents.len() as u32,
            );
            out.extend_from_slice(&BASE_ALLOCATION_ID.to_be_bytes());
            for (l, f) in extents {
                out.extend_from_slice(&l.to_be_bytes());
                out.extend_from_slice(&f.to_be_bytes());
            }
        }
        _ => unreachable!("checked above"),
    }
    Ok(())
}
