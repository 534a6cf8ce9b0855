//! Starting and forking: the library's constructor (`on_load`: the region made from
//! `netram run`'s environment), its exit handler (the report), `fork` announced to the region
//! and followed in the child (its agent, its SIGSEGV message), and `pthread_create` marking
//! netram's own threads (Anemone §2.1's transparency, kept across `fork`).

use super::*;

/// Why the library could not start; the program then runs without netram (or, with
/// `NETRAM_REQUIRED`, not at all).
#[derive(Debug, thiserror::Error)]
pub(crate) enum StartError {
    #[error(transparent)]
    Env(#[from] EnvError),
    #[error(transparent)]
    Region(#[from] netram_capi::CapiError),
    #[error("{0}={1}: too large for this machine")]
    TooLarge(&'static str, u64),
}

pub(crate) fn start() -> Result<bool, StartError> {
    let env = RunEnv::from_env()?;
    // Without a budget the library was not asked to do anything.
    let Some(budget) = env.local_mem else {
        return Ok(false);
    };
    let size = env.max_mem.unwrap_or((8 * budget).max(1 << 30));
    // `None`: every allocation (or, where the region cannot serve the kernel's own accesses,
    // the large ones: see below).
    let threshold = env
        .threshold
        .map(|t| usize::try_from(t).map_err(|_| StartError::TooLarge(var::THRESHOLD, t)))
        .transpose()?;
    if std::env::var_os(var::LOG).is_some() {
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter(tracing_subscriber::EnvFilter::from_env(var::LOG))
            .try_init();
    } else {
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_max_level(tracing::Level::WARN)
            .try_init();
    }
    let backing = env.backing.map(|b| b.to_string());
    let redundancy = env.redundancy.unwrap_or_default();
    // `after_fork_in_child` serves every child its copy (see `Region::follow_in_child`).
    netram_uffd::children_follow_regions();
    let heap = netram_capi::region_from(None, backing.as_deref(), size, budget, redundancy, &env)?;
    let start = heap.region().as_ptr() as usize;
    REGION_START.store(start, Ordering::Relaxed);
    REGION_END.store(start + heap.region().len(), Ordering::Relaxed);
    let _ = HEAP.set(heap);
    if let Some(h) = HEAP.get() {
        // Probes, reconnections and recovery (by the handler, between faults) and membership,
        // for the process's lifetime.
        let _ = MAINTENANCE.set(netram_capi::start_maintenance(h, Default::default()));
    }
    // An ordinary user's userfaultfd does not serve faults raised inside system calls: a
    // `read(2)` into a buffer whose page is not resident fails with EFAULT. Small blocks are
    // what programs hand to system calls (stdio's buffers, lines read), so there only large
    // allocations go on the region, which programs mostly compute in.
    //
    // Nor where a forked child cannot inherit the region (the same ordinary user: following
    // forks needs CAP_SYS_PTRACE): a shell or a `make` touches its heap between `fork` and
    // `exec`.
    let follows_forks = HEAP.get().is_some_and(|h| h.region().follows_forks());
    FOLLOWS_FORKS.store(follows_forks, Ordering::Relaxed);
    let threshold = threshold.unwrap_or_else(|| {
        if HEAP
            .get()
            .is_some_and(|h| h.region().serves_kernel_faults())
            && follows_forks
        {
            0
        } else {
            tracing::info!(
                "userfaultfd for user-mode faults only: allocations under 128 KiB stay local"
            );
            USER_MODE_THRESHOLD
        }
    });
    THRESHOLD.store(threshold, Ordering::Release);
    if HEAP
        .get()
        .is_some_and(|h| !h.region().serves_kernel_faults())
    {
        // What the kernel copies to or from the region is brought in first (see `io`).
        io::arm(usize::try_from(budget).unwrap_or(usize::MAX));
    }
    OWNER.store(std::process::id(), Ordering::Relaxed);
    // SAFETY: registering plain functions with the C library; they only touch atomics and
    // (at exit) write a file.
    unsafe {
        libc::pthread_atfork(None, None, Some(after_fork_in_child));
        libc::atexit(at_exit);
    }
    Ok(true)
}

/// The process whose region this is (see `_exit`).
static OWNER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

pub(crate) static EXIT: loader::Next = loader::Next::new(c"_exit");
pub(crate) static EXIT_UPPER: loader::Next = loader::Next::new(c"_Exit");

/// `_exit` (and `_Exit`): the end of a process that skips the C library's exit handlers,
/// [`at_exit`] among them. A process that forked and leaves this way (Python's `os._exit`,
/// a C program's `_exit`) would take its children's memory with it: their pages on the
/// servers were served by its handler, and they read garbage (a forked Python was seen
/// spinning at full CPU on it). The C library's own calls do not come through here (hence
/// this library's own [`daemon`]; a raw `exit_group` is not seen: docs/limits.md). So its
/// children get their pages first and the run's report gets its counters, as at `exit`. Only in the process that owns the region (a `vfork`
/// child shares its memory, and must not touch the pager under its parent's threads), and
/// only with children alive: `_exit` is also what a signal handler calls, maybe while this
/// library's own locks are held by the thread it interrupted; without children nothing is
/// lost but the report.
fn leave(status: c_int, next: &loader::Next) -> ! {
    if OWNER.load(Ordering::Relaxed) == std::process::id()
        && HEAP.get().is_some_and(|h| h.region().has_children())
    {
        at_exit();
    }
    type Exit = unsafe extern "C" fn(c_int) -> !;
    // SAFETY: the symbol is `_exit` or `_Exit`, with this signature.
    if let Some(real) = unsafe { next.get::<Exit>() } {
        // SAFETY: passed through.
        unsafe { real(status) }
    }
    // SAFETY: exit_group(2) takes no pointers and does not return.
    unsafe { libc::syscall(libc::SYS_exit_group, status) };
    unreachable!("exit_group returned")
}

/// See [`leave`].
///
/// # Safety
/// The C library's contract for `_exit`.
#[no_mangle]
pub unsafe extern "C" fn _exit(status: c_int) -> ! {
    leave(status, &EXIT)
}

/// See [`leave`].
///
/// # Safety
/// The C library's contract for `_Exit`.
#[no_mangle]
pub unsafe extern "C" fn _Exit(status: c_int) -> ! {
    leave(status, &EXIT_UPPER)
}

/// `daemon(3)`, as the C library's (fork; the parent leaves; the child starts a session, goes
/// to `/` unless `nochdir`, and points 0, 1 and 2 at `/dev/null` unless `noclose`), but by
/// this library's `fork` and `_exit`. The C library's own calls its internal `fork` and
/// `_exit`, which nothing can interpose: the fork was not announced, and the parent left
/// without handing its child the pages it had on the servers, so a program that daemonized
/// itself (`ssh -f`, iproute2's `nstat -d`) read zeros there.
///
/// # Safety
/// The C library's contract for `daemon`.
#[no_mangle]
pub unsafe extern "C" fn daemon(nochdir: c_int, noclose: c_int) -> c_int {
    // SAFETY: this library's own `fork` (the C library's contract, passed through).
    match unsafe { fork() } {
        -1 => return -1,
        0 => {}
        // SAFETY: the parent leaves as the C library's `daemon` makes it (with `_exit`).
        _ => unsafe { _exit(0) },
    }
    // SAFETY: setsid and chdir take no pointers but the static path.
    if unsafe { libc::setsid() } == -1 {
        return -1;
    }
    if nochdir == 0 {
        // SAFETY: a static C string. As the C library's, a failure is not one of `daemon`'s.
        let _ = unsafe { libc::chdir(c"/".as_ptr()) };
    }
    if noclose == 0 {
        // SAFETY: a static C string.
        let fd = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR) };
        if fd == -1 {
            return -1;
        }
        // SAFETY: a plain C struct, all zeros a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is written by fstat, `fd` is the descriptor just opened.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            // SAFETY: our own descriptor.
            unsafe { libc::close(fd) };
            return -1;
        }
        // As the C library checks: a character device, and the null one (1, 3), not a file
        // someone put at that path.
        let null =
            (st.st_mode & libc::S_IFMT) == libc::S_IFCHR && st.st_rdev == libc::makedev(1, 3);
        if !null {
            // SAFETY: our own descriptor.
            unsafe { libc::close(fd) };
            set_errno(libc::ENODEV);
            return -1;
        }
        for to in [libc::STDIN_FILENO, libc::STDOUT_FILENO, libc::STDERR_FILENO] {
            // SAFETY: both descriptors are open; dup2 replaces the standard one.
            unsafe { libc::dup2(fd, to) };
        }
        if fd > 2 {
            // SAFETY: our own descriptor, duplicated above.
            unsafe { libc::close(fd) };
        }
    }
    0
}

