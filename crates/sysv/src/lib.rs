//! System V shared memory and semaphores across machines (MIRAGE+, paper 002, which was
//! "upward compatible with the SVID"; issue 40): a preload library (`libnetram_sysv.so`,
//! `netram shm run -- PROGRAM`) that puts an unmodified program's `shmget`, `shmat`, `shmdt`,
//! `shmctl`, `semget`, `semop`, `semtimedop` and `semctl` on netram segments, so that
//! processes on different machines that use the same key share the same memory, coherently.
//!
//! - **Shared memory**: key K is segment `sysv:K` (IPC_PRIVATE a name of its own); the shmid
//!   is a hash of the name, the same on every machine. A segment lives in the daemons until
//!   its name is removed (IPC_RMID) — as a System V segment lives in the kernel.
//! - **Semaphores**: a set is a one-page segment `sysv-sem:K` holding the values, and `semop`
//!   applies its operations all at once under a lock word in that page (an atomic
//!   compare-and-swap, which the coherence protocol makes exclusive across machines); an
//!   operation that cannot proceed releases the lock and waits, polling with a growing pause
//!   (there is no futex across machines).
//! - **fork**: a child does not inherit its parent's userfaultfd registration, so a
//!   `pthread_atfork` handler registers the child's inherited attachments again before the
//!   child goes on (`netram_shm::local::follow_forks`).
//!
//! Not done (said in docs/limits.md): `SEM_UNDO` is accepted and not undone at exit,
//! `IPC_SET` is refused, group permission bits are not
//! checked (gids differ between machines), `shm_nattch` counts this process's attachments
//! only, and a segment whose name was removed can no longer be attached by a new process.

use netram_shm::local::Info;
use netram_shm::{Segment, SegmentError};
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

const PAGE: usize = netram_proto::PAGE_SIZE;
/// `<linux/shm.h>`'s, which the libc crate lacks.
const SHM_STAT: c_int = 13;
const SHM_STAT_ANY: c_int = 15;

struct ShmEntry {
    name: String,
    key: i32,
    info: Info,
}

struct SemSet {
    name: String,
    key: i32,
    info: Info,
    seg: Segment,
    nsems: usize,
}

#[derive(Default)]
struct State {
    shm: HashMap<c_int, ShmEntry>,
    /// Attachments by address.
    attached: HashMap<usize, (c_int, Segment)>,
    sems: HashMap<c_int, SemSet>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn lock() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The daemon's shared-memory socket: beside `$NETRAM_DAEMON`, or the default daemon's.
fn socket() -> &'static PathBuf {
    static S: OnceLock<PathBuf> = OnceLock::new();
    S.get_or_init(|| {
        let control = netram_client::discover::daemon_addr();
        netram_shm::local::socket_of(std::path::Path::new(&control))
    })
}

fn set_errno(e: c_int) {
    // SAFETY: the calling thread's errno.
    unsafe { *libc::__errno_location() = e };
}

/// The errno for a failure of the daemon's, with a line on standard error when the reason
/// is not one a System V caller expects (so that a user sees why).
fn errno_of(e: &SegmentError) -> c_int {
    match e {
        SegmentError::Refused(why) if why.contains("permission") => libc::EACCES,
        SegmentError::Refused(why) if why.contains("exists") => libc::EEXIST,
        SegmentError::Refused(why) if why.starts_with("no segment") => libc::ENOENT,
        SegmentError::Refused(why) if why.starts_with("a segment is") => libc::EINVAL,
        other => {
            eprintln!("netram: System V shared memory: {other}");
            libc::EIO
        }
    }
}

/// A System V id for segment `name`: the same in every process and on every machine.
fn id_of(name: &str) -> c_int {
    // FNV-1a: a stable hash (std's is seeded per process).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    ((h ^ (h >> 32)) as u32 & 0x3fff_ffff) as c_int | 1
}

fn name_of(prefix: &str, key: libc::key_t) -> String {
    if key == libc::IPC_PRIVATE {
        format!("{prefix}:private:{:016x}", fastrand::u64(..))
    } else {
        format!("{prefix}:{:08x}", key as u32)
    }
}

