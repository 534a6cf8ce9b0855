//! Segments shared between machines for C (MIRAGE+; `netram.h`'s `netram_shm_*`): a thin
//! layer over `netram_shm::Segment`, through the local daemon's shared-memory socket (beside
//! its control socket: `NETRAM_DAEMON`, or the default daemon's).

use crate::{guarded, opt_str, CapiError};
use ::netram_shm::{Segment, SegmentError};
use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;

/// A segment attached to this process.
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct netram_shm {
    segment: Segment,
}

/// A new handle; its forked children keep it coherent (`follow_forks`).
fn keep(segment: Segment) -> *mut netram_shm {
    ::netram_shm::local::follow_forks();
    Box::into_raw(Box::new(netram_shm { segment }))
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
