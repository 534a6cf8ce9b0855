//! The FUSE file system: the source's tree, read-only, its files' contents through [`Pages`].
//!
//! Files are opened with `FOPEN_DIRECT_IO`, so the kernel keeps no page cache of them: every
//! read comes here and is served from this machine's pages (or the source), and the memory a
//! data set takes on a machine is the budget, once. Pages read from the source are dropped
//! from the source's own page cache as soon as they are copied (`POSIX_FADV_DONTNEED`), for
//! the same reason. Attributes are cached by the kernel for a second only, since the source
//! may change; a file's contents are checked at every open (its key, [`FileKey`]).

use crate::pages::{Pages, PAGE};
use crate::tree::{FileKey, Tree, ROOT};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, KernelConfig,
    LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, Request,
};
use netram_policy::gms::Uid;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long the kernel may keep attributes and names: the source may change under us.
const TTL: Duration = Duration::from_secs(1);
/// The largest read the kernel sends at once (FUSE's default max_read is 128 KiB; direct I/O
/// splits larger reads).
const MAX_READ: u32 = 1 << 20;
/// Threads reading `/dev/fuse`: reads of different files proceed together while one waits on
/// the source.
const THREADS: usize = 4;

/// An open file: the source's descriptor, its key at opening, its size then.
#[derive(Debug)]
struct Open {
    file: File,
    key: FileKey,
    size: u64,
}

/// The file system.
#[derive(Debug)]
pub struct CacheFs {
    tree: Arc<Tree>,
    pages: Arc<Pages>,
    open: Mutex<(u64, HashMap<u64, Arc<Open>>)>,
    /// The key each file had when last opened: a different one means it changed.
    keys: Mutex<HashMap<u64, FileKey>>,
}

fn kind(m: &std::fs::Metadata) -> FileType {
    let t = m.file_type();
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        FileType::Directory
    } else if t.is_symlink() {
        FileType::Symlink
    } else if t.is_fifo() {
        FileType::NamedPipe
    } else if t.is_socket() {
        FileType::Socket
    } else if t.is_char_device() {
        FileType::CharDevice
    } else if t.is_block_device() {
        FileType::BlockDevice
    } else {
        FileType::RegularFile
    }
}

fn time(secs: i64, nsecs: i64) -> SystemTime {
    if secs >= 0 {
        UNIX_EPOCH + Duration::new(secs as u64, nsecs.clamp(0, 999_999_999) as u32)
    } else {
        UNIX_EPOCH
    }
}

fn attr(ino: u64, m: &std::fs::Metadata) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size: m.size(),
        blocks: m.blocks(),
        atime: time(m.atime(), m.atime_nsec()),
        mtime: time(m.mtime(), m.mtime_nsec()),
        ctime: time(m.ctime(), m.ctime_nsec()),
        crtime: time(m.ctime(), m.ctime_nsec()),
        kind: kind(m),
        // Read-only whatever the source allows.
        perm: (m.mode() & 0o7555) as u16,
        nlink: m.nlink() as u32,
        uid: m.uid(),
        gid: m.gid(),
        rdev: m.rdev() as u32,
        flags: 0,
        blksize: PAGE as u32,
    }
}

impl CacheFs {
    pub fn new(tree: Arc<Tree>, pages: Arc<Pages>) -> Self {
        Self {
            tree,
            pages,
            open: Mutex::new((1, HashMap::new())),
            keys: Mutex::new(HashMap::new()),
        }
    }

    fn handle(&self, fh: FileHandle) -> Option<Arc<Open>> {
        let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.1.get(&fh.0).cloned()
    }

    /// Reads `len` bytes at `offset` of an open file through the pages.
    fn read_range(
        &self,
        f: &Open,
        offset: u64,
        len: u64,
        out: &mut Vec<u8>,
    ) -> std::io::Result<()> {
        let end = (offset + len).min(f.size);
        if offset >= end {
            return Ok(());
        }
        let first = offset / PAGE as u64;
        let pages: Vec<(Uid, usize, usize)> = (first..=(end - 1) / PAGE as u64)
            .map(|index| {
                let start = index * PAGE as u64;
                let from = offset.saturating_sub(start) as usize;
                let to = ((end - start) as usize).min(PAGE);
                (f.key.page(index), from, to)
            })
            .collect();
        self.pages.read_pages(&pages, out, |i, buf| {
            // Pages `first + i ..` from the source, as far as the file goes.
            let start = (first + i as u64) * PAGE as u64;
            let want = (f.size - start).min(buf.len() as u64) as usize;
            let mut got = 0;
            while got < want {
                match f.file.read_at(&mut buf[got..want], start + got as u64)? {
                    0 => break,
                    n => got += n,
                }
            }
            // The source's page cache need not keep what is now held here.
            let _ = rustix::fs::fadvise(
                &f.file,
                start,
                std::num::NonZeroU64::new(buf.len() as u64),
                rustix::fs::Advice::DontNeed,
            );
            Ok(got)
        })
    }
}

