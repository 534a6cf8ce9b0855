//! The transmission phase of every NBD connection in one event loop (issue 38: one loop per
//! process; Anemone §2.2's pipelined request handling without a thread per client).
//!
//! A connection's handshake runs on a thread of its own (bounded by admission, `lib.rs`), as
//! it is short and rare; once the client enters the transmission phase its socket is handed to
//! this loop, which owns every established connection and watches the page servers'
//! connections of the shared pager beside them. Each connection has at most one *batch* in
//! flight: the requests it had already sent when the last batch ended, served in order exactly
//! as a connection's thread served them before (`server::run_batch`), now as a task whose
//! waits pend instead of blocking (`device::Looped`). So a read that misses on one connection
//! never holds another connection's cached read, and every connection's misses travel in the
//! same batches to the servers, with no thread woken per reply but this one. The loop also
//! runs the pager's maintenance schedule between batches (probes, recovery, migration:
//! `netram_pager::Ticker`, as a region's handler does), so that nothing else takes the pager.
//!
//! Why a hand-written loop with `async` tasks rather than tokio (issue 38 asks for the choice
//! by measurement): `netram bench core` measured tokio's hand-offs costing more than blocking
//! threads in the low-latency mode, and the tasks here need nothing of a runtime but a waker:
//! the operations are the device's own `async fn`s, which rustc turns into the resumable state
//! machines the design calls for, and the loop's `poll(2)` covers sockets, the page servers'
//! connections and the wake-ups of tasks that another thread (the maintenance tick) finished.
//! Measured against a thread per connection (b5e37ff), `netram bench nbd --quick --fio-only`,
//! two alternating pairs on the 2-vCPU development VM, 2026-11-30 (IOPS, loop / threads):
//! random reads at depth 1 18.5k, 21.2k / 16.7k, 18.4k; at depth 32 102k, 104k / 106k, 103k;
//! random writes at depth 1 32k, 40k / 33k, 43k; at depth 32 109k, 122k / 108k, 113k; fio's
//! verified mixed-size writes 29.5k, 27.5k / 26.5k, 23.8k; four connections at depth 8, reads
//! 87k, 87k / 87k, 84k, writes 91k, 118k / 126k, 100k. The same within this VM's noise, the
//! verified writes 1.13x. The first version was 20 % slower at depth 1: it zeroed its 256 KiB
//! read buffer at every read and read each socket until `EAGAIN` (`strace` counted the calls).
//!
//! Everything a client sends is hostile: a request is parsed only once it is whole, a bad one
//! ends the connection after the requests before it are answered, a write larger than
//! [`MAX_REQUEST`] closes it, what one connection buffers is bounded, and a client that does
//! not read its replies is closed after the write timeout. None of it touches another
//! connection.

use crate::device::{Device, Looped, MAX_REQUEST};
use crate::server::{run_batch, Session, PIPELINE_BYTES_MAX, PIPELINE_MAX};
use crate::wire::{parse_request, Request, CMD_DISC, CMD_READ, CMD_WRITE, REQUEST_LEN};
use netram_pager::{Disk, Ticker, Transport, Upkeep};
use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags, Timespec};
use std::cell::Cell;
use std::future::Future;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

/// Bytes read ahead from a connection while its batch runs (more waits in the socket). A
/// request larger than this is still read whole before it is served.
const READ_AHEAD: usize = 256 * 1024;
/// How long the loop sleeps with tasks waiting and nothing readable before it looks at the
/// page servers' connections anyway: a reply may sit in a connection's buffer, read off the
/// socket by the maintenance thread with another (as `netram_client::shared`'s nap).
const NAP: Duration = Duration::from_millis(5);
/// How long it sleeps with nothing at all to do (the shutdown flag is looked at this often).
const IDLE: Duration = Duration::from_millis(100);
/// Replies waiting for the socket beyond which a connection's next batch does not start: a
/// client that does not read its replies makes the loop hold one batch's, not more (as a
/// connection's thread blocked in its write did).
const OUT_AHEAD: usize = 1 << 20;
/// The starting size of a batch's buffers (as a connection's thread had).
const BATCH_BUFFER: usize = 64 * 1024;

