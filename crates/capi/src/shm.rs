//! Segments shared between machines for C (MIRAGE+; `netram.h`'s `netram_shm_*`): a thin
//! layer over `netram_shm::Segment`, through the local daemon's shared-memory socket (beside
//! its control socket: `NETRAM_DAEMON`, or the default daemon's).

use crate::{guarded, opt_str, CapiError};
use ::netram_shm::{Segment, SegmentError};
use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::Mutex;

/// A segment attached to this process.
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct netram_shm {
    segment: Segment,
}

/// The live handles, by address: a forked child registers each again (`follow_fork`).
static LIVE: Mutex<Vec<usize>> = Mutex::new(Vec::new());

fn live() -> std::sync::MutexGuard<'static, Vec<usize>> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

/// A new handle, known to the fork handler (registered once).
fn keep(segment: Segment) -> *mut netram_shm {
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
    let p = Box::into_raw(Box::new(netram_shm { segment }));
    live().push(p as usize);
    p
}

thread_local! {
    /// The handles' lock, held across a fork by the forking thread.
    static HELD: std::cell::RefCell<Option<std::sync::MutexGuard<'static, Vec<usize>>>> =
        const { std::cell::RefCell::new(None) };
}

extern "C" fn before_fork() {
    let g = live();
    HELD.with(|h| *h.borrow_mut() = Some(g));
}

extern "C" fn after_fork_parent() {
    HELD.with(|h| drop(h.borrow_mut().take()));
}

/// In the child: its inherited attachments fault to no one until registered again.
extern "C" fn after_fork_child() {
    let _ = std::panic::catch_unwind(|| {
        HELD.with(|h| {
            let mut held = h.borrow_mut();
            if let Some(handles) = held.as_ref() {
                let sock = socket();
                for &p in handles.iter() {
                    // SAFETY: a live handle (listed until detached), this child's copy.
                    let s = unsafe { &mut *(p as *mut netram_shm) };
                    if let Err(e) = s.segment.follow_fork(&sock) {
                        eprintln!("netram: a forked child cannot follow its segments: {e}");
                        // SAFETY: ending the child before it uses a segment nobody keeps
                        // coherent.
                        unsafe { libc::_exit(127) };
                    }
                }
            }
            held.take();
        });
    });
}

fn socket() -> PathBuf {
    let control = netram_client::discover::daemon_addr();
    ::netram_shm::local::socket_of(std::path::Path::new(&control))
}

fn name<'a>(name: *const c_char) -> Result<&'a str, CapiError> {
    // SAFETY: the caller's contract: NULL or a NUL-terminated string.
    unsafe { opt_str(name, "the name") }?.ok_or(CapiError::Null("the name"))
}

impl From<SegmentError> for CapiError {
    fn from(e: SegmentError) -> Self {
        CapiError::Segment(e)
    }
}

/// See netram.h.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn netram_shm_create(
    name: *const c_char,
    size: u64,
    mode: u32,
    window_ms: u32,
) -> *mut netram_shm {
    guarded(std::ptr::null_mut(), || {
        let mode = u16::try_from(mode)
            .ok()
            .filter(|m| *m <= 0o777)
            .ok_or(CapiError::Mode(mode))?;
        let segment = Segment::create(&socket(), self::name(name)?, size, window_ms, mode, None)?;
        Ok(keep(segment))
    })
}

/// See netram.h.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn netram_shm_attach(name: *const c_char) -> *mut netram_shm {
    guarded(std::ptr::null_mut(), || {
        let segment = Segment::attach(&socket(), self::name(name)?)?;
        Ok(keep(segment))
    })
}

/// # Safety
/// `shm` is NULL or a live segment from `netram_shm_create`/`netram_shm_attach`.
#[no_mangle]
pub unsafe extern "C" fn netram_shm_base(shm: *mut netram_shm) -> *mut c_void {
    guarded(std::ptr::null_mut(), || {
        // SAFETY: the caller's contract.
        let s = unsafe { shm.as_ref() }.ok_or(CapiError::Null("the segment"))?;
        Ok(s.segment.as_ptr().cast())
    })
}

/// # Safety
/// As `netram_shm_base`.
#[no_mangle]
pub unsafe extern "C" fn netram_shm_size(shm: *mut netram_shm) -> u64 {
    guarded(0, || {
        // SAFETY: the caller's contract.
        let s = unsafe { shm.as_ref() }.ok_or(CapiError::Null("the segment"))?;
        Ok(s.segment.len() as u64)
    })
}

/// # Safety
/// `shm` is NULL or a segment from `netram_shm_create`/`netram_shm_attach`, not used again
/// (nor its memory).
#[no_mangle]
pub unsafe extern "C" fn netram_shm_detach(shm: *mut netram_shm) -> c_int {
    if shm.is_null() {
        return 0;
    }
    guarded(-1, || {
        live().retain(|&p| p != shm as usize);
        // SAFETY: the caller's contract: ours, from Box::into_raw, given back once.
        drop(unsafe { Box::from_raw(shm) });
        Ok(0)
    })
}

/// # Safety
/// `name` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn netram_shm_destroy(name: *const c_char) -> c_int {
    guarded(-1, || {
        Segment::unlink(&socket(), self::name(name)?)?;
        Ok(0)
    })
}