pub(crate) extern "C" fn after_fork_in_child() {
    // Before anything allocates here: this child's own blocks (see `child_arena`).
    child_arena::reset();
    IN_CHILD.store(true, Ordering::Relaxed);
    if FOLLOWS_FORKS.load(Ordering::Relaxed) {
        // The child has the region, served by its parent's handler (which may need this
        // child to send it a descriptor first).
        let followed = HEAP.get().map_or(Ok(()), |h| h.region().follow_in_child());
        let Err(e) = followed else {
            return;
        };
        // Its pages that were not resident at the fork would read as zeros: the region is
        // made inaccessible instead, and a touch says why (below).
        CHILD_UNSERVED.store(e.raw_os_error(), Ordering::Relaxed);
        let (start, end) = (
            REGION_START.load(Ordering::Relaxed),
            REGION_END.load(Ordering::Relaxed),
        );
        // SAFETY: mprotect changes only the access of this child's copy of the region,
        // which no Rust reference of this library's refers to.
        unsafe { libc::mprotect(start as *mut c_void, end - start, libc::PROT_NONE) };
    }
    // The child has no region (it is not inherited): a touch of netram memory is a SIGSEGV.
    // Say why before it ends the child.
    // SAFETY: sigaction with a handler that only calls async-signal-safe functions; the
    // previous action is written to PREVIOUS_SEGV, which only this child's signal handler
    // reads, after this returns (fork handlers run on the child's only thread).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_segv as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(
            libc::SIGSEGV,
            &sa,
            std::ptr::addr_of_mut!(PREVIOUS_SEGV).cast(),
        );
    }
}