/// A connection's byte stream once its handshake is over, read and written without blocking
/// (`io::ErrorKind::WouldBlock` when nothing can be).
pub trait Stream: Send {
    fn fd(&self) -> BorrowedFd<'_>;
    /// `Ok(0)`: the client closed its side.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    fn write(&mut self, buf: &[u8]) -> io::Result<usize>;
    /// Sends what the stream holds back itself (TLS records): whether nothing is left.
    fn flush_out(&mut self) -> io::Result<bool> {
        Ok(true)
    }
    /// Whether the stream holds bytes of its own to send.
    fn wants_write(&self) -> bool {
        false
    }
}

/// A TCP or unix socket in non-blocking mode.
#[derive(Debug)]
pub struct Plain<S>(pub S);

impl<S: Read + Write + AsFd + Send> Stream for Plain<S> {
    fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
}

/// A TLS session over a non-blocking TCP socket (after NBD_OPT_STARTTLS).
#[derive(Debug)]
pub struct Tls {
    pub conn: rustls::ServerConnection,
    pub tcp: std::net::TcpStream,
}

impl Stream for Tls {
    fn fd(&self) -> BorrowedFd<'_> {
        self.tcp.as_fd()
    }
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.conn.reader().read(buf) {
                // Ok(0) is the client's close_notify: its end of the stream.
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            // No plaintext: records from the socket (WouldBlock when none came).
            if self.conn.read_tls(&mut self.tcp)? == 0 {
                return Ok(0);
            }
            self.conn
                .process_new_packets()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        }
    }
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // Records are made as rustls's buffer takes them, and sent as the socket does.
        let n = self.conn.writer().write(buf)?;
        self.flush_out()?;
        if n == 0 && !buf.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    }
    fn flush_out(&mut self) -> io::Result<bool> {
        while self.conn.wants_write() {
            match self.conn.write_tls(&mut self.tcp) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }
    fn wants_write(&self) -> bool {
        self.conn.wants_write()
    }
}

/// A connection at the end of its handshake, for the loop.
pub(crate) struct Established {
    pub stream: Box<dyn Stream>,
    /// Bytes the handshake's reader had taken in already (requests sent right behind GO).
    pub buffered: Vec<u8>,
    pub session: Session,
    pub peer: String,
    /// Held as long as the connection lives (its place among the established connections).
    pub held: Box<dyn Send>,
}

thread_local! {
    /// Set on the loop's thread: a wake-up there needs no eventfd write (the loop looks at its
    /// ready tasks before it sleeps again).
    static IN_LOOP: Cell<bool> = const { Cell::new(false) };
}

/// Tasks woken, and the loop's eventfd, which another thread writes to wake it (a task
/// finished by the maintenance tick, a connection handed over).
struct Ready {
    ids: Mutex<Vec<usize>>,
    fd: OwnedFd,
    poked: AtomicBool,
}

impl Ready {
    fn push(&self, id: usize) {
        self.ids.lock().unwrap_or_else(|p| p.into_inner()).push(id);
        if !IN_LOOP.with(Cell::get) {
            self.poke();
        }
    }

    fn poke(&self) {
        if !self.poked.swap(true, Ordering::AcqRel) {
            // A failed write (the counter full) leaves it to the loop's next look (NAP).
            let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
        }
    }

    /// Takes the eventfd's wake-up and the tasks woken. The flag goes down before the list
    /// is taken, so that a task woken meanwhile either is in the list or writes the eventfd
    /// again.
    fn take(&self, into: &mut Vec<usize>) {
        let mut count = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut count);
        self.poked.store(false, Ordering::Release);
        self.take_ids(into);
    }

    /// Takes the tasks woken (by the loop's own thread: no eventfd to read).
    fn take_ids(&self, into: &mut Vec<usize>) {
        into.append(&mut self.ids.lock().unwrap_or_else(|p| p.into_inner()));
    }
}

/// The waker of task `id`.
struct TaskWake {
    id: usize,
    ready: Arc<Ready>,
}

impl Wake for TaskWake {
    fn wake(self: Arc<Self>) {
        self.ready.push(self.id);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.ready.push(self.id);
    }
}

/// Where connection threads hand established connections to the loop.
pub(crate) struct Handoff {
    tx: Mutex<mpsc::Sender<Established>>,
    ready: Arc<Ready>,
}

