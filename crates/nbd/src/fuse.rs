//! The device as one file through FUSE: the direct path where the kernel has no NBD client.
//!
//! Without an NBD driver (as on machines without `nbd.ko`), the usual detour to swap on an NBD
//! export is nbdfuse: kernel → FUSE → nbdfuse → NBD socket → `netram nbd` → pager. This module
//! cuts out the middle: the kernel's FUSE requests for the file `MOUNTPOINT/device` go straight
//! to the same [`Device`] the NBD server uses, so a loop device on that file is swap on cluster
//! memory with one hop fewer (the Anemone paper's block device, §2.1, reached through FUSE).
//!
//! What the loop device sends and what it becomes here: reads and writes → device reads and
//! writes; `fallocate(PUNCH_HOLE)` (a discard, e.g. the kernel freeing swap slots under
//! `swapon --discard`) → TRIM, which deletes the pages on their servers;
//! `fallocate(ZERO_RANGE)` → WRITE_ZEROES; `fsync` and `flush` → the pager's flush. The file is
//! opened with `FOPEN_DIRECT_IO`, so the kernel keeps no page cache of it: a swap device whose
//! writes first allocated page cache would ask for memory exactly when there is none.
//!
//! The FUSE protocol itself is the `fuser` crate's (a well-kept implementation, mounting
//! directly as root or through `fusermount3`); what is written here is only the file.
//!
//! Its requests are served by `fuser`'s threads themselves, not handed to the transmission
//! loop that serves NBD's connections (`crate::transmit`): tried on 2026-11-30 (each request a
//! job for the loop, answered from there), the kernel's swap through this file got slower,
//! `netram bench nbd --quick --swap-only --configs netram_fuse`, two alternating pairs on the
//! 2-vCPU VM: random read-modify-writes 80 and 88 us/op against 64 and 72, the quicksort 10.1
//! and 10.8 s against 8.9 and 9.1. The kernel sends this file few requests at once, so the
//! hand-off to another thread cost each one more than the concurrency gained.

use crate::device::{Device, MAX_REQUEST};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, KernelConfig,
    LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, WriteFlags,
};
use netram_pager::{Disk, Transport};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// The name of the device's file in the mount point.
pub const FILE_NAME: &str = "device";

const FILE_INO: INodeNo = INodeNo(2);
/// Attributes never change behind the kernel's back (the size is fixed), so they may be
/// cached for long.
const TTL: Duration = Duration::from_secs(3600);

// fallocate(2) modes, from linux/falloc.h.
const FALLOC_FL_KEEP_SIZE: i32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: i32 = 0x02;
const FALLOC_FL_ZERO_RANGE: i32 = 0x10;

/// Event-loop threads reading `/dev/fuse`, each on its own cloned descriptor. The device runs
/// one pager behind one lock, so more threads would not serve more at once; a second one lets
/// the next request be read while the first is served.
const THREADS: usize = 2;

/// One file, `device`, in an otherwise empty directory.
pub struct FuseFile<T: Transport, D: Disk> {
    device: Arc<Device<T, D>>,
    uid: u32,
    gid: u32,
    started: SystemTime,
}

impl<T: Transport, D: Disk> std::fmt::Debug for FuseFile<T, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FuseFile")
            .field("device", &self.device)
            .finish()
    }
}

impl<T: Transport, D: Disk> FuseFile<T, D> {
    pub fn new(device: Arc<Device<T, D>>) -> Self {
        Self {
            device,
            uid: rustix::process::geteuid().as_raw(),
            gid: rustix::process::getegid().as_raw(),
            started: SystemTime::now(),
        }
    }

    fn attr(&self, ino: INodeNo) -> Option<FileAttr> {
        let (kind, perm, nlink, size) = match ino {
            INodeNo::ROOT => (FileType::Directory, 0o755, 2, 0),
            FILE_INO => (FileType::RegularFile, 0o600, 1, self.device.size()),
            _ => return None,
        };
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind,
            perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            flags: 0,
            blksize: 4096,
        })
    }

    /// The length of the range that lies within the device (0 for a range beyond its end).
    fn clip(&self, offset: u64, len: u64) -> u64 {
        len.min(self.device.size().saturating_sub(offset))
    }
}

/// The errno for a failed device operation: the pager could not reach any backing.
fn io_error(what: &str, e: impl std::fmt::Display) -> Errno {
    tracing::error!("fuse {what}: {e}");
    Errno::EIO
}