fn errno(e: std::io::Error) -> Errno {
    Errno::from(e)
}

impl Filesystem for CacheFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_readahead(0);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let Some((ino, path)) = self.tree.child(parent.0, name) else {
            return reply.error(Errno::ENOENT);
        };
        match std::fs::symlink_metadata(path) {
            Ok(m) => reply.entry(&TTL, &attr(ino, &m), fuser::Generation(0)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.tree.metadata(ino.0) {
            Ok(m) => reply.attr(&TTL, &attr(ino.0, &m)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let Some(path) = self.tree.path(ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        match std::fs::read_link(path) {
            Ok(target) => reply.data(target.as_os_str().as_encoded_bytes()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let access = flags.0 & rustix::fs::OFlags::ACCMODE.bits() as i32;
        if access != rustix::fs::OFlags::RDONLY.bits() as i32 {
            return reply.error(Errno::EROFS);
        }
        let Some(path) = self.tree.path(ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) => return reply.error(errno(e)),
        };
        let m = match file.metadata() {
            Ok(m) if m.is_file() => m,
            Ok(_) => return reply.error(Errno::EISDIR),
            Err(e) => return reply.error(errno(e)),
        };
        let Some(key) = self.tree.key(ino.0, &m) else {
            return reply.error(Errno::ENOENT);
        };
        {
            let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
            if keys.insert(ino.0, key).is_some_and(|old| old != key) {
                self.pages
                    .counters
                    .files_changed
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let fh = open.0;
        open.0 += 1;
        open.1.insert(
            fh,
            Arc::new(Open {
                file,
                key,
                size: m.size(),
            }),
        );
        reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO)
    }

    #[allow(clippy::too_many_arguments)] // the trait's signature
    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(f) = self.handle(fh) else {
            return reply.error(Errno::EBADF);
        };
        let mut out = Vec::with_capacity(size.min(MAX_READ) as usize);
        match self.read_range(&f, offset, u64::from(size.min(MAX_READ)), &mut out) {
            Ok(()) => reply.data(&out),
            Err(e) => {
                tracing::warn!("read of {:?}: {e}", self.tree.relative(ino.0));
                reply.error(Errno::EIO)
            }
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.1.remove(&fh.0);
        reply.ok()
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let entries = match self.tree.list(ino.0) {
            Ok(e) => e,
            Err(e) => return reply.error(errno(e)),
        };
        let dots = [
            (ino.0, FileType::Directory, OsStr::new(".")),
            (ROOT, FileType::Directory, OsStr::new("..")),
        ];
        let all = dots
            .into_iter()
            .chain(entries.iter().map(|(n, i, m)| (*i, kind(m), n.as_os_str())));
        for (k, (i, t, name)) in all.enumerate().skip(offset as usize) {
            if reply.add(INodeNo(i), (k + 1) as u64, t, name) {
                break;
            }
        }
        reply.ok()
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match rustix::fs::statvfs(self.tree.root()) {
            Ok(s) => reply.statfs(
                s.f_blocks,
                s.f_bfree,
                s.f_bavail,
                s.f_files,
                s.f_ffree,
                s.f_bsize as u32,
                s.f_namemax as u32,
                s.f_frsize as u32,
            ),
            Err(e) => reply.error(errno(e.into())),
        }
    }
}

/// A mounted mirror, unmounted when dropped.
#[derive(Debug)]
pub struct Mounted {
    session: Option<fuser::BackgroundSession>,
    mountpoint: PathBuf,
}

/// Mounts the mirror of `tree` at `mountpoint` (an existing directory), read-only. Mounts
/// directly as root, through `fusermount3` otherwise. `allow_other`: every user may read it
/// (with the source's permissions, checked by the kernel), not only the one who mounted it.
pub fn mount(
    tree: Arc<Tree>,
    pages: Arc<Pages>,
    mountpoint: &Path,
    allow_other: bool,
) -> std::io::Result<Mounted> {
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        MountOption::FSName("netram-cache".into()),
        MountOption::Subtype("netram".into()),
        MountOption::RO,
        MountOption::DefaultPermissions,
        MountOption::NoSuid,
        MountOption::NoDev,
    ];
    if allow_other {
        config.acl = fuser::SessionACL::All;
    }
    config.n_threads = Some(THREADS);
    config.clone_fd = true;
    let session = fuser::spawn_mount(CacheFs::new(tree, pages), mountpoint, &config)?;
    Ok(Mounted {
        session: Some(session),
        mountpoint: mountpoint.to_path_buf(),
    })
}

impl Mounted {
    /// Whether the file system is still being served (someone may have unmounted it).
    pub fn is_serving(&self) -> bool {
        self.session
            .as_ref()
            .is_some_and(|s| !s.guard.is_finished())
    }

    /// Unmounts; fails (and stays mounted) while something uses it.
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