impl Handoff {
    /// Gives `conn` to the loop; back if the loop has ended (the server is stopping).
    pub(crate) fn hand(&self, conn: Established) -> Result<(), Box<Established>> {
        let sent = self.tx.lock().unwrap_or_else(|p| p.into_inner()).send(conn);
        match sent {
            Ok(()) => {
                self.ready.poke();
                Ok(())
            }
            Err(mpsc::SendError(c)) => Err(Box::new(c)),
        }
    }
}

/// Starts the loop on a thread of its own; it ends when `shutdown` is set (every connection
/// closed).
pub(crate) fn spawn<T, D>(
    device: Arc<Device<T, D>>,
    shutdown: Arc<AtomicBool>,
    write_timeout: Duration,
    upkeep: Option<Upkeep>,
) -> io::Result<(Arc<Handoff>, std::thread::JoinHandle<()>)>
where
    T: Transport + Send + 'static,
    D: Disk + Send + 'static,
{
    let fd = eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?;
    let ready = Arc::new(Ready {
        ids: Mutex::default(),
        fd,
        poked: AtomicBool::new(false),
    });
    let (tx, rx) = mpsc::channel();
    let handoff = Arc::new(Handoff {
        tx: Mutex::new(tx),
        ready: ready.clone(),
    });
    let thread = std::thread::Builder::new()
        .name("netram-nbd-loop".into())
        .spawn(move || {
            IN_LOOP.with(|f| f.set(true));
            Loop::new(&device, ready, write_timeout, upkeep).run(&rx, &shutdown);
        })?;
    Ok((handoff, thread))
}

/// A batch of one connection's requests and the buffers it is served with (kept from one
/// batch to the next, so that a connection in its steady state allocates nothing).
#[derive(Default)]
struct Batch {
    reqs: Vec<(Request, std::ops::Range<usize>)>,
    payload: Vec<u8>,
    data: Vec<u8>,
    out: Vec<u8>,
}

impl Batch {
    fn clear(&mut self) {
        self.reqs.clear();
        self.payload.clear();
        self.out.clear();
        // A batch of large requests grew the buffers: the memory goes back rather than stay
        // with the connection for its life.
        for buf in [&mut self.payload, &mut self.data, &mut self.out] {
            if buf.capacity() > 32 * BATCH_BUFFER {
                buf.clear();
                buf.shrink_to(BATCH_BUFFER);
            }
        }
    }
}

/// Why a connection stops taking requests.
enum End {
    /// NBD_CMD_DISC: the requests before it are answered, nothing after it.
    Disc,
    /// A request that cannot be served or resynchronised: those before it are answered.
    Bad(String),
    /// The client closed its side, or its socket failed.
    Gone(String),
}

struct Conn {
    stream: Box<dyn Stream>,
    peer: String,
    session: Session,
    /// What the client sent and no batch took yet: `inbuf[in_at..in_end]`. The buffer keeps
    /// its length (zeroed once), so that reading into it costs no clearing.
    inbuf: Vec<u8>,
    in_at: usize,
    in_end: usize,
    out: Vec<u8>,
    /// Bytes of `out` written.
    sent: usize,
    /// The batch's buffers while no batch is in flight.
    spare: Option<Batch>,
    end: Option<End>,
    /// Since when replies have waited for the socket to take them.
    stuck_since: Option<Instant>,
    _held: Box<dyn Send>,
}

impl Conn {
    fn busy(&self) -> bool {
        self.spare.is_none()
    }

    /// The bytes received and not taken yet.
    fn pending(&self) -> &[u8] {
        &self.inbuf[self.in_at..self.in_end]
    }

    /// Bytes wanted pending: enough to read ahead, and the whole of the next request.
    fn want(&self) -> usize {
        let mut need = REQUEST_LEN;
        if self.pending().len() >= REQUEST_LEN {
            if let Ok(r) = parse_request(header(self.pending())) {
                if r.kind == CMD_WRITE && r.len <= MAX_REQUEST {
                    need += r.len as usize;
                }
            }
        }
        need.max(READ_AHEAD)
    }

    fn wants_read(&self) -> bool {
        self.end.is_none() && self.pending().len() < self.want()
    }