impl<T, D> Filesystem for FuseFile<T, D>
where
    T: Transport + Send + 'static,
    D: Disk + Send + 'static,
{
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Large requests: the loop device sends up to its max_sectors at once. The kernel
        // lowers this to what it allows (FUSE_MAX_PAGES).
        let _ = config.set_max_write(MAX_REQUEST.min(1 << 20));
        let _ = config.set_max_readahead(0);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.attr(FILE_INO) {
            Some(attr) if parent == INodeNo::ROOT && name == FILE_NAME => {
                reply.entry(&TTL, &attr, fuser::Generation(0))
            }
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    #[allow(clippy::too_many_arguments)] // the trait's signature
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let Some(attr) = self.attr(ino) else {
            return reply.error(Errno::ENOENT);
        };
        // A device has a fixed size and fixed owners; a truncate to the size it has (some
        // tools do that) and time updates are harmless and accepted.
        if size.is_some_and(|s| s != attr.size) || mode.is_some() || uid.is_some() || gid.is_some()
        {
            return reply.error(Errno::EPERM);
        }
        reply.attr(&TTL, &attr)
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if ino != FILE_INO {
            return reply.error(Errno::EISDIR);
        }
        reply.opened(
            FileHandle(0),
            FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES,
        )
    }

    #[allow(clippy::too_many_arguments)] // the trait's signature
    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != FILE_INO {
            return reply.error(Errno::EISDIR);
        }
        // Past the end a file reads short, as any file does.
        let len = self.clip(offset, u64::from(size.min(MAX_REQUEST)));
        // Each event-loop thread keeps its read buffer: no allocation per request once it has
        // grown to the largest read (see ARCHITECTURE.md, "Safe under memory pressure").
        thread_local! {
            static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        BUF.with_borrow_mut(|buf| {
            match self.device.read_ranges_into(&[(offset, len as u32)], buf) {
                Ok(()) => reply.data(buf),
                Err(e) => reply.error(io_error("read", e)),
            }
        })
    }

    #[allow(clippy::too_many_arguments)] // the trait's signature
    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if ino != FILE_INO {
            return reply.error(Errno::EISDIR);
        }
        // A device does not grow: a write wholly beyond its end has no space, one that
        // crosses it is short.
        let len = self.clip(offset, data.len() as u64) as usize;
        if len == 0 && !data.is_empty() {
            return reply.error(Errno::ENOSPC);
        }
        // An O_SYNC or O_DSYNC descriptor is a FUA write.
        let sync_flags = rustix::fs::OFlags::SYNC | rustix::fs::OFlags::DSYNC;
        let sync = flags.0 & sync_flags.bits() as i32 != 0;
        match self.device.write(offset, &data[..len], sync) {
            Ok(()) => reply.written(len as u32),
            Err(e) => reply.error(io_error("write", e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2): what was written through this descriptor reaches its backing, so a tool
        // that writes and closes (dd, mkswap) finds an error here rather than never.
        match self.device.flush() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(io_error("flush", e)),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.device.flush() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(io_error("fsync", e)),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if ino != FILE_INO {
            return reply.error(Errno::EISDIR);
        }
        let end = offset.checked_add(length);
        let size = self.device.size();
        let result = match mode {
            // Allocation: every page of the device can always be written (the cluster spills
            // to disk when full), so there is nothing to reserve; growing is impossible.
            0 | FALLOC_FL_KEEP_SIZE if end.is_some_and(|e| e <= size) => Ok(()),
            0 => return reply.error(Errno::EFBIG),
            FALLOC_FL_KEEP_SIZE => Ok(()),
            m if m == FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE => {
                let len = self.clip(offset, length);
                self.device.trim(offset, len)
            }
            m if m & !FALLOC_FL_KEEP_SIZE == FALLOC_FL_ZERO_RANGE => {
                if end.is_none_or(|e| e > size) && mode & FALLOC_FL_KEEP_SIZE == 0 {
                    return reply.error(Errno::EFBIG);
                }
                let len = self.clip(offset, length);
                self.device.write_zeroes(offset, len, false)
            }
            _ => return reply.error(Errno::EOPNOTSUPP),
        };
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(io_error("fallocate", e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (INodeNo::ROOT, FileType::Directory, "."),
            (INodeNo::ROOT, FileType::Directory, ".."),
            (FILE_INO, FileType::RegularFile, FILE_NAME),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(*ino, (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok()
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let blocks = self.device.size() / 4096;
        reply.statfs(blocks, 0, 0, 2, 0, 4096, 255, 4096)
    }
}

/// A mounted device file, unmounted when dropped (if nothing holds it open).
#[derive(Debug)]
pub struct Mounted {
    session: Option<fuser::BackgroundSession>,
    mountpoint: PathBuf,
}

/// Mounts the device at `mountpoint` (an existing directory); the device is then the file
/// `mountpoint/device`. Mounts directly as root, through `fusermount3` otherwise.
pub fn mount<T, D>(device: Arc<Device<T, D>>, mountpoint: &Path) -> std::io::Result<Mounted>
where
    T: Transport + Send + 'static,
    D: Disk + Send + 'static,
{
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        MountOption::FSName("netram".into()),
        MountOption::Subtype("netram".into()),
        MountOption::DefaultPermissions,
        MountOption::NoSuid,
        MountOption::NoDev,
        MountOption::NoExec,
    ];
    config.n_threads = Some(THREADS);
    config.clone_fd = true;
    let session = fuser::spawn_mount(FuseFile::new(device), mountpoint, &config)?;
    Ok(Mounted {
        session: Some(session),
        mountpoint: mountpoint.to_path_buf(),
    })
}

impl Mounted {
    pub fn file(&self) -> PathBuf {
        self.mountpoint.join(FILE_NAME)
    }

    /// Whether the file system is still being served (someone may have unmounted it).
    pub fn is_serving(&self) -> bool {
        self.session
            .as_ref()
            .is_some_and(|s| !s.guard.is_finished())
    }

    /// Unmounts, unless something (a loop device, an open descriptor) still uses the file:
    /// then the file system stays mounted and served, and the error says so. Taking it away
    /// from a loop device that is swap would lose the swapped-out memory of every process.
    pub fn unmount(&mut self) -> std::io::Result<()> {
        if self.is_serving() {
            rustix::mount::unmount(&self.mountpoint, rustix::mount::UnmountFlags::empty())
                .map_err(std::io::Error::from)?;
        }
        if let Some(session) = self.session.take() {
            session.join()?;
        }
        Ok(())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            tracing::warn!("cannot unmount {}: {e}", self.mountpoint.display());
        }
    }
}