fn permitted(info: &Info) -> bool {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    uid == 0 || (uid == info.uid && info.mode & 0o600 == 0o600) || info.mode & 0o006 == 0o006
}

/// Runs `f`, turning a panic into `fail` with EIO: nothing unwinds into C.
fn guarded<T>(fail: T, f: impl FnOnce() -> Result<T, c_int>) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            set_errno(e);
            fail
        }
        Err(_) => {
            set_errno(libc::EIO);
            fail
        }
    }
}

/// Finds or creates the segment called `name` as `shmget`/`semget` do; creating it with
/// `bytes` and the low nine bits of `flg`.
fn get(name: &str, bytes: usize, flg: c_int) -> Result<(Info, Option<Segment>), c_int> {
    let sock = socket();
    let creat = flg & libc::IPC_CREAT != 0;
    for _ in 0..3 {
        match Segment::lookup(sock, name) {
            Ok(Some(info)) => {
                if creat && flg & libc::IPC_EXCL != 0 {
                    return Err(libc::EEXIST);
                }
                if bytes > info.pages as usize * PAGE {
                    return Err(libc::EINVAL);
                }
                if !permitted(&info) {
                    return Err(libc::EACCES);
                }
                return Ok((info, None));
            }
            Ok(None) if !creat => return Err(libc::ENOENT),
            Ok(None) => {
                if bytes == 0 {
                    return Err(libc::EINVAL);
                }
                let mode = (flg & 0o777) as u16;
                match Segment::create(sock, name, bytes as u64, 0, mode, None) {
                    Ok(seg) => {
                        let info = Info {
                            segment: seg.id(),
                            pages: (seg.len() / PAGE) as u32,
                            // SAFETY: geteuid has no preconditions.
                            uid: unsafe { libc::geteuid() },
                            mode,
                        };
                        return Ok((info, Some(seg)));
                    }
                    // Created by another process meanwhile: look again.
                    Err(SegmentError::Refused(why)) if why.contains("exists") => continue,
                    Err(e) => return Err(errno_of(&e)),
                }
            }
            Err(e) => return Err(errno_of(&e)),
        }
    }
    Err(libc::EAGAIN)
}

/// Registers the fork handlers once: this library's state is not left locked in a child, and
/// the child registers its inherited attachments again (`netram_shm::local::follow_forks`).
fn follow_forks() {
    netram_shm::local::follow_forks();
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: plain function pointers with no arguments, as pthread_atfork wants.
        unsafe {
            libc::pthread_atfork(
                Some(before_fork),
                Some(after_fork_parent),
                Some(after_fork_child),
            )
        };
    });
}

thread_local! {
    /// The state's lock, held across a fork by the forking thread (so that no other thread
    /// holds it in the child, where that thread does not exist).
    static HELD: std::cell::RefCell<Option<MutexGuard<'static, Option<State>>>> =
        const { std::cell::RefCell::new(None) };
}

extern "C" fn before_fork() {
    let g = lock();
    HELD.with(|h| *h.borrow_mut() = Some(g));
}

extern "C" fn after_fork_parent() {
    HELD.with(|h| drop(h.borrow_mut().take()));
}

extern "C" fn after_fork_child() {
    HELD.with(|h| drop(h.borrow_mut().take()));
}

// ---------------------------------------------------------------------------------------
// Shared memory.

/// `shmget(2)`.
///
/// # Safety
/// Called as libc's `shmget`.
#[no_mangle]
pub unsafe extern "C" fn shmget(key: libc::key_t, size: usize, flg: c_int) -> c_int {
    guarded(-1, || {
        let name = name_of("sysv", key);
        let (info, seg) = get(&name, size, flg)?;
        drop(seg);
        let id = id_of(&name);
        lock()
            .get_or_insert_default()
            .shm
            .insert(id, ShmEntry { name, key, info });
        Ok(id)
    })
}

