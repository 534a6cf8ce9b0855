//! netram's C ABI (`libnetram.so` as installed, `libnetram_capi.so` in a build tree;
//! `include/netram.h`): userfaultfd regions of cluster memory (`netram-uffd`) for programs in
//! any language, the API that Anemone §2.2 says programs that know about remote memory can use;
//! and segments shared between machines (`shm`: MIRAGE+'s, through the local daemon).
//!
//! The header is the contract; every function here is its definition. Nothing unwinds into C:
//! each entry point catches panics and turns them, like every error, into a return value and a
//! message for `netram_last_error`.

pub mod shm;
use ::netram_shm::SegmentError;
use netram_client::disk::FileDisk;
use netram_client::env::{EnvError, RunEnv};
use netram_client::maintain::{self, MaintainConfig, Maintenance};
use netram_client::open::{open_pager, OpenError, OpenOptions};
use netram_client::TcpTransport;
use netram_pager::{Backing, ParseBackingError};
use netram_proto::PAGE_SIZE;
use netram_uffd::alloc::enter;
use netram_uffd::heap::FreeError;
use netram_uffd::{Region, RegionCounters, RegionError, RegionHeap, RegionOptions, Upkeep};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Pages of the pager's cache in front of a region: where prefetched pages wait and evicted
/// ones are batched. Local memory beyond the budget, so kept small.
pub const CACHE_PAGES: usize = 64;

/// Forked children of a `netram run` program held to the budget at once (each its own, as
/// large as the parent's); a child forked while all are taken keeps every page it touches.
/// Each slot costs only page numbers in the pager (its table is allocated zeroed, touched only
/// where a child stores a page).
pub const CHILD_SLOTS: usize = 3;

/// A region for C: a heap over it (whose handler probes its servers and rebuilds lost copies
/// between faults), and the thread that follows membership (declared first: it stops before
/// the region goes).
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct netram_region {
    _maintenance: Maintenance,
    heap: RegionHeap<TcpTransport, FileDisk>,
}

/// Starts the background half of reliability for a region (Nswap §IV-B3): servers probed,
/// dead ones reconnected when they come back, lost copies and pieces rebuilt at a bounded
/// pace, pages moved off donors that need their memory. The region's handler runs that
/// schedule between faults, for as long as the region lives; the thread returned only asks
/// the local daemon about membership (`cfg.membership_every`), and its own allocations stay
/// off the region (`enter`): it takes the region's lock, which a fault would wait for.
pub fn start_maintenance(
    heap: &RegionHeap<TcpTransport, FileDisk>,
    cfg: MaintainConfig,
) -> Maintenance {
    let region = heap.region();
    let reply_timeout = region.with_pager(|p| p.transport().reply_timeout());
    region.set_upkeep(Some(Upkeep {
        schedule: cfg.schedule(reply_timeout),
        pacing: cfg.pacing(),
    }));
    let pager = region.pager_handle();
    maintain::spawn_membership(
        move |f| {
            let _ = enter(|| pager.with(|p| f(p)));
        },
        cfg,
    )
}

/// `struct netram_counters` of netram.h.
#[repr(C)]
#[derive(Debug, Default)]
pub struct NetramCounters {
    pub faults: u64,
    pub zero_fills: u64,
    pub fetches: u64,
    pub evictions: u64,
    pub evicted_clean: u64,
    pub samples: u64,
    pub sample_faults: u64,
    pub prefetched: u64,
    pub prefetch_hits: u64,
    pub prefetch_installed: u64,
    pub released: u64,
    pub errors: u64,
    pub resident_bytes: u64,
    pub budget_bytes: u64,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(msg: impl std::fmt::Display) {
    let msg = CString::new(msg.to_string().replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = msg);
}

/// An error with its causes, as `anyhow`'s `{:#}` writes it: "outer: inner: innermost" (a
/// transparent variant already shows its source's text, which is then not repeated).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !msg.ends_with(&text) {
            msg = format!("{msg}: {text}");
        }
        source = s.source();
    }
    msg
}

/// Runs `f`, turning an error or a panic into `fail` and a message.
fn guarded<R>(fail: R, f: impl FnOnce() -> Result<R, CapiError>) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            set_error(error_chain(&e));
            fail
        }
        Err(_) => {
            set_error("internal error (a panic; see the log)");
            fail
        }
    }
}

/// A C string argument, or `None` for NULL.
///
/// # Safety
/// `s` is NULL or a NUL-terminated string alive for the call.
unsafe fn opt_str<'a>(s: *const c_char, what: &'static str) -> Result<Option<&'a str>, CapiError> {
    if s.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's contract.
    let s = unsafe { CStr::from_ptr(s) };
    s.to_str().map(Some).map_err(|_| CapiError::NotUtf8(what))
}

