//! The kernel's userfaultfd interface, as much of it as a region uses: the system call, the
//! API handshake, and the ioctls that register ranges and install, move, protect and wake pages.
//!
//! Written here rather than taken from the `userfaultfd` crate: that crate generates its
//! bindings with bindgen at build time, which needs libclang, and the build must need nothing
//! but the Rust toolchain. The ABI is small and stable; its structures and constants come from
//! `linux-raw-sys` (which rustix already brings in), the ioctl numbers are computed from them
//! by rustix, exactly as `_IOWR(UFFDIO, nr, struct …)` does in `linux/userfaultfd.h`.
//!
//! Every ioctl here changes only page-table entries (or the contents of pages not yet present)
//! of ranges registered with this descriptor; the kernel refuses any other range. The region's
//! bytes are reached only through raw pointers, so no Rust reference sees them change.

use linux_raw_sys::general as k;
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::io::Errno;
use rustix::ioctl::{opcode, Opcode, Updater};
use std::ffi::c_void;

/// One page, the unit of every operation here.
const PAGE: u64 = netram_proto::PAGE_SIZE as u64;

/// `_IOWR(UFFDIO, nr, T)`.
const fn op<T>(nr: u32) -> Opcode {
    opcode::read_write::<T>(k::UFFDIO as u8, nr as u8)
}

/// The `uffd_msg` the kernel hands `read(2)`: 32 bytes.
const MSG_LEN: usize = std::mem::size_of::<k::uffd_msg>();
const _: () = assert!(MSG_LEN == 32);

/// A userfaultfd descriptor, non-blocking and close-on-exec.
#[derive(Debug)]
pub struct Uffd(OwnedFd, bool);

/// Whether `fd` is readable within `wait` (at once if zero): a readiness check of one
/// descriptor, for the handler's spin, its upkeep's look for faults and a hand-over's wait for a
/// child's agent. A failed poll counts as not readable; the caller's next read says why.
pub fn readable_within(fd: impl AsFd, wait: std::time::Duration) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    let timeout = Timespec {
        tv_sec: wait.as_secs() as i64,
        tv_nsec: i64::from(wait.subsec_nanos()),
    };
    matches!(poll(&mut fds, Some(&timeout)), Ok(n) if n > 0)
}

/// `USERFAULTFD_IOC_NEW` (`_IO(0xAA, 0x00)` on `/dev/userfaultfd`): its argument is an
/// integer and its result a new descriptor, which rustix's ready-made ioctl types do not
/// return.
struct NewUffd(u32);

// SAFETY: the opcode is USERFAULTFD_IOC_NEW's; the argument is passed by value, and the
// result is the descriptor the kernel just opened, owned from here on.
unsafe impl rustix::ioctl::Ioctl for NewUffd {
    type Output = OwnedFd;
    const IS_MUTATING: bool = false;

    fn opcode(&self) -> Opcode {
        opcode::none(k::USERFAULTFD_IOC as u8, 0)
    }

    fn as_ptr(&mut self) -> *mut c_void {
        self.0 as usize as *mut c_void
    }

    unsafe fn output_from_ptr(
        out: rustix::ioctl::IoctlOutput,
        _: *mut c_void,
    ) -> rustix::io::Result<OwnedFd> {
        use std::os::fd::FromRawFd;
        // SAFETY: a non-negative result of USERFAULTFD_IOC_NEW is a new descriptor of ours.
        Ok(unsafe { OwnedFd::from_raw_fd(out) })
    }
}

/// An event read from the descriptor.
#[derive(Debug)]
pub enum Event {
    /// A thread faulted at `addr`: on a missing page, or (`wp`) on a write-protected one;
    /// `write` if the access was a write. `tid`: the faulting thread (with
    /// `UFFD_FEATURE_THREAD_ID`; 0 without).
    Pagefault {
        addr: usize,
        write: bool,
        wp: bool,
        tid: u32,
    },
    /// The process forked (with `UFFD_FEATURE_EVENT_FORK`): the child's copy of the registered
    /// ranges faults to this new descriptor, which the kernel has just opened in this process.
    Fork(Uffd),
    /// Anything else (remap, remove, unmap: not asked for).
    Other(u8),
}

impl AsFd for Uffd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