    fn wants_write(&self) -> bool {
        self.sent < self.out.len() || self.stream.wants_write()
    }

    /// Reads what the client has sent, up to [`Conn::want`].
    fn read_in(&mut self) {
        while self.wants_read() {
            let need = self.want();
            if self.in_at > 0 && self.in_at + need > self.inbuf.len() {
                self.inbuf.copy_within(self.in_at..self.in_end, 0);
                self.in_end -= self.in_at;
                self.in_at = 0;
            }
            if need > self.inbuf.len() {
                // A request larger than the buffer (a large WRITE): grown for it once.
                self.inbuf.resize(need, 0);
            }
            let stop = (self.in_at + need).min(self.inbuf.len());
            let room = stop - self.in_end;
            match self.stream.read(&mut self.inbuf[self.in_end..stop]) {
                Ok(0) => self.end = Some(End::Gone("the client closed the connection".into())),
                Ok(n) => {
                    self.in_end += n;
                    if n < room {
                        // All there was (a read more would only say so): `poll` tells when
                        // more comes.
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => self.end = Some(End::Gone(e.to_string())),
            }
        }
    }

    /// Moves the whole requests in `inbuf` into `b`, within the batch's bounds, as a
    /// connection's thread took every request already sent: `false` if there was none.
    fn take_batch(&mut self, b: &mut Batch) -> bool {
        let mut at = self.in_at;
        let mut reads = 0usize;
        while b.reqs.len() < PIPELINE_MAX
            && (b.reqs.is_empty() || b.payload.len() + reads < PIPELINE_BYTES_MAX)
            && self.in_end - at >= REQUEST_LEN
            && !matches!(self.end, Some(End::Disc | End::Bad(_)))
        {
            let req = match parse_request(header(&self.inbuf[at..])) {
                Ok(r) => r,
                Err(e) => {
                    self.end = Some(End::Bad(e.to_string()));
                    break;
                }
            };
            let mut len = 0;
            if req.kind == CMD_WRITE {
                if req.len > MAX_REQUEST {
                    self.end = Some(End::Bad(format!(
                        "write of {} bytes is larger than the {MAX_REQUEST}-byte limit",
                        req.len
                    )));
                    break;
                }
                len = req.len as usize;
                if self.in_end - at - REQUEST_LEN < len {
                    break;
                }
            }
            let body = at + REQUEST_LEN..at + REQUEST_LEN + len;
            at = body.end;
            if req.kind == CMD_DISC {
                self.end = Some(End::Disc);
                break;
            }
            if req.kind == CMD_READ {
                reads += req.len as usize;
            }
            let start = b.payload.len();
            b.payload.extend_from_slice(&self.inbuf[body]);
            b.reqs.push((req, start..b.payload.len()));
        }
        self.in_at = at;
        if self.in_at == self.in_end {
            self.in_at = 0;
            self.in_end = 0;
            if self.inbuf.len() > 4 * READ_AHEAD {
                // Grown for a large WRITE: the memory goes back.
                self.inbuf.truncate(READ_AHEAD);
                self.inbuf.shrink_to_fit();
            }
        }
        !b.reqs.is_empty()
    }

    /// Writes what the socket takes of the replies.
    fn write_out(&mut self, now: Instant) {
        let before = self.sent;
        while self.sent < self.out.len() {
            match self.stream.write(&self.out[self.sent..]) {
                Ok(0) => {
                    self.end = Some(End::Gone("the connection takes no more bytes".into()));
                    break;
                }
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.end = Some(End::Gone(e.to_string()));
                    // Nothing more will go out: what is left is dropped with the connection.
                    self.sent = self.out.len();
                    break;
                }
            }
        }
        if self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
        }
        let flushed = match self.stream.flush_out() {
            Ok(all) => all,
            Err(e) => {
                self.end = Some(End::Gone(e.to_string()));
                self.out.clear();
                self.sent = 0;
                true
            }
        };
        if self.out.is_empty() && flushed {
            self.stuck_since = None;
        } else if self.sent != before || self.stuck_since.is_none() {
            self.stuck_since = Some(now);
        }
    }