/// `shmat(2)`.
///
/// # Safety
/// Called as libc's `shmat`; with an address, the caller gives that range up, as with libc's.
#[no_mangle]
pub unsafe extern "C" fn shmat(shmid: c_int, addr: *const c_void, flg: c_int) -> *mut c_void {
    let fail = usize::MAX as *mut c_void;
    guarded(fail, || {
        let name = {
            let st = lock();
            let e = st
                .as_ref()
                .and_then(|s| s.shm.get(&shmid))
                .ok_or(libc::EINVAL)?;
            e.name.clone()
        };
        let at = if addr.is_null() {
            None
        } else {
            let mut a = addr as usize;
            if flg & libc::SHM_RND != 0 {
                a &= !(PAGE - 1);
            }
            if !a.is_multiple_of(PAGE) {
                return Err(libc::EINVAL);
            }
            Some(a as *mut u8)
        };
        let seg = Segment::attach_at(socket(), &name, at, flg & libc::SHM_REMAP != 0).map_err(
            |e| match e {
                // Something is mapped there already (and no SHM_REMAP).
                SegmentError::Os(rustix::io::Errno::EXIST) => libc::EINVAL,
                e => match errno_of(&e) {
                    // Its name was removed: System V says the id is gone.
                    libc::ENOENT => libc::EIDRM,
                    n => n,
                },
            },
        )?;
        if flg & libc::SHM_RDONLY != 0 {
            // A store through this attachment is a SIGSEGV, as Linux makes it. Faults stay
            // the agent's: its userfaultfd registration outlives the protection change, and
            // lifting write protection from a page mapped read-only leaves it read-only.
            // SAFETY: the attachment's own pages, mapped by `attach_at` just now; nothing of
            // the caller's is there.
            unsafe {
                rustix::mm::mprotect(
                    seg.as_ptr().cast(),
                    seg.len(),
                    rustix::mm::MprotectFlags::READ,
                )
            }
            .map_err(|e| e.raw_os_error())?;
        }
        follow_forks();
        let p = seg.as_ptr();
        lock()
            .get_or_insert_default()
            .attached
            .insert(p as usize, (shmid, seg));
        Ok(p.cast())
    })
}

/// `shmdt(2)`.
///
/// # Safety
/// Called as libc's `shmdt`: nothing may use the attachment afterwards.
#[no_mangle]
pub unsafe extern "C" fn shmdt(addr: *const c_void) -> c_int {
    guarded(-1, || {
        let seg = lock()
            .as_mut()
            .and_then(|s| s.attached.remove(&(addr as usize)))
            .ok_or(libc::EINVAL)?;
        drop(seg);
        Ok(0)
    })
}

/// `shmctl(2)`: IPC_STAT (and SHM_STAT), IPC_RMID, SHM_LOCK and SHM_UNLOCK (nothing to do:
/// the pages are the daemon's).
///
/// # Safety
/// Called as libc's `shmctl`: `buf` points to a `struct shmid_ds` for IPC_STAT.
#[no_mangle]
pub unsafe extern "C" fn shmctl(shmid: c_int, cmd: c_int, buf: *mut libc::shmid_ds) -> c_int {
    guarded(-1, || {
        let mut st = lock();
        let st = st.get_or_insert_default();
        let e = st.shm.get(&shmid).ok_or(libc::EINVAL)?;
        match cmd {
            libc::IPC_STAT | SHM_STAT | SHM_STAT_ANY => {
                if buf.is_null() {
                    return Err(libc::EFAULT);
                }
                let nattch = st.attached.values().filter(|(id, _)| *id == shmid).count();
                // SAFETY: the caller's struct shmid_ds (checked non-null); plain data, zero
                // is a valid value of every field.
                unsafe {
                    std::ptr::write_bytes(buf, 0, 1);
                    let b = &mut *buf;
                    b.shm_perm.__key = e.key;
                    b.shm_perm.uid = e.info.uid;
                    b.shm_perm.cuid = e.info.uid;
                    b.shm_perm.mode = e.info.mode;
                    b.shm_segsz = e.info.pages as usize * PAGE;
                    b.shm_nattch = nattch as libc::shmatt_t;
                }
                Ok(if cmd == libc::IPC_STAT { 0 } else { shmid })
            }
            libc::IPC_RMID => {
                let name = e.name.clone();
                Segment::unlink(socket(), &name).map_err(|e| errno_of(&e))?;
                Ok(0)
            }
            libc::SHM_LOCK | libc::SHM_UNLOCK => Ok(0),
            _ => Err(libc::EINVAL),
        }
    })
}