fn range(start: *mut c_void, len: usize) -> k::uffdio_range {
    k::uffdio_range {
        start: start as u64,
        len: len as u64,
    }
}

impl Uffd {
    /// Creates a userfaultfd and makes the API handshake asking for `features`
    /// (`UFFD_FEATURE_*`). `user_mode_only`: faults raised inside system calls are not
    /// delivered (what an ordinary user may ask for when `vm.unprivileged_userfaultfd` is 0).
    /// EINVAL from the handshake means a feature is unknown to this kernel.
    pub fn open(features: u64, user_mode_only: bool) -> Result<Uffd, Errno> {
        let mut flags =
            rustix::mm::UserfaultfdFlags::CLOEXEC | rustix::mm::UserfaultfdFlags::NONBLOCK;
        if user_mode_only {
            flags |= rustix::mm::UserfaultfdFlags::from_bits_retain(k::UFFD_USER_MODE_ONLY);
        }
        // SAFETY: userfaultfd(2) only creates a descriptor; the flags are the kernel's.
        let fd = unsafe { rustix::mm::userfaultfd(flags) }?;
        Self::handshake(fd, features, user_mode_only)
    }

    /// Creates a userfaultfd through `/dev/userfaultfd` (Linux 6.1) and makes the handshake:
    /// whoever may open the device gets one that serves faults raised inside system calls too,
    /// whatever `vm.unprivileged_userfaultfd` says (administrators grant it by group, as for
    /// `/dev/kvm`). `UFFD_FEATURE_EVENT_FORK` still needs `CAP_SYS_PTRACE`. Makes no
    /// allocation: a forked child calls it (see `Region::follow_in_child`).
    pub fn open_device(features: u64) -> Result<Uffd, Errno> {
        use rustix::fs::{Mode, OFlags};
        let dev = rustix::fs::open(
            c"/dev/userfaultfd",
            OFlags::RDWR | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let flags = (OFlags::CLOEXEC | OFlags::NONBLOCK).bits();
        // SAFETY: USERFAULTFD_IOC_NEW takes the new descriptor's flags by value and returns
        // the descriptor; it touches no memory of this process.
        let fd = unsafe { rustix::ioctl::ioctl(&dev, NewUffd(flags)) }?;
        Self::handshake(fd, features, false)
    }

    fn handshake(fd: OwnedFd, features: u64, user_mode_only: bool) -> Result<Uffd, Errno> {
        let mut api = k::uffdio_api {
            api: u64::from(k::UFFD_API),
            features,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads and writes exactly one struct uffdio_api.
        unsafe {
            rustix::ioctl::ioctl(
                &fd,
                Updater::<{ op::<k::uffdio_api>(k::_UFFDIO_API) }, _>::new(&mut api),
            )
        }?;
        Ok(Uffd(fd, user_mode_only))
    }

    /// Wraps a descriptor received from a forked child (see `Region::follow_in_child`).
    pub fn from_child(fd: OwnedFd) -> Uffd {
        Uffd(fd, false)
    }

    /// Another descriptor for the same userfaultfd (`dup`): it stays open, and its events
    /// readable, after this one is closed.
    pub fn try_clone(&self) -> std::io::Result<Uffd> {
        Ok(Uffd(self.0.try_clone()?, self.1))
    }

    /// Whether faults raised inside system calls go unserved (see [`Uffd::open`]).
    pub fn user_mode_only(&self) -> bool {
        self.1
    }

    /// Registers `len` bytes at `start` for missing-page faults and, if `wp`, write-protect
    /// faults.
    pub fn register(&self, start: *mut c_void, len: usize, wp: bool) -> Result<(), Errno> {
        let mut mode = u64::from(k::UFFDIO_REGISTER_MODE_MISSING);
        if wp {
            mode |= u64::from(k::UFFDIO_REGISTER_MODE_WP);
        }
        let mut reg = k::uffdio_register {
            range: range(start, len),
            mode,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes one struct uffdio_register; it changes no
        // memory, only how faults in the range are handled.
        unsafe {
            rustix::ioctl::ioctl(
                self,
                Updater::<{ op::<k::uffdio_register>(k::_UFFDIO_REGISTER) }, _>::new(&mut reg),
            )
        }
    }

    /// Undoes [`Uffd::register`] (also waking every thread blocked on a fault in the range).
    pub fn unregister(&self, start: *mut c_void, len: usize) -> Result<(), Errno> {
        let mut r = range(start, len);
        // SAFETY: UFFDIO_UNREGISTER reads one struct uffdio_range (declared _IOR; the kernel
        // does not write it back, so passing it as read-write only over-approximates).
        unsafe {
            rustix::ioctl::ioctl(
                self,
                Updater::<
                    {
                        opcode::read::<k::uffdio_range>(
                            k::UFFDIO as u8,
                            k::_UFFDIO_UNREGISTER as u8,
                        )
                    },
                    _,
                >::new(&mut r),
            )
        }
    }

    /// Wakes the threads blocked on faults in the range (they retry their access).
    pub fn wake(&self, start: *mut c_void, len: usize) -> Result<(), Errno> {
        let mut r = range(start, len);
        // SAFETY: UFFDIO_WAKE reads one struct uffdio_range and changes no memory.
        unsafe {
            rustix::ioctl::ioctl(
                self,
                Updater::<
                    { opcode::read::<k::uffdio_range>(k::UFFDIO as u8, k::_UFFDIO_WAKE as u8) },
                    _,
                >::new(&mut r),
            )
        }
    }

    /// Maps the shared zero page at `dst` (one page of a registered range) and wakes the
    /// faulting threads. EEXIST: a page is already there.
    pub fn zeropage(&self, dst: *mut c_void) -> Result<(), Errno> {
        let mut z = k::uffdio_zeropage {
            range: range(dst, PAGE as usize),
            mode: 0,
            zeropage: 0,
        };
        // SAFETY: UFFDIO_ZEROPAGE reads and writes one struct uffdio_zeropage; it fills only a
        // page that is not present, of a range registered here (module comment).
        unsafe {
            rustix::ioctl::ioctl(
                self,
                Updater::<{ op::<k::uffdio_zeropage>(k::_UFFDIO_ZEROPAGE) }, _>::new(&mut z),
            )
        }
    }

    /// Installs a copy of `page` at `dst` and wakes the faulting threads; write-protected if
    /// `protect`, in the same step (protecting it afterwards would let a write slip in unseen).
    /// EEXIST: a page is already there.
    pub fn copy(&self, page: &[u8], dst: *mut c_void, protect: bool) -> Result<(), Errno> {
        assert_eq!(page.len() as u64, PAGE);
        let mut c = k::uffdio_copy {
            dst: dst as u64,
            src: page.as_ptr() as u64,
            len: PAGE,
            mode: if protect {
                u64::from(k::UFFDIO_COPY_MODE_WP)
            } else {
                0
            },
            copy: 0,
        };
        // SAFETY: UFFDIO_COPY reads and writes one struct uffdio_copy; `src` is one readable
        // page (the slice), `dst` a page not present in a range registered here.
        unsafe {
            rustix::ioctl::ioctl(
                self,
                Updater::<{ op::<k::uffdio_copy>(k::_UFFDIO_COPY) }, _>::new(&mut c),
            )
        }
    }

    /// Poisons the (empty) page at `dst` and wakes the faulting threads: an access to it gets
    /// SIGBUS from now on. Needs `UFFD_FEATURE_POISON` (Linux 6.6). EEXIST: a page is there.
    pub fn poison(&self, dst: *mut c_void) -> Result<(), Errno> {
        let mut p = k::uffdio_poison {
            range: range(dst, PAGE as usize),
            mode: 0,
            updated: 0,
        };
        // SAFETY: UFFDIO_POISON reads and writes one struct uffdio_poison; it marks only an
        // empty page of a range registered here.
        unsafe {
            rustix::ioctl::ioctl(
                self,
                Updater::<{ op::<k::uffdio_poison>(k::_UFFDIO_POISON) }, _>::new(&mut p),
            )
        }
    }

    /// Moves the page at `src` to `dst` (page-table entries only, no copy) without waking
    /// anyone. Both are pages of ranges registered here; `dst` must be empty. Needs
    /// `UFFD_FEATURE_MOVE` (Linux 6.8).
    pub fn move_page(&self, src: *mut c_void, dst: *mut c_void) -> Result<(), Errno> {
        const UFFDIO_MOVE_MODE_DONTWAKE: u64 = 1 << 0;
        let mut m = k::uffdio_move {
            dst: dst as u64,
            src: src as u64,
            len: PAGE,
            mode: UFFDIO_MOVE_MODE_DONTWAKE,
            move_: 0,
        };
        // SAFETY: UFFDIO_MOVE reads and writes one struct uffdio_move. It changes only
        // page-table entries of this process's registered mappings, whose contents no Rust
        // value refers to while they move (module comment).
        unsafe {
            rustix::ioctl::ioctl(
                self,
                Updater::<{ op::<k::uffdio_move>(k::_UFFDIO_MOVE) }, _>::new(&mut m),
            )
        }
    }

    /// Write-protects one page at `addr`, or (`protect` false) lifts the protection and, if
    /// `wake`, wakes the writers blocked on it. (`wake` means nothing when protecting: the
    /// kernel refuses `MODE_WP` with `MODE_DONTWAKE`.)
    pub fn set_write_protect(
        &self,
        addr: *mut c_void,
        protect: bool,
        wake: bool,
    ) -> Result<(), Errno> {
        self.set_write_protect_range(addr, 1, protect, wake)
    }

    /// [`Uffd::set_write_protect`] over `pages` consecutive pages: one call, so one TLB flush
    /// for all of them (each flush interrupts every other CPU that runs the program).
    pub fn set_write_protect_range(
        &self,
        addr: *mut c_void,
        pages: usize,
        protect: bool,
        wake: bool,
    ) -> Result<(), Errno> {
        const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
        const UFFDIO_WRITEPROTECT_MODE_DONTWAKE: u64 = 1 << 1;
        let mut mode = 0;
        if protect {
            mode |= UFFDIO_WRITEPROTECT_MODE_WP;
        }
        if !wake && !protect {
            mode |= UFFDIO_WRITEPROTECT_MODE_DONTWAKE;
        }
        let mut w = k::uffdio_writeprotect {
            range: range(addr, pages * PAGE as usize),
            mode,
        };
        // SAFETY: UFFDIO_WRITEPROTECT reads one struct uffdio_writeprotect; it changes only
        // the protection of pages of a range registered here.
        unsafe {
            rustix::ioctl::ioctl(
                self,
                Updater::<{ op::<k::uffdio_writeprotect>(k::_UFFDIO_WRITEPROTECT) }, _>::new(
                    &mut w,
                ),
            )
        }
    }

    /// The next event, or `None` if none is waiting (the descriptor is non-blocking).
    pub fn read_event(&self) -> Result<Option<Event>, Errno> {
        let mut one = Vec::with_capacity(1);
        self.read_events(&mut one, 1)?;
        Ok(one.pop())
    }

    /// Up to `max` waiting events, appended to `out`, in one `read`; how many were read (0 if
    /// none was waiting: the descriptor is non-blocking).
    ///
    /// The kernel hands out as many whole messages as the buffer holds and stops at the first
    /// that is not already queued (`userfaultfd_read_iter` only blocks for the first), so fewer
    /// than `max` means none was left: the caller need not read again to find out, which would
    /// be a system call that fails with `EAGAIN` after every fault. A fork's message carries a
    /// descriptor the kernel opened while handing it out, so every message read is kept.
    /// Allocates nothing where `out` has room for `max` more (the watcher of `inbox.rs`).
    pub fn read_events(&self, out: &mut Vec<Event>, max: usize) -> Result<usize, Errno> {
        let mut buf = [0u8; MOST_EVENTS * MSG_LEN];
        let want = max.clamp(1, MOST_EVENTS) * MSG_LEN;
        let n = loop {
            match rustix::io::read(self, &mut buf[..want]) {
                Ok(n) => break n,
                Err(Errno::AGAIN) => return Ok(0),
                Err(Errno::INTR) => continue,
                Err(e) => return Err(e),
            }
        };
        // The kernel hands out whole messages only.
        if n % MSG_LEN != 0 {
            return Err(Errno::IO);
        }
        for msg in buf[..n].chunks_exact(MSG_LEN) {
            let msg: &[u8; MSG_LEN] = msg.try_into().expect("chunks of MSG_LEN");
            out.push(match parse(msg) {
                Parsed::Pagefault {
                    addr,
                    write,
                    wp,
                    tid,
                } => Event::Pagefault {
                    addr,
                    write,
                    wp,
                    tid,
                },
                Parsed::Other(e) => Event::Other(e),
                // SAFETY: the kernel opened this descriptor for us while handing out the
                // message (`resolve_userfault_fork`): it is ours alone, and taken once.
                Parsed::Fork(fd) => Event::Fork(Uffd(
                    unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) },
                    self.1,
                )),
            });
        }
        Ok(n / MSG_LEN)
    }
}

/// The most events [`Uffd::read_events`] reads at once.
pub(crate) const MOST_EVENTS: usize = 64;

/// A decoded message (see [`Event`]); a fork's descriptor still a number.
#[derive(Debug, PartialEq, Eq)]
enum Parsed {
    Pagefault {
        addr: usize,
        write: bool,
        wp: bool,
        tid: u32,
    },
    Fork(i32),
    Other(u8),
}

/// Decodes a `struct uffd_msg` (host byte order: the kernel's own ABI, not a wire format):
/// `event` at byte 0, for a page fault `flags` at 8, `address` at 16 and the thread id at 24;
/// for a fork the new descriptor at 8.
fn parse(msg: &[u8; MSG_LEN]) -> Parsed {
    let u64_at = |at: usize| u64::from_ne_bytes(msg[at..at + 8].try_into().expect("8 bytes"));
    match u32::from(msg[0]) {
        k::UFFD_EVENT_PAGEFAULT => {}
        k::UFFD_EVENT_FORK => {
            return Parsed::Fork(i32::from_ne_bytes(msg[8..12].try_into().expect("4 bytes")))
        }
        _ => return Parsed::Other(msg[0]),
    }
    let flags = u64_at(8);
    Parsed::Pagefault {
        addr: u64_at(16) as usize,
        write: flags & u64::from(k::UFFD_PAGEFAULT_FLAG_WRITE) != 0,
        wp: flags & u64::from(k::UFFD_PAGEFAULT_FLAG_WP) != 0,
        tid: u32::from_ne_bytes(msg[24..28].try_into().expect("4 bytes")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pagefault_message_decodes_as_the_kernel_lays_it_out() {
        let mut msg = [0u8; MSG_LEN];
        msg[0] = k::UFFD_EVENT_PAGEFAULT as u8;
        let flags = u64::from(k::UFFD_PAGEFAULT_FLAG_WRITE | k::UFFD_PAGEFAULT_FLAG_WP);
        msg[8..16].copy_from_slice(&flags.to_ne_bytes());
        msg[16..24].copy_from_slice(&0x7f00_1234_5000u64.to_ne_bytes());
        msg[24..28].copy_from_slice(&4242u32.to_ne_bytes());
        assert_eq!(
            parse(&msg),
            Parsed::Pagefault {
                addr: 0x7f00_1234_5000,
                write: true,
                wp: true,
                tid: 4242,
            }
        );
        msg[0] = k::UFFD_EVENT_FORK as u8;
        msg[8..12].copy_from_slice(&17i32.to_ne_bytes());
        assert_eq!(parse(&msg), Parsed::Fork(17));
        msg[0] = k::UFFD_EVENT_REMOVE as u8;
        assert_eq!(parse(&msg), Parsed::Other(k::UFFD_EVENT_REMOVE as u8));
    }

    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        // The values of linux/userfaultfd.h's _IOWR/_IOR macros on x86_64 (and every
        // architecture with the generic ioctl encoding).
        assert_eq!(op::<k::uffdio_api>(k::_UFFDIO_API), 0xc018_aa3f);
        assert_eq!(op::<k::uffdio_register>(k::_UFFDIO_REGISTER), 0xc020_aa00);
        assert_eq!(op::<k::uffdio_copy>(k::_UFFDIO_COPY), 0xc028_aa03);
        assert_eq!(op::<k::uffdio_zeropage>(k::_UFFDIO_ZEROPAGE), 0xc020_aa04);
        assert_eq!(
            op::<k::uffdio_writeprotect>(k::_UFFDIO_WRITEPROTECT),
            0xc018_aa06
        );
        assert_eq!(op::<k::uffdio_move>(k::_UFFDIO_MOVE), 0xc028_aa05);
        assert_eq!(
            opcode::read::<k::uffdio_range>(k::UFFDIO as u8, k::_UFFDIO_WAKE as u8),
            0x8010_aa02
        );
    }
}
