//! The source directory as inodes: every name the file system has handed the kernel gets an
//! inode number for as long as the mount lives, mapped to its path below the source.
//!
//! Nothing is followed out of the source: entries are examined without following symbolic
//! links, and a link is shown as a link (the kernel resolves it where the reader is, with the
//! reader's permissions), never read through here.

use netram_policy::gms::Uid;
use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The root's inode number (FUSE's).
pub const ROOT: u64 = 1;

/// A file's identity at its source: a change of any of these is a new file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileKey(pub u64);

impl FileKey {
    pub fn of(source: u64, m: &std::fs::Metadata) -> Self {
        let mut h = source ^ 0x6e65_7472_616d_6361;
        for v in [
            m.dev(),
            m.ino(),
            m.size(),
            m.mtime() as u64,
            m.mtime_nsec() as u64,
        ] {
            h = mix(h ^ v);
        }
        Self(h)
    }

    /// The uid of page `index` of this file.
    pub fn page(self, index: u64) -> Uid {
        Uid((u128::from(self.0) << 64) | u128::from(index))
    }
}

/// splitmix64's finaliser: the same keys on every machine (no per-process random hasher).
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[derive(Debug, Default)]
struct Inodes {
    paths: Vec<PathBuf>,
    by_path: HashMap<PathBuf, u64>,
}

/// The source tree and the inode numbers handed out.
#[derive(Debug)]
pub struct Tree {
    root: PathBuf,
    /// The source's identity, mixed into every file key: the same file seen through two
    /// sources is two files.
    source_id: u64,
    inodes: Mutex<Inodes>,
}

impl Tree {
    pub fn new(root: &Path) -> std::io::Result<Self> {
        let root = root.canonicalize()?;
        let m = std::fs::metadata(&root)?;
        if !m.is_dir() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotADirectory,
                format!("{} is not a directory", root.display()),
            ));
        }
        let mut id = 0u64;
        for b in root.as_os_str().as_encoded_bytes() {
            id = mix(id ^ u64::from(*b));
        }
        let inodes = Inodes {
            // Inode 0 is unused, 1 is the root.
            paths: vec![PathBuf::new(), PathBuf::new()],
            by_path: HashMap::from([(PathBuf::new(), ROOT)]),
        };
        Ok(Self {
            root,
            source_id: mix(id ^ m.dev() ^ m.ino()),
            inodes: Mutex::new(inodes),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn source_id(&self) -> u64 {
        self.source_id
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inodes> {
        self.inodes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The path below the source of inode `ino`.
    pub fn relative(&self, ino: u64) -> Option<PathBuf> {
        self.lock()
            .paths
            .get(ino as usize)
            .filter(|_| ino >= ROOT)
            .cloned()
    }

    /// The full path of inode `ino` at the source.
    pub fn path(&self, ino: u64) -> Option<PathBuf> {
        self.relative(ino).map(|r| self.root.join(r))
    }

    /// The inode of `name` in directory `parent`, handed out on first sight. Names that
    /// would leave the directory (`..`, anything with a slash) are not entries.
    pub fn child(&self, parent: u64, name: &OsStr) -> Option<(u64, PathBuf)> {
        if name == "." || name == ".." || name.as_encoded_bytes().contains(&b'/') {
            return None;
        }
        let rel = self.relative(parent)?.join(name);
        let mut i = self.lock();
        let ino = match i.by_path.get(&rel) {
            Some(&ino) => ino,
            None => {
                let ino = i.paths.len() as u64;
                i.paths.push(rel.clone());
                i.by_path.insert(rel.clone(), ino);
                ino
            }
        };
        Some((ino, self.root.join(rel)))
    }

    /// The entries of directory `ino`, sorted by name, as (name, inode, metadata).
    pub fn list(&self, ino: u64) -> std::io::Result<Vec<(OsString, u64, std::fs::Metadata)>> {
        let dir = self
            .path(ino)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))?;
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            let name = e.file_name();
            let Ok(meta) = e.metadata() else { continue };
            if let Some((child, _)) = self.child(ino, &name) {
                out.push((name, child, meta));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Metadata of inode `ino`, without following a link.
    pub fn metadata(&self, ino: u64) -> std::io::Result<std::fs::Metadata> {
        let p = self
            .path(ino)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))?;
        std::fs::symlink_metadata(p)
    }
}