// ---------------------------------------------------------------------------------------
// Semaphores: a set in one page.
//
// ```text
// 0  lock: u32 (0 free, else the holder's pid)   4  ready: u32 (MAGIC once laid out)
// 8  nsems: u32   12 removed: u32   16 otime: i64   24 ctime: i64
// 64 + 16·i: semval: i32, sempid: i32, 8 bytes unused
// ```

const MAGIC: u32 = 0x5345_4d31; // "SEM1"
const SEM_BASE: usize = 64;
const SEM_SIZE: usize = 16;
/// The most semaphores in a set (one page).
pub const SEMMSL: usize = (PAGE - SEM_BASE) / SEM_SIZE;
/// The largest value of a semaphore (Linux's SEMVMX).
const SEMVMX: i32 = 32767;

/// `struct sembuf`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Sembuf {
    pub sem_num: u16,
    pub sem_op: i16,
    pub sem_flg: i16,
}

/// glibc's `struct semid_ds` on 64-bit Linux.
#[repr(C)]
#[derive(Debug)]
pub struct SemidDs {
    pub sem_perm: libc::ipc_perm,
    pub sem_otime: libc::time_t,
    sem_otime_high: libc::c_ulong,
    pub sem_ctime: libc::time_t,
    sem_ctime_high: libc::c_ulong,
    pub sem_nsems: libc::c_ulong,
    reserved: [libc::c_ulong; 2],
}

/// The words of a set's page.
struct Words(*mut u8);

impl Words {
    fn u32_at(&self, at: usize) -> &AtomicU32 {
        // SAFETY: an aligned word inside the set's live page (callers keep `at` below PAGE).
        unsafe { &*(self.0.add(at) as *const AtomicU32) }
    }
    fn i32_at(&self, at: usize) -> &AtomicI32 {
        // SAFETY: as `u32_at`.
        unsafe { &*(self.0.add(at) as *const AtomicI32) }
    }
    fn lock(&self) -> &AtomicU32 {
        self.u32_at(0)
    }
    fn val(&self, i: usize) -> &AtomicI32 {
        self.i32_at(SEM_BASE + SEM_SIZE * i)
    }
    fn pid(&self, i: usize) -> &AtomicI32 {
        self.i32_at(SEM_BASE + SEM_SIZE * i + 4)
    }
    fn removed(&self) -> bool {
        self.u32_at(12).load(Ordering::SeqCst) != 0
    }

    /// Takes the set's lock (held only for a few loads and stores, never across a wait).
    fn acquire(&self) {
        let me = std::process::id().max(1);
        let mut pause = Duration::from_micros(1);
        while self
            .lock()
            .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_micros(500));
        }
    }

    fn release(&self) {
        self.lock().store(0, Ordering::Release);
    }
}

fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// `semget(2)`.
///
/// # Safety
/// Called as libc's `semget`.
#[no_mangle]
pub unsafe extern "C" fn semget(key: libc::key_t, nsems: c_int, flg: c_int) -> c_int {
    guarded(-1, || {
        if nsems < 0 || nsems as usize > SEMMSL {
            return Err(libc::EINVAL);
        }
        let name = name_of("sysv-sem", key);
        let id = id_of(&name);
        if let Some(s) = lock().as_ref().and_then(|s| s.sems.get(&id)) {
            if flg & libc::IPC_CREAT != 0 && flg & libc::IPC_EXCL != 0 {
                return Err(libc::EEXIST);
            }
            if nsems as usize > s.nsems {
                return Err(libc::EINVAL);
            }
            return Ok(id);
        }
        let (info, created) = get(&name, PAGE, flg)?;
        let seg = match created {
            Some(s) => {
                let w = Words(s.as_ptr());
                w.u32_at(8).store(nsems as u32, Ordering::SeqCst);
                w.i32_at(24).store(now_s() as i32, Ordering::SeqCst);
                w.u32_at(4).store(MAGIC, Ordering::SeqCst);
                s
            }
            None => Segment::attach(socket(), &name).map_err(|e| errno_of(&e))?,
        };
        let w = Words(seg.as_ptr());
        // A set another process is creating: laid out within moments.
        let deadline = Instant::now() + Duration::from_secs(10);
        while w.u32_at(4).load(Ordering::SeqCst) != MAGIC {
            if Instant::now() > deadline {
                return Err(libc::EIDRM);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let have = w.u32_at(8).load(Ordering::SeqCst) as usize;
        if nsems as usize > have || have > SEMMSL {
            return Err(libc::EINVAL);
        }
        follow_forks();
        lock().get_or_insert_default().sems.insert(
            id,
            SemSet {
                name,
                key,
                info,
                seg,
                nsems: have,
            },
        );
        Ok(id)
    })
}

/// `semop(2)`.
///
/// # Safety
/// Called as libc's `semop`: `sops` points to `nsops` `struct sembuf`.
#[no_mangle]
pub unsafe extern "C" fn semop(semid: c_int, sops: *mut Sembuf, nsops: usize) -> c_int {
    // SAFETY: the caller's contract, passed on.
    unsafe { semtimedop(semid, sops, nsops, std::ptr::null()) }
}

/// `semtimedop(2)`: every operation at once, or none; waits (polling) until they can, the
/// timeout passes (EAGAIN), or the set is removed (EIDRM).
///
/// # Safety
/// Called as libc's `semtimedop`: `sops` points to `nsops` `struct sembuf`, `timeout` to a
/// `struct timespec` or is null.
#[no_mangle]
pub unsafe extern "C" fn semtimedop(
    semid: c_int,
    sops: *mut Sembuf,
    nsops: usize,
    timeout: *const libc::timespec,
) -> c_int {
    guarded(-1, || {
        if sops.is_null() || nsops == 0 || nsops > 500 {
            return Err(if nsops > 500 {
                libc::E2BIG
            } else {
                libc::EINVAL
            });
        }
        // SAFETY: the caller's `nsops` operations (checked non-null).
        let ops: Vec<Sembuf> = unsafe { std::slice::from_raw_parts(sops, nsops) }.to_vec();
        let deadline = if timeout.is_null() {
            None
        } else {
            // SAFETY: the caller's timespec (checked non-null).
            let t = unsafe { *timeout };
            if t.tv_sec < 0 || !(0..1_000_000_000).contains(&t.tv_nsec) {
                return Err(libc::EINVAL);
            }
            Some(Instant::now() + Duration::new(t.tv_sec as u64, t.tv_nsec as u32))
        };
        let (base, nsems) = {
            let st = lock();
            let s = st
                .as_ref()
                .and_then(|s| s.sems.get(&semid))
                .ok_or(libc::EINVAL)?;
            (s.seg.as_ptr() as usize, s.nsems)
        };
        if ops.iter().any(|o| o.sem_num as usize >= nsems) {
            return Err(libc::EFBIG);
        }
        let w = Words(base as *mut u8);
        let pid = std::process::id() as i32;
        let mut pause = Duration::from_micros(20);
        loop {
            w.acquire();
            if w.removed() {
                w.release();
                return Err(libc::EIDRM);
            }
            // Every operation checked against the values as the earlier ones leave them.
            let mut vals: Vec<(usize, i32)> = Vec::with_capacity(ops.len());
            let mut blocked = false;
            let mut too_big = false;
            for o in &ops {
                let i = o.sem_num as usize;
                let cur = vals
                    .iter()
                    .rev()
                    .find(|(j, _)| *j == i)
                    .map_or_else(|| w.val(i).load(Ordering::SeqCst), |&(_, v)| v);
                let op = i32::from(o.sem_op);
                let next = cur + op;
                if (op == 0 && cur != 0) || next < 0 {
                    blocked = true;
                    break;
                }
                if next > SEMVMX {
                    too_big = true;
                    break;
                }
                vals.push((i, next));
            }
            if !blocked && !too_big {
                for (i, v) in vals {
                    w.val(i).store(v, Ordering::SeqCst);
                    w.pid(i).store(pid, Ordering::SeqCst);
                }
                w.i32_at(16).store(now_s() as i32, Ordering::SeqCst);
            }
            w.release();
            if too_big {
                return Err(libc::ERANGE);
            }
            if !blocked {
                return Ok(0);
            }
            if ops
                .iter()
                .any(|o| i32::from(o.sem_flg) & libc::IPC_NOWAIT != 0)
            {
                return Err(libc::EAGAIN);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(libc::EAGAIN);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    })
}

/// `semctl(2)`: GETVAL, SETVAL, GETALL, SETALL, GETPID, GETNCNT and GETZCNT (0: waiters
/// poll, uncounted), IPC_STAT, IPC_RMID. The fourth argument (`union semun`) is taken as
/// the word it is passed in (x86-64 and AArch64 pass a variadic integer or pointer in the
/// same register as a fixed one).
///
/// # Safety
/// Called as libc's `semctl`.
#[no_mangle]
pub unsafe extern "C" fn semctl(semid: c_int, semnum: c_int, cmd: c_int, arg: usize) -> c_int {
    guarded(-1, || {
        let (base, nsems, name, key, info) = {
            let st = lock();
            let s = st
                .as_ref()
                .and_then(|s| s.sems.get(&semid))
                .ok_or(libc::EINVAL)?;
            (
                s.seg.as_ptr() as usize,
                s.nsems,
                s.name.clone(),
                s.key,
                s.info,
            )
        };
        let w = Words(base as *mut u8);
        let one = || -> Result<usize, c_int> {
            usize::try_from(semnum)
                .ok()
                .filter(|&i| i < nsems)
                .ok_or(libc::EINVAL)
        };
        match cmd {
            libc::GETVAL => Ok(w.val(one()?).load(Ordering::SeqCst)),
            libc::GETPID => Ok(w.pid(one()?).load(Ordering::SeqCst)),
            libc::GETNCNT | libc::GETZCNT => {
                one()?;
                Ok(0)
            }
            libc::SETVAL => {
                let i = one()?;
                let v = arg as u32 as i32;
                if !(0..=SEMVMX).contains(&v) {
                    return Err(libc::ERANGE);
                }
                w.acquire();
                w.val(i).store(v, Ordering::SeqCst);
                w.i32_at(24).store(now_s() as i32, Ordering::SeqCst);
                w.release();
                Ok(0)
            }
            libc::GETALL | libc::SETALL => {
                let array = arg as *mut u16;
                if array.is_null() {
                    return Err(libc::EFAULT);
                }
                w.acquire();
                for i in 0..nsems {
                    // SAFETY: the caller's array of `nsems` unsigned shorts (semctl's
                    // contract), checked non-null.
                    unsafe {
                        if cmd == libc::GETALL {
                            *array.add(i) = w.val(i).load(Ordering::SeqCst) as u16;
                        } else {
                            w.val(i).store(i32::from(*array.add(i)), Ordering::SeqCst);
                        }
                    }
                }
                w.release();
                Ok(0)
            }
            libc::IPC_STAT | libc::SEM_STAT | libc::SEM_STAT_ANY => {
                let buf = arg as *mut SemidDs;
                if buf.is_null() {
                    return Err(libc::EFAULT);
                }
                // SAFETY: the caller's struct semid_ds (checked non-null); plain data.
                unsafe {
                    std::ptr::write_bytes(buf, 0, 1);
                    let b = &mut *buf;
                    b.sem_perm.__key = key;
                    b.sem_perm.uid = info.uid;
                    b.sem_perm.cuid = info.uid;
                    b.sem_perm.mode = info.mode;
                    b.sem_nsems = nsems as libc::c_ulong;
                    b.sem_otime = libc::time_t::from(w.i32_at(16).load(Ordering::SeqCst));
                    b.sem_ctime = libc::time_t::from(w.i32_at(24).load(Ordering::SeqCst));
                }
                Ok(if cmd == libc::IPC_STAT { 0 } else { semid })
            }
            libc::IPC_RMID => {
                // SAFETY: geteuid has no preconditions.
                let uid = unsafe { libc::geteuid() };
                if uid != 0 && uid != info.uid {
                    return Err(libc::EPERM);
                }
                w.acquire();
                w.u32_at(12).store(1, Ordering::SeqCst);
                w.release();
                Segment::unlink(socket(), &name).map_err(|e| errno_of(&e))?;
                if let Some(s) = lock().as_mut() {
                    s.sems.remove(&semid);
                }
                Ok(0)
            }
            _ => Err(libc::EINVAL),
        }
    })
}