pub(crate) extern "C" fn on_segv(_: c_int, info: *mut libc::siginfo_t, _: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    let ours =
        (REGION_START.load(Ordering::Relaxed)..REGION_END.load(Ordering::Relaxed)).contains(&addr);
    let unserved = CHILD_UNSERVED.load(Ordering::Relaxed);
    if ours && unserved != 0 {
        const MSG: &[u8] = b"netram: this process was forked from one whose memory is on netram, \
and could not open a userfaultfd to be served its copy of that memory (see errno below); \
it touched that memory and dies of SIGSEGV\n";
        // SAFETY: as below.
        unsafe { libc::syscall(libc::SYS_write, 2, MSG.as_ptr(), MSG.len()) };
        let mut digits = *b"netram: errno 000\n";
        digits[14] = b'0' + (unserved / 100 % 10) as u8;
        digits[15] = b'0' + (unserved / 10 % 10) as u8;
        digits[16] = b'0' + (unserved % 10) as u8;
        // SAFETY: as below.
        unsafe { libc::syscall(libc::SYS_write, 2, digits.as_ptr(), digits.len()) };
    } else if ours {
        const MSG: &[u8] = b"netram: this process was forked from one whose memory is on netram, \
and a forked child does not inherit that memory: fork without exec is not supported under \
netram run (the child touched it and dies of SIGSEGV)\n";
        // SAFETY: the write system call is async-signal-safe; MSG is static. (Not the C
        // library's `write`: that name is this library's interposer, see `io`.)
        unsafe { libc::syscall(libc::SYS_write, 2, MSG.as_ptr(), MSG.len()) };
    }
    // Back to the action the child had; returning re-runs the access, which then gets it
    // (by default, death by SIGSEGV).
    // SAFETY: PREVIOUS_SEGV was written by sigaction in after_fork_in_child.
    unsafe {
        libc::sigaction(
            libc::SIGSEGV,
            std::ptr::addr_of!(PREVIOUS_SEGV).cast(),
            std::ptr::null_mut(),
        )
    };
}