    /// Whether the connection is over: no more requests to take, none in flight, nothing
    /// left to send.
    fn over(&self) -> bool {
        let no_more = match &self.end {
            None => false,
            // Whole requests already in the buffer are still answered.
            Some(End::Gone(_)) => self.pending().len() < REQUEST_LEN,
            Some(End::Disc | End::Bad(_)) => true,
        };
        no_more && !self.busy() && !self.wants_write()
    }
}

/// The request header at the start of `b` (which holds one).
fn header(b: &[u8]) -> &[u8; REQUEST_LEN] {
    b[..REQUEST_LEN].try_into().expect("a whole header")
}

type TaskFuture<'d> = Pin<Box<dyn Future<Output = Batch> + 'd>>;

struct Task<'d> {
    conn: u64,
    fut: TaskFuture<'d>,
    waker: Waker,
}

struct Loop<'d, T: Transport, D: Disk> {
    device: &'d Device<T, D>,
    ready: Arc<Ready>,
    write_timeout: Duration,
    conns: std::collections::BTreeMap<u64, Conn>,
    next_conn: u64,
    tasks: Vec<Option<Task<'d>>>,
    free: Vec<usize>,
    /// Task slots' wakers, made once per slot (a slot is reused by the next batch).
    wakers: Vec<Waker>,
    /// Tasks to poll.
    run: Vec<usize>,
    /// The tasks being polled by `step` (kept for its capacity, as are the next two).
    polling: Vec<usize>,
    /// Which of the last poll's descriptors had events.
    revents: Vec<bool>,
    /// The pager's maintenance schedule, run by this loop between batches (`None`: another
    /// thread runs it).
    upkeep: Option<Upkeep>,
    ticker: Ticker,
}

impl<'d, T: Transport, D: Disk> Loop<'d, T, D> {
    fn new(
        device: &'d Device<T, D>,
        ready: Arc<Ready>,
        write_timeout: Duration,
        upkeep: Option<Upkeep>,
    ) -> Self {
        Self {
            upkeep,
            ticker: Ticker::new(),
            device,
            ready,
            write_timeout,
            conns: Default::default(),
            next_conn: 0,
            tasks: Vec::new(),
            free: Vec::new(),
            wakers: Vec::new(),
            run: Vec::new(),
            polling: Vec::new(),
            revents: Vec::new(),
        }
    }

    fn in_flight(&self) -> usize {
        self.tasks.len() - self.free.len()
    }

