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
    /// A file of a source known to this machine only: its device and inode number name it
    /// (they mean nothing on another machine: a network mount's device number is local, and
    /// sshfs makes its inode numbers up).
    pub fn of(source: u64, m: &std::fs::Metadata) -> Self {
        Self::mixed(
            source ^ 0x6e65_7472_616d_6361,
            [
                m.dev(),
                m.ino(),
                m.size(),
                m.mtime() as u64,
                m.mtime_nsec() as u64,
            ],
        )
    }

    /// A file of a named source, the same on every machine that mirrors it under that name:
    /// its path below the source, its size and its modification time name it.
    pub fn portable(source: u64, relative: &Path, m: &std::fs::Metadata) -> Self {
        let path = hash_bytes(
            source ^ 0x7368_6172_6564_2f70,
            relative.as_os_str().as_encoded_bytes(),
        );
        Self::mixed(path, [m.size(), m.mtime() as u64, m.mtime_nsec() as u64])
    }

    fn mixed<const N: usize>(seed: u64, values: [u64; N]) -> Self {
        Self(values.into_iter().fold(seed, |h, v| mix(h ^ v)))
    }

    /// The uid of page `index` of this file.
    pub fn page(self, index: u64) -> Uid {
        Uid((u128::from(self.0) << 64) | u128::from(index))
    }
}

/// Bytes folded into a hash, eight at a time (the same on every machine).
fn hash_bytes(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = mix(seed ^ bytes.len() as u64);
    for chunk in bytes.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h = mix(h ^ u64::from_le_bytes(w));
    }
    h
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
    /// Named by the user (`--source-name`): file keys are the same on every machine that
    /// mirrors the source under that name.
    named: bool,
    inodes: Mutex<Inodes>,
}

impl Tree {
    /// A source known to this machine only: its pages are its own (no other machine's page
    /// has the same uid).
    pub fn new(root: &Path) -> std::io::Result<Self> {
        Self::open(root, None)
    }

    /// A source that several machines mirror under the same `name` (the same files, by path,
    /// size and modification time): a file page has the same uid on all of them, so the
    /// cluster can tell when several hold it (shared pages, GMS §4.4).
    pub fn named(root: &Path, name: &str) -> std::io::Result<Self> {
        Self::open(root, Some(name))
    }

    fn open(root: &Path, name: Option<&str>) -> std::io::Result<Self> {
        let root = root.canonicalize()?;
        let m = std::fs::metadata(&root)?;
        if !m.is_dir() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotADirectory,
                format!("{} is not a directory", root.display()),
            ));
        }
        let source_id = match name {
            Some(n) => hash_bytes(0x6e61_6d65_6420_7372, n.as_bytes()),
            None => mix(hash_bytes(0, root.as_os_str().as_encoded_bytes()) ^ m.dev() ^ m.ino()),
        };
        let inodes = Inodes {
            // Inode 0 is unused, 1 is the root.
            paths: vec![PathBuf::new(), PathBuf::new()],
            by_path: HashMap::from([(PathBuf::new(), ROOT)]),
        };
        Ok(Self {
            root,
            source_id,
            named: name.is_some(),
            inodes: Mutex::new(inodes),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn source_id(&self) -> u64 {
        self.source_id
    }

    /// Whether the source is named: its pages' uids are the same on other machines.
    pub fn is_named(&self) -> bool {
        self.named
    }

    /// The key of inode `ino`'s file as it is now (`m`, its metadata).
    pub fn key(&self, ino: u64, m: &std::fs::Metadata) -> Option<FileKey> {
        if self.named {
            Some(FileKey::portable(self.source_id, &self.relative(ino)?, m))
        } else {
            Some(FileKey::of(self.source_id, m))
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Two machines mirroring the same files under one name give their pages the same uids;
    /// without a name, or under another, or once a file changes, they differ.
    #[test]
    fn a_named_source_gives_the_same_keys_on_every_machine() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let mtime = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::new(1_700_000_000, 5);
        for d in [a.path(), b.path()] {
            std::fs::create_dir(d.join("sub")).unwrap();
            let f = std::fs::File::create(d.join("sub/data")).unwrap();
            f.set_len(10_000).unwrap();
            f.set_modified(mtime).unwrap();
        }
        let key = |t: &Tree| {
            let (ino, path) = t.child(ROOT, OsStr::new("sub")).unwrap();
            let (file, _) = t.child(ino, OsStr::new("data")).unwrap();
            let m = std::fs::metadata(path.join("data")).unwrap();
            t.key(file, &m).unwrap()
        };
        let (na, nb) = (
            Tree::named(a.path(), "models").unwrap(),
            Tree::named(b.path(), "models").unwrap(),
        );
        assert!(na.is_named());
        assert_eq!(key(&na), key(&nb));
        assert_eq!(key(&na).page(3), key(&nb).page(3));
        assert_ne!(key(&na), key(&Tree::named(b.path(), "other").unwrap()));
        let (la, lb) = (Tree::new(a.path()).unwrap(), Tree::new(b.path()).unwrap());
        assert!(!la.is_named());
        assert_ne!(key(&la), key(&lb));
        let f = std::fs::File::options()
            .write(true)
            .open(b.path().join("sub/data"))
            .unwrap();
        f.set_modified(mtime + std::time::Duration::from_nanos(1))
            .unwrap();
        assert_ne!(key(&na), key(&nb));
    }
}