/// Hands the region's pages to forked children still running, and writes this process's
/// counters to `$NETRAM_REPORT/<pid>.json`: at `exit`, and at `_exit` (see [`leave`]), once.
pub(crate) extern "C" fn at_exit() {
    static DONE: AtomicBool = AtomicBool::new(false);
    if IN_CHILD.load(Ordering::Relaxed) || DONE.swap(true, Ordering::AcqRel) {
        return;
    }
    if let Some(heap) = HEAP.get() {
        // Children still running keep their memory after this process is gone.
        let _ = enter(|| heap.region().hand_over_to_children());
    }
    let (Some(dir), Some(heap)) = (std::env::var_os(var::REPORT), HEAP.get()) else {
        return;
    };
    let _ = enter(|| {
        let c = netram_capi::counters_of(heap.region());
        let (rc, get) = (heap.region().counters(), netram_uffd::RegionCounters::get);
        let pager = heap.region().with_pager(|p| p.counters().clone());
        let stats = heap.stats();
        let report = serde_json::json!({
            "pid": std::process::id(),
            "faults": c.faults,
            "zero_fills": c.zero_fills,
            "fetches": c.fetches,
            "evictions": c.evictions,
            "evicted_clean": c.evicted_clean,
            "samples": c.samples,
            "sample_faults": c.sample_faults,
            "prefetched": c.prefetched,
            "prefetch_hits": c.prefetch_hits,
            "prefetch_installed": c.prefetch_installed,
            "released": c.released,
            "batched_fetches": get(&rc.batched_fetches),
            "unreadable_victims": get(&rc.unreadable_victims),
            "write_protect_calls": get(&rc.write_protect_calls),
            "forks": get(&rc.forks),
            "events_read_by_watcher": get(&rc.events_read_by_watcher),
            "child_faults": get(&rc.child_faults),
            "child_fetches": get(&rc.child_fetches),
            "child_fetches_redone": get(&rc.child_fetches_redone),
            "child_prefetched": get(&rc.child_prefetched),
            "victims_settling": get(&rc.victims_settling),
            "child_copies": get(&rc.child_copies),
            "child_drops": get(&rc.child_drops),
            "child_private_pages": get(&rc.child_private_pages),
            "child_peak_resident_pages": get(&rc.child_peak_resident),
            "errors": c.errors,
            "resident_bytes": c.resident_bytes,
            "budget_bytes": c.budget_bytes,
            "allocated_bytes": heap.allocated(),
            "heap_small_bytes": stats.small_bytes,
            "heap_spans": stats.spans,
            "heap_large_bytes": stats.large_bytes,
            "heap_free_ranges": stats.free_ranges,
            "heap_largest_free_bytes": stats.largest_free_bytes,
            "gets": pager.gets,
            "puts": pager.puts,
            "spills": pager.spills,
            "disk_writes": pager.disk_writes,
            "io_guarded": io::GUARDED_CALLS.load(Ordering::Relaxed),
            "io_refaults": io::REFAULTS.load(Ordering::Relaxed),
        });
        let mut report = report;
        // What the redundancy did: servers lost, reads served from another copy or decoded
        // from a stripe or group, pages rebuilt, pages lost for good, pages moved off donors.
        // (Added apart: one `json!` of them all passes the macro's recursion limit.)
        let redundancy = [
            ("servers_dead", pager.servers_dead),
            ("reads_from_other_copy", pager.reads_from_other_copy),
            ("degraded_reads", pager.degraded_reads),
            ("pages_rebuilt", pager.pages_rebuilt),
            ("pages_unrecoverable", pager.pages_unrecoverable),
            ("pages_migrated", pager.pages_migrated),
            // Reads served from the local disk (a server dead, a copy bad or dropped), and of
            // those the copies a full server dropped as clean pages (`cluster+disk`, GMS).
            ("disk_fallbacks", pager.disk_fallbacks),
            ("clean_copies_dropped", pager.clean_copies_dropped),
            // Pages compressed before they were sealed (`--compress-link-mbps`), the bytes
            // that saved on the wire, and pages sent whole because LZ4 fell short.
            ("pages_compressed", pager.pages_compressed),
            ("bytes_saved_compressing", pager.bytes_saved_compressing),
            ("pages_compress_aborted", pager.pages_compress_aborted),
            // How often eviction found the pager without room and left its victims for
            // later, or waited (the region a batch over its budget: servers behind).
            ("evictions_deferred", get(&rc.evictions_deferred)),
            ("victims_kept", get(&rc.victims_kept)),
            ("evictions_waited", get(&rc.evictions_waited)),
            ("releases_deferred", get(&rc.releases_deferred)),
            ("releases_settling", get(&rc.releases_settling)),
            // Faults that came while a fork was pending, served after it.
            ("faults_deferred", get(&rc.faults_deferred)),
            // Faults held while the region was past its budget's margin, servers behind.
            ("faults_held", get(&rc.faults_held)),
            // Replies the pager blocked for (the waiting paths left: forks, a region's end).
            ("pager_waits", pager.waits),
            // Pages the pager's pool grew by rather than wait (`write_over_budget`).
            ("pager_slots_grown", pager.slots_grown),
        ];
        if let Some(m) = report.as_object_mut() {
            for (k, v) in redundancy {
                m.insert(k.into(), v.into());
            }
        }
        let path = std::path::Path::new(&dir).join(format!("{}.json", std::process::id()));
        if let Err(e) = std::fs::write(&path, report.to_string()) {
            eprintln!("netram: cannot write {}: {e}", path.display());
        }
    });
}