    fn run(mut self, rx: &mpsc::Receiver<Established>, shutdown: &AtomicBool) {
        let mut pager_fds: Vec<(usize, RawFd)> = Vec::new();
        let mut readable: Vec<usize> = Vec::new();
        let mut conn_ids: Vec<u64> = Vec::new();
        let mut woken = true;
        let mut answered = false;
        // While a batch is in flight a maintenance thread (when the schedule is not this
        // loop's) leaves the page servers' connections to this loop (`maintain::spawn_beside`).
        let mut busy = None;
        while !shutdown.load(Ordering::SeqCst) {
            if std::mem::take(&mut woken) {
                // Another thread wrote the eventfd: tasks it woke, connections handed over.
                self.ready.take(&mut self.run);
                while let Ok(e) = rx.try_recv() {
                    self.add(e);
                }
            }
            if let Some(upkeep) = &self.upkeep {
                if self
                    .ticker
                    .due(Instant::now(), std::mem::take(&mut answered))
                {
                    // The replies the tick takes in finish reads of batches too: their tasks
                    // are woken (without the eventfd: this is the loop's thread) and polled
                    // by the step below.
                    let ticker = &mut self.ticker;
                    self.device.with_pager(|p| ticker.tick(p, upkeep));
                }
            }
            self.step();
            if self.in_flight() > 0 {
                busy.get_or_insert_with(|| self.device.shared().hold_busy());
            } else {
                busy = None;
            }
            // What to watch: the eventfd, every connection that can take requests or has
            // replies to send, the page servers' connections with requests in flight.
            // The page servers' connections only while a batch waits: otherwise their replies
            // (write-backs' acknowledgements) are the maintenance thread's to take, and two
            // threads woken for each would race for it.
            pager_fds.clear();
            let now = Instant::now();
            let listening = self.upkeep.is_some() && self.ticker.listens(now);
            if self.in_flight() > 0 || listening {
                self.device.shared().reply_fds(&mut pager_fds);
            }
            conn_ids.clear();
            let mut fds = Vec::with_capacity(1 + self.conns.len() + pager_fds.len());
            fds.push(PollFd::new(&self.ready.fd, PollFlags::IN));
            for (&id, c) in &self.conns {
                let mut flags = PollFlags::empty();
                if c.wants_read() {
                    flags |= PollFlags::IN;
                }
                if c.wants_write() {
                    flags |= PollFlags::OUT;
                }
                if !flags.is_empty() {
                    conn_ids.push(id);
                    fds.push(PollFd::from_borrowed_fd(c.stream.fd(), flags));
                }
            }
            for &(_, fd) in &pager_fds {
                // SAFETY: a connection of the pager's transport, only looked at by poll. One
                // closed or reused meanwhile (a reconnection by the maintenance thread) is at
                // worst a spurious wake-up: replies are read through the pager, under its lock.
                let fd = unsafe { BorrowedFd::borrow_raw(fd) };
                fds.push(PollFd::from_borrowed_fd(fd, PollFlags::IN));
            }
            let mut wait = if !self.run.is_empty() {
                Duration::ZERO
            } else if self.in_flight() > 0 {
                NAP
            } else {
                IDLE
            };
            if self.upkeep.is_some() {
                wait = wait.min(self.ticker.until(now));
            }
            let timeout = Timespec {
                tv_sec: wait.as_secs() as i64,
                tv_nsec: wait.subsec_nanos() as i64,
            };
            let n = match poll(&mut fds, Some(&timeout)) {
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    tracing::error!("NBD transmission loop: poll: {e}");
                    std::thread::sleep(NAP);
                    continue;
                }
            };
            let mut revents = std::mem::take(&mut self.revents);
            revents.clear();
            revents.extend(fds.iter().map(|f| !f.revents().is_empty()));
            drop(fds);
            woken = revents[0];
            readable.clear();
            let pager_at = 1 + conn_ids.len();
            readable.extend(
                pager_fds
                    .iter()
                    .zip(&revents[pager_at..])
                    .filter(|(_, &r)| r)
                    .map(|(&(s, _), _)| s),
            );
            if n == 0 && self.in_flight() > 0 {
                // Nothing for a while: a reply may wait in a connection's buffer.
                readable.extend(pager_fds.iter().map(|&(s, _)| s));
            }
            if !readable.is_empty() {
                // Wakes the tasks whose replies came (the next step polls them); moves' and
                // recovery's answers make a tick due from its earliest time on.
                answered = listening;
                self.device.shared().take_in_from(readable.drain(..));
            }
            for (&id, _) in conn_ids
                .iter()
                .zip(&revents[1..pager_at])
                .filter(|(_, &r)| r)
            {
                if let Some(c) = self.conns.get_mut(&id) {
                    c.read_in();
                }
            }
            self.revents = revents;
        }
        let n = self.conns.len();
        if n > 0 {
            tracing::info!("closing {n} NBD connection(s): the server is stopping");
        }
    }

    /// Gives every connection with whole requests waiting and no batch in flight its next
    /// batch, as a task to poll.
    fn start_batches(&mut self) {
        for (&id, c) in self.conns.iter_mut() {
            if c.out.len() - c.sent > OUT_AHEAD {
                continue;
            }
            let Some(mut b) = c.spare.take() else {
                continue;
            };
            if !c.take_batch(&mut b) {
                c.spare = Some(b);
                continue;
            }
            let device = self.device;
            let session = c.session;
            let fut: TaskFuture<'d> = Box::pin(async move {
                let Batch {
                    reqs,
                    payload,
                    data,
                    out,
                } = &mut b;
                run_batch::<Looped, T, D>(device, &session, reqs, payload, data, out).await;
                b
            });
            let slot = self.free.pop().unwrap_or_else(|| {
                self.tasks.push(None);
                self.wakers.push(Waker::from(Arc::new(TaskWake {
                    id: self.tasks.len() - 1,
                    ready: self.ready.clone(),
                })));
                self.tasks.len() - 1
            });
            let waker = self.wakers[slot].clone();
            self.tasks[slot] = Some(Task {
                conn: id,
                fut,
                waker,
            });
            self.run.push(slot);
        }
    }

    /// Polls task `slot`; a batch that is done has its replies queued on its connection.
    fn poll_task(&mut self, slot: usize) {
        let Some(task) = self.tasks.get_mut(slot).and_then(Option::as_mut) else {
            // Woken after it finished (a stale wake-up): nothing to do.
            return;
        };
        let waker = task.waker.clone();
        let Poll::Ready(mut b) = task.fut.as_mut().poll(&mut Context::from_waker(&waker)) else {
            return;
        };
        let conn = task.conn;
        self.tasks[slot] = None;
        self.free.push(slot);
        if let Some(c) = self.conns.get_mut(&conn) {
            if c.out.is_empty() {
                // Nothing waits to be sent: the batch's replies become the connection's
                // without a copy (a batch of reads' is their data: 1.5 % of the loop's time
                // copied here in `perf` of fio's verified mixed writes).
                std::mem::swap(&mut c.out, &mut b.out);
            } else {
                c.out.extend_from_slice(&b.out);
            }
            b.clear();
            c.spare = Some(b);
        }
    }

    fn add(&mut self, e: Established) {
        let id = self.next_conn;
        self.next_conn += 1;
        let mut c = Conn {
            stream: e.stream,
            peer: e.peer,
            session: e.session,
            in_at: 0,
            in_end: e.buffered.len(),
            inbuf: {
                let mut b = e.buffered;
                b.resize(b.len().max(READ_AHEAD), 0);
                b
            },
            out: Vec::with_capacity(BATCH_BUFFER),
            sent: 0,
            spare: Some(Batch::default()),
            end: None,
            stuck_since: None,
            _held: e.held,
        };
        c.read_in();
        self.conns.insert(id, c);
    }

    /// Starts the batches that can start, polls the tasks woken, writes replies, and closes
    /// the connections that are over, until no task is left to poll.
    fn step(&mut self) {
        let now = Instant::now();
        let mut run = std::mem::take(&mut self.polling);
        loop {
            // Replies out first: a connection whose replies have gone may start its next batch.
            for c in self.conns.values_mut() {
                if c.wants_write() {
                    c.write_out(now);
                }
            }
            self.start_batches();
            // Wake-ups by tasks polled here (one finishing another's read) come without the
            // eventfd, as this is the loop's thread.
            self.ready.take_ids(&mut self.run);
            if self.run.is_empty() {
                break;
            }
            std::mem::swap(&mut run, &mut self.run);
            run.sort_unstable();
            run.dedup();
            for slot in run.drain(..) {
                self.poll_task(slot);
            }
        }
        self.polling = run;
        let timeout = self.write_timeout;
        self.conns.retain(|_, c| {
            if c.wants_write() {
                c.write_out(now);
            }
            if let Some(since) = c.stuck_since {
                if now.duration_since(since) > timeout {
                    tracing::warn!(peer = %c.peer, "closing an NBD connection: its replies were not read for {timeout:?}");
                    return false;
                }
            }
            if !c.over() {
                return true;
            }
            match c.end.take() {
                Some(End::Bad(why)) => tracing::info!(peer = %c.peer, "NBD connection ended: {why}"),
                Some(End::Gone(why)) => tracing::debug!(peer = %c.peer, "NBD connection ended: {why}"),
                _ => tracing::debug!(peer = %c.peer, "NBD client disconnected"),
            }
            false
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{CMD_FLUSH, CMD_TRIM, REQUEST_MAGIC};
    use proptest::prelude::*;
    use std::collections::VecDeque;

    /// A client's bytes, arriving in the given pieces: a read after a whole piece finds
    /// nothing new (`WouldBlock`), the one after it the next piece.
    struct Pieces {
        pieces: VecDeque<Vec<u8>>,
        ready: bool,
    }

    impl Stream for Pieces {
        fn fd(&self) -> BorrowedFd<'_> {
            unreachable!("not polled")
        }
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if !self.ready {
                self.ready = true;
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let Some(p) = self.pieces.front_mut() else {
                return Ok(0);
            };
            let n = p.len().min(buf.len());
            buf[..n].copy_from_slice(&p[..n]);
            p.drain(..n);
            if p.is_empty() {
                self.pieces.pop_front();
                self.ready = false;
            }
            Ok(n)
        }
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            Ok(buf.len())
        }
    }

    fn encode(kind: u16, cookie: u64, len: u32, out: &mut Vec<u8>) {
        out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        out.extend_from_slice(&0u16.to_be_bytes());
        out.extend_from_slice(&kind.to_be_bytes());
        out.extend_from_slice(&cookie.to_be_bytes());
        out.extend_from_slice(&(cookie * 4096).to_be_bytes());
        out.extend_from_slice(&len.to_be_bytes());
    }

    fn conn(pieces: Vec<Vec<u8>>) -> Conn {
        Conn {
            stream: Box::new(Pieces {
                pieces: pieces.into(),
                ready: true,
            }),
            peer: "test".into(),
            session: Session::default(),
            inbuf: vec![0; READ_AHEAD],
            in_at: 0,
            in_end: 0,
            out: Vec::new(),
            sent: 0,
            spare: Some(Batch::default()),
            end: None,
            stuck_since: None,
            _held: Box::new(()),
        }
    }

    proptest! {
        /// Requests split anywhere on the way (and followed, maybe, by garbage) are taken
        /// whole, in order, with their write data, and nothing after a bad one or a DISC; the
        /// buffer stays within a read-ahead and one request however the bytes come.
        #[test]
        fn requests_split_anywhere_are_taken_whole_and_in_order(
            reqs in prop::collection::vec((0u16..5, 0u32..20_000), 0..40),
            garbage in prop::collection::vec(any::<u8>(), 0..64),
            cuts in prop::collection::vec(1usize..9000, 1..40),
        ) {
            let mut bytes = Vec::new();
            let mut want = Vec::new();
            for (i, &(kind, len)) in reqs.iter().enumerate() {
                let kind = [CMD_READ, CMD_WRITE, CMD_FLUSH, CMD_TRIM, CMD_DISC][kind as usize];
                encode(kind, i as u64, len, &mut bytes);
                if kind == CMD_WRITE {
                    bytes.extend((0..len).map(|k| (k as u8) ^ (i as u8)));
                }
                if want.last().is_none_or(|&(k, _, _)| k != CMD_DISC) {
                    want.push((kind, i as u64, len));
                }
            }
            bytes.extend_from_slice(&garbage);
            let mut pieces = Vec::new();
            let mut at = 0;
            for c in cuts.iter().cycle() {
                if at >= bytes.len() {
                    break;
                }
                let end = (at + c).min(bytes.len());
                pieces.push(bytes[at..end].to_vec());
                at = end;
            }
            // A piece takes up to two rounds (the stream says WouldBlock once after each), so
            // the rounds are bounded by the pieces, not by a constant: 1-byte cuts of two
            // large writes are 20,000 pieces.
            let rounds = 2 * pieces.len() + 2;
            let mut c = conn(pieces);
            let mut got = Vec::new();
            for _ in 0..rounds {
                c.read_in();
                prop_assert!(c.inbuf.len() <= READ_AHEAD.max(REQUEST_LEN + 20_000));
                let mut b = c.spare.take().expect("no batch in flight here");
                c.take_batch(&mut b);
                for (r, range) in &b.reqs {
                    if r.kind == CMD_WRITE {
                        let body = &b.payload[range.clone()];
                        let i = r.cookie as u8;
                        prop_assert!(body.iter().enumerate().all(|(k, &v)| v == (k as u8) ^ i));
                    }
                    got.push((r.kind, r.cookie, r.len));
                }
                b.clear();
                c.spare = Some(b);
                if c.end.is_some() && c.pending().len() < REQUEST_LEN {
                    break;
                }
                if matches!(c.end, Some(End::Disc | End::Bad(_))) {
                    break;
                }
            }
            let served: Vec<_> = want.iter().filter(|(k, _, _)| *k != CMD_DISC).cloned().collect();
            prop_assert_eq!(&got, &served);
            if want.last().is_some_and(|&(k, _, _)| k == CMD_DISC) {
                prop_assert!(matches!(c.end, Some(End::Disc)));
            }
        }
    }
}