/// Why a C ABI call failed: the message `netram_last_error` returns.
#[derive(Debug, thiserror::Error)]
pub enum CapiError {
    #[error("{0} is NULL")]
    Null(&'static str),
    #[error("{0} is not UTF-8")]
    NotUtf8(&'static str),
    #[error(transparent)]
    Env(#[from] EnvError),
    #[error(transparent)]
    Backing(#[from] ParseBackingError),
    #[error("a region needs a size above zero")]
    NoSize,
    #[error("the budget must be at least one page ({PAGE_SIZE} bytes)")]
    BudgetTooSmall,
    #[error("{0} does not fit this machine's address space")]
    TooLarge(u64),
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error(transparent)]
    Security(#[from] netram_client::SecurityError),
    #[error(transparent)]
    Region(#[from] RegionError),
    #[error("no free range of {0} bytes in the region")]
    NoRange(usize),
    #[error(transparent)]
    Free(#[from] FreeError),
    #[error(transparent)]
    Segment(SegmentError),
    #[error("mode {0:o}: permission bits are at most 0777")]
    Mode(u32),
}

/// Creates a region from the arguments of `netram_region_create`, or the environment
/// (`netram_client::env`: `NETRAM_SERVERS`, `NETRAM_TLS` (the node's credentials) or
/// `NETRAM_INSECURE`, `NETRAM_LOW_LATENCY`, `NETRAM_SPILL_DIR`,
/// `NETRAM_REDUNDANCY`: none, mirror:N, parity:N or rs:K+M, and `NETRAM_SAMPLES`: pages sampled
/// per victim for CLOCK, 0 (the default) for first in, first out) for what they leave out. Used
/// by the preload library too.
pub fn create_region(
    servers: Option<&str>,
    backing: Option<&str>,
    size: u64,
    budget: u64,
) -> Result<RegionHeap<TcpTransport, FileDisk>, CapiError> {
    let env = RunEnv::from_env()?;
    let redundancy = env.redundancy.unwrap_or_default();
    region_from(servers, backing, size, budget, redundancy, &env)
}

/// [`create_region`] with the redundancy given rather than read from `NETRAM_REDUNDANCY`.
pub fn create_region_with(
    servers: Option<&str>,
    backing: Option<&str>,
    size: u64,
    budget: u64,
    redundancy: netram_pager::Scheme,
) -> Result<RegionHeap<TcpTransport, FileDisk>, CapiError> {
    region_from(
        servers,
        backing,
        size,
        budget,
        redundancy,
        &RunEnv::from_env()?,
    )
}

/// A region from the arguments, with the environment `env` for what they leave out.
pub fn region_from(
    servers: Option<&str>,
    backing: Option<&str>,
    size: u64,
    budget: u64,
    redundancy: netram_pager::Scheme,
    env: &RunEnv,
) -> Result<RegionHeap<TcpTransport, FileDisk>, CapiError> {
    let servers: Vec<String> = match servers {
        Some(s) => s
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect(),
        None => env.servers.clone(),
    };
    let backing: Backing = backing.unwrap_or("cluster").parse()?;
    if size == 0 {
        return Err(CapiError::NoSize);
    }
    if budget < PAGE_SIZE as u64 {
        return Err(CapiError::BudgetTooSmall);
    }
    // Credentials (`NETRAM_TLS`), or clear TCP when told (`NETRAM_INSECURE`); none needed
    // on the local disk alone. Without servers, the local daemon's members are used
    // (`netram_client::discover`).
    let security = if backing == Backing::Disk {
        netram_client::Security::Insecure
    } else {
        netram_client::security(env.tls.as_deref(), env.insecure)?
    };
    // Forked children held to the budget too (`netram run`, whose children follow the
    // region): their own pages go to page numbers past the region's.
    let unlimited = env.child_mem == Some(netram_client::env::CHILD_MEM_UNLIMITED);
    let child_slots = if netram_uffd::children_follow() && !unlimited {
        CHILD_SLOTS
    } else {
        0
    };
    let mut pager = open_pager(&OpenOptions {
        security,
        servers,
        backing,
        pages: size.div_ceil(PAGE_SIZE as u64) * (1 + child_slots as u64),
        cache_pages: CACHE_PAGES,
        spill_dir: env.spill_dir.clone(),
        low_latency: env.low_latency,
        redundancy,
    })?;
    netram_client::open::compress(&mut pager, env.compress_link_mbps);
    let size = usize::try_from(size).map_err(|_| CapiError::TooLarge(size))?;
    let budget = usize::try_from(budget).map_err(|_| CapiError::TooLarge(budget))?;
    let mut options = RegionOptions::default();
    if env.low_latency {
        // As the pager's sockets do in the low-latency mode.
        options.spin = netram_client::latency::DEFAULT_SPIN;
    }
    if let Some(samples) = env.samples {
        options.max_samples = samples;
    }
    options.child_slots = child_slots;
    options.child_budget = env.child_mem.and_then(|m| usize::try_from(m).ok());
    Ok(RegionHeap::new(Region::with_options(
        pager, size, budget, options,
    )?))
}

/// See netram.h.
///
/// # Safety
/// `servers` and `backing` are NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn netram_region_create(
    servers: *const c_char,
    backing: *const c_char,
    size: u64,
    budget: u64,
) -> *mut netram_region {
    guarded(std::ptr::null_mut(), || {
        // SAFETY: the caller's contract.
        let (servers, backing) =
            unsafe { (opt_str(servers, "servers")?, opt_str(backing, "backing")?) };
        let heap = create_region(servers, backing, size, budget)?;
        let maintenance = start_maintenance(&heap, MaintainConfig::default());
        Ok(Box::into_raw(Box::new(netram_region {
            _maintenance: maintenance,
            heap,
        })))
    })
}

/// # Safety
/// `region` is NULL or a region from `netram_region_create`, not used again.
#[no_mangle]
pub unsafe extern "C" fn netram_region_destroy(region: *mut netram_region) {
    if region.is_null() {
        return;
    }
    guarded((), || {
        // SAFETY: the caller's contract: ours, from Box::into_raw, given back once.
        drop(unsafe { Box::from_raw(region) });
        Ok(())
    })
}

/// The region behind a pointer from C.
///
/// # Safety
/// `region` is NULL or a live region from `netram_region_create`.
unsafe fn region_ref<'a>(region: *mut netram_region) -> Result<&'a netram_region, CapiError> {
    // SAFETY: the caller's contract.
    unsafe { region.as_ref() }.ok_or(CapiError::Null("the region"))
}

/// # Safety
/// `region` is NULL or a live region.
#[no_mangle]
pub unsafe extern "C" fn netram_region_base(region: *mut netram_region) -> *mut c_void {
    guarded(std::ptr::null_mut(), || {
        // SAFETY: the caller's contract.
        Ok(unsafe { region_ref(region) }?.heap.region().as_ptr().cast())
    })
}

/// # Safety
/// `region` is NULL or a live region.
#[no_mangle]
pub unsafe extern "C" fn netram_alloc(region: *mut netram_region, size: usize) -> *mut c_void {
    guarded(std::ptr::null_mut(), || {
        // SAFETY: the caller's contract.
        let r = unsafe { region_ref(region) }?;
        match r.heap.alloc(size, PAGE_SIZE) {
            Some(p) => Ok(p.as_ptr().cast()),
            None => Err(CapiError::NoRange(size)),
        }
    })
}

/// # Safety
/// `region` is NULL or a live region; `ptr` is NULL or was returned by `netram_alloc` on it
/// and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn netram_free(region: *mut netram_region, ptr: *mut c_void) -> c_int {
    if ptr.is_null() {
        return 0;
    }
    guarded(-1, || {
        // SAFETY: the caller's contract.
        let r = unsafe { region_ref(region) }?;
        r.heap.free(ptr.cast())?;
        Ok(0)
    })
}

/// # Safety
/// `region` is NULL or a live region.
#[no_mangle]
pub unsafe extern "C" fn netram_set_budget(region: *mut netram_region, budget: u64) -> c_int {
    guarded(-1, || {
        // SAFETY: the caller's contract.
        let r = unsafe { region_ref(region) }?;
        let budget = usize::try_from(budget).map_err(|_| CapiError::TooLarge(budget))?;
        r.heap.region().set_budget(budget);
        Ok(0)
    })
}

/// # Safety
/// `region` is NULL or a live region; `out` is NULL or points to a writable
/// `struct netram_counters`.
#[no_mangle]
pub unsafe extern "C" fn netram_counters(
    region: *mut netram_region,
    out: *mut NetramCounters,
) -> c_int {
    guarded(-1, || {
        // SAFETY: the caller's contract.
        let r = unsafe { region_ref(region) }?;
        // SAFETY: the caller's contract.
        let out = unsafe { out.as_mut() }.ok_or(CapiError::Null("out"))?;
        *out = counters_of(r.heap.region());
        Ok(0)
    })
}

/// The counters of netram.h for `region`.
pub fn counters_of<T, D>(region: &Region<T, D>) -> NetramCounters
where
    T: netram_pager::Transport,
    D: netram_pager::Disk,
{
    let c = region.counters();
    let g = RegionCounters::get;
    NetramCounters {
        faults: g(&c.faults),
        zero_fills: g(&c.zero_fills),
        fetches: g(&c.fetches),
        evictions: g(&c.evictions),
        evicted_clean: g(&c.evicted_clean),
        samples: g(&c.samples),
        sample_faults: g(&c.sample_faults),
        prefetched: g(&c.prefetched),
        prefetch_hits: g(&c.prefetch_hits),
        prefetch_installed: g(&c.prefetch_installed),
        released: g(&c.released),
        errors: g(&c.errors),
        resident_bytes: (region.resident_pages() * PAGE_SIZE) as u64,
        budget_bytes: region.budget() as u64,
    }
}

#[no_mangle]
pub extern "C" fn netram_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|e| e.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}
