//! The local spill file behind [`netram_pager::Disk`]: where pages go when the whole cluster is
//! full, and the store of the `disk` and `cluster+disk` backings (Markatos, paper 003).
//!
//! Page `n` lives at offset `n × 4096` of a sparse file, so no allocation map is needed and a
//! discarded page gives its blocks back with a hole punch. The file is unlinked as soon as it is
//! opened: it disappears with the process, however the process ends.
//!
//! It uses `O_DIRECT` where the file system allows it: spilled pages are pages the machine had
//! no memory for, so keeping them in the page cache would defeat the purpose (and would make the
//! `disk` baseline look like RAM). `O_DIRECT` needs an aligned buffer, hence the bounce page.

use netram_pager::Disk;
use netram_proto::PAGE_SIZE;
use rustix::fs::{FallocateFlags, OFlags};
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

#[derive(Debug)]
pub struct FileDisk {
    file: File,
    direct: bool,
    /// Two pages, so that one page-aligned window always fits inside.
    bounce: Vec<u8>,
    align: usize,
}

impl FileDisk {
    /// Creates an anonymous spill file in `dir`.
    pub fn create_in(dir: &Path) -> io::Result<Self> {
        let path = dir.join(format!(
            ".netram-spill-{}-{:016x}",
            std::process::id(),
            fastrand::u64(..)
        ));
        let open = |flags: OFlags| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .custom_flags(flags.bits() as i32)
                .open(&path)
        };
        let (file, direct) = match open(OFlags::DIRECT) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
                tracing::warn!(
                    "{} does not support O_DIRECT; spilled pages will use the page cache",
                    dir.display()
                );
                (open(OFlags::empty())?, false)
            }
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("cannot create a spill file in {}: {e}", dir.display()),
                ))
            }
        };
        std::fs::remove_file(&path)?;
        let bounce = vec![0u8; 2 * PAGE_SIZE];
        let align = bounce.as_ptr().align_offset(PAGE_SIZE);
        Ok(Self {
            file,
            direct,
            bounce,
            align,
        })
    }

    /// Whether the file bypasses the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    fn window(&mut self) -> &mut [u8] {
        &mut self.bounce[self.align..self.align + PAGE_SIZE]
    }
}

fn offset(page: u64) -> u64 {
    page * PAGE_SIZE as u64
}

impl Disk for FileDisk {
    fn write(&mut self, page: u64, data: &[u8]) -> io::Result<()> {
        if self.direct {
            self.window().copy_from_slice(data);
            let w = &self.bounce[self.align..self.align + PAGE_SIZE];
            self.file.write_all_at(w, offset(page))
        } else {
            self.file.write_all_at(data, offset(page))
        }
    }

    fn read(&mut self, page: u64, out: &mut [u8]) -> io::Result<()> {
        if self.direct {
            let (file, at) = (&self.file, offset(page));
            let w = &mut self.bounce[self.align..self.align + PAGE_SIZE];
            file.read_exact_at(w, at)?;
            out.copy_from_slice(w);
            Ok(())
        } else {
            self.file.read_exact_at(out, offset(page))
        }
    }

    fn discard(&mut self, page: u64) -> io::Result<()> {
        let flags = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
        rustix::fs::fallocate(&self.file, flags, offset(page), PAGE_SIZE as u64)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_round_trip_and_the_file_is_gone_from_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = FileDisk::create_in(dir.path()).unwrap();
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "unlinked at once"
        );
        let a = vec![0xabu8; PAGE_SIZE];
        let b = vec![0x12u8; PAGE_SIZE];
        d.write(7, &a).unwrap();
        d.write(1_000_000, &b).unwrap();
        let mut out = vec![0u8; PAGE_SIZE];
        d.read(7, &mut out).unwrap();
        assert_eq!(out, a);
        d.read(1_000_000, &mut out).unwrap();
        assert_eq!(out, b);
        d.discard(7).unwrap();
        d.read(7, &mut out).unwrap();
        assert_eq!(out, vec![0u8; PAGE_SIZE], "a punched hole reads as zeros");
    }
}