/// Runs when the library is loaded, before the program's `main`: connects to the servers
/// and maps the region, so that a bad configuration is reported at once.
pub(crate) extern "C" fn on_load() {
    // Look the program's allocator up before the program allocates, so that every block it
    // gets comes from, and goes back to, the allocator that will serve it; and every other
    // function this library passes calls on to, before the region exists (see `loader`).
    let _ = foreign();
    loader::resolve_all();
    let _ = enter(|| {
        if STATE
            .compare_exchange(UNINIT, INITIALIZING, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        match start() {
            Ok(true) => {
                STATE.store(READY, Ordering::Release);
                // `netram run` counts these: a run with none never had netram (the loader
                // ignored this library), whatever the program's exit status says.
                if let Some(dir) = std::env::var_os(var::REPORT) {
                    let mark =
                        std::path::Path::new(&dir).join(format!("attached-{}", std::process::id()));
                    let _ = std::fs::write(mark, b"");
                }
            }
            Ok(false) => STATE.store(OFF, Ordering::Release),
            Err(e) => {
                STATE.store(OFF, Ordering::Release);
                eprintln!("netram: {}", netram_capi::error_chain(&e));
                if std::env::var_os(var::REQUIRED).is_some() {
                    // SAFETY: ends the process before main; nothing to unwind.
                    unsafe { libc::_exit(70) };
                }
                eprintln!("netram: the program runs without netram");
            }
        }
    });
}

#[used]
#[link_section = ".init_array"]
pub(crate) static ON_LOAD: extern "C" fn() = on_load;

/// The C library's `fork` and `pthread_create`, looked up at load (see [`loader`]).
pub(crate) static FORK: loader::Next = loader::Next::new(c"fork");
pub(crate) static PTHREAD_CREATE: loader::Next = loader::Next::new(c"pthread_create");

/// `fork`, announced to the region first (see `netram_uffd::Region::prepare_fork`): the
/// child then gets its memory as it was at the fork, whether resident or on the servers.
///
/// # Safety
/// The C library's contract for `fork`.
#[no_mangle]
pub unsafe extern "C" fn fork() -> libc::pid_t {
    type Fork = unsafe extern "C" fn() -> libc::pid_t;
    // SAFETY: the symbol is fork, with this signature.
    let Some(real) = (unsafe { FORK.get::<Fork>() }) else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    let heap = HEAP.get().filter(|_| {
        STATE.load(Ordering::Acquire) == READY
            && !IN_CHILD.load(Ordering::Relaxed)
            && FOLLOWS_FORKS.load(Ordering::Relaxed)
    });
    let announced = heap.and_then(|h| enter(|| h.region().prepare_fork()));
    // SAFETY: passed through.
    let pid = unsafe { real() };
    if pid > 0 {
        if let (Some(h), Some(())) = (heap, announced) {
            // SAFETY: this thread's errno, kept across the wait.
            let errno = unsafe { *libc::__errno_location() };
            let _ = enter(|| h.region().await_child(pid));
            set_errno(errno);
        }
    }
    if pid < 0 {
        if let (Some(h), Some(())) = (heap, announced) {
            // SAFETY: this thread's errno, kept across the call.
            let errno = unsafe { *libc::__errno_location() };
            let _ = enter(|| h.region().fork_failed());
            set_errno(errno);
        }
    }
    pid
}

pub(crate) type StartRoutine = extern "C" fn(*mut c_void) -> *mut c_void;

/// A thread netram's code starts (inside `enter`: the fault handler, keepalive, maintenance):
/// it is netram's own from its first instruction, so that nothing it allocates lands on the
/// region or in a foreign allocator (see [`foreign`]).
pub(crate) extern "C" fn internal_thread(arg: *mut c_void) -> *mut c_void {
    // SAFETY: `arg` is the box `pthread_create` below made for this thread, taken once.
    let start = unsafe { Box::from_raw(arg.cast::<(StartRoutine, usize)>()) };
    netram_uffd::alloc::mark_internal_thread();
    loader::mark_own_thread();
    (start.0)(start.1 as *mut c_void)
}

/// # Safety
/// The C library's contract for `pthread_create`.
#[no_mangle]
pub unsafe extern "C" fn pthread_create(
    thread: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    start: StartRoutine,
    arg: *mut c_void,
) -> c_int {
    type Create = unsafe extern "C" fn(
        *mut libc::pthread_t,
        *const libc::pthread_attr_t,
        StartRoutine,
        *mut c_void,
    ) -> c_int;
    // SAFETY: the symbol is pthread_create, with this signature.
    let Some(real) = (unsafe { PTHREAD_CREATE.get::<Create>() }) else {
        return libc::EAGAIN;
    };
    if !netram_uffd::alloc::is_inside() {
        // SAFETY: passed through.
        return unsafe { real(thread, attr, start, arg) };
    }
    let boxed = Box::into_raw(Box::new((start, arg as usize)));
    // SAFETY: passed through with the trampoline, which takes the box back.
    let rc = unsafe { real(thread, attr, internal_thread, boxed.cast()) };
    if rc != 0 {
        // SAFETY: the thread was not created: the box is still ours.
        drop(unsafe { Box::from_raw(boxed) });
    }
    rc
}
