//! A memory cgroup for the kernel's own paging, the baseline that netram is measured against
//! (the kernel's swap with as much local memory as netram's budget; Markatos §3 compares a
//! pager with the disk the same way): one small interface over both hierarchies.
//!
//! - **cgroup v1** (this machine, and older distributions): the `memory` controller's own
//!   mount; `memory.limit_in_bytes`, peak in `memory.max_usage_in_bytes`, OOM kills in
//!   `memory.oom_control`.
//! - **cgroup v2** (current distributions): the unified mount, where `memory` must be listed
//!   in `cgroup.controllers` and enabled for children in the parent's `cgroup.subtree_control`;
//!   `memory.max`, `memory.swap.max` (set to `max`: the group may swap as much as it likes),
//!   peak in `memory.peak` (kernel 5.19 and later), OOM kills in `memory.events`.
//!
//! [`Hierarchy::find`] picks whichever of the two carries the memory controller (a hybrid
//! machine mounts both, with the controller on one). Only the v1 side runs on the machine the
//! project is developed on, whose memory controller is bound to v1: the v2 side is tested
//! against a stand-in directory laid out as the kernel lays out cgroup2 (`tests` below).

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Which cgroup hierarchy carries the memory controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// Where memory cgroups are made.
#[derive(Debug, Clone)]
pub struct Hierarchy {
    root: PathBuf,
    version: Version,
}

impl Hierarchy {
    /// The hierarchy of this machine's memory controller, from `/proc/self/mounts`; or why
    /// there is none.
    pub fn find() -> Result<Self, String> {
        let mounts = std::fs::read_to_string("/proc/self/mounts")
            .map_err(|e| format!("cannot read /proc/self/mounts: {e}"))?;
        Self::find_in(&mounts)
    }

    /// As [`find`](Self::find), from the text of a mount table.
    pub fn find_in(mounts: &str) -> Result<Self, String> {
        let mut v1 = None;
        for line in mounts.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let [_, dir, fstype, opts, ..] = f[..] else {
                continue;
            };
            let dir = PathBuf::from(dir.replace("\\040", " "));
            match fstype {
                "cgroup2" => {
                    let controllers =
                        std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
                    if controllers.split_whitespace().any(|c| c == "memory") {
                        return Ok(Self::at(dir, Version::V2));
                    }
                }
                "cgroup" if opts.split(',').any(|o| o == "memory") => v1 = Some(dir),
                _ => {}
            }
        }
        v1.map(|d| Self::at(d, Version::V1)).ok_or_else(|| {
            "no memory cgroup controller mounted (neither cgroup2 with `memory` in \
             cgroup.controllers nor a cgroup-v1 `memory` hierarchy)"
                .to_string()
        })
    }

    /// The hierarchy mounted at `root` (a stand-in directory, in tests).
    pub fn at(root: impl Into<PathBuf>, version: Version) -> Self {
        Self {
            root: root.into(),
            version,
        }
    }

    pub fn version(&self) -> Version {
        self.version
    }

    /// Where groups are made.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A new group `name` under the root, limited to `limit` bytes of memory (`None`: no
    /// limit, for a run that is only measured), with swap allowed; removed on drop.
    pub fn create(&self, name: &str, limit: Option<u64>) -> std::io::Result<MemoryCgroup> {
        if self.version == Version::V2 {
            // Children get the memory controller only if their parent hands it down.
            let control = self.root.join("cgroup.subtree_control");
            let enabled = std::fs::read_to_string(&control).unwrap_or_default();
            if !enabled.split_whitespace().any(|c| c == "memory") {
                std::fs::write(&control, "+memory")?;
            }
        }
        let path = self.root.join(name);
        std::fs::create_dir(&path)?;
        let group = MemoryCgroup {
            path,
            version: self.version,
        };
        match self.version {
            Version::V1 => {
                if let Some(l) = limit {
                    // (Its OOM killer stays on: with it off, a program that reclaim cannot
                    // keep up with waits in the group's OOM state for good.)
                    group.write("memory.limit_in_bytes", &l.to_string())?;
                }
            }
            Version::V2 => {
                if let Some(l) = limit {
                    group.write("memory.max", &l.to_string())?;
                }
                group.write("memory.swap.max", "max")?;
            }
        }
        Ok(group)
    }
}

/// A memory cgroup that [`Hierarchy::create`] made; removed (once its processes have left)
/// on drop.
#[derive(Debug)]
pub struct MemoryCgroup {
    path: PathBuf,
    version: Version,
}

impl MemoryCgroup {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file a process's PID is written to, to move it into the group.
    pub fn procs(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    /// A shell command that moves the shell into the group and then runs `then` (`exec "$@"`,
    /// say): how a program is started inside it.
    pub fn enter_then(&self, then: &str) -> String {
        format!("echo $$ > '{}' && {then}", self.procs().display())
    }

    /// The most memory the group has used, in bytes.
    pub fn peak_bytes(&self) -> std::io::Result<u64> {
        let file = match self.version {
            Version::V1 => "memory.max_usage_in_bytes",
            Version::V2 => "memory.peak",
        };
        let text = std::fs::read_to_string(self.path.join(file))?;
        text.trim().parse().map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: {text:?}: {e}", self.path.join(file).display()),
            )
        })
    }

    /// How many processes the kernel's OOM killer ended in this group (0 if the kernel does
    /// not say).
    pub fn oom_kills(&self) -> u64 {
        let (file, key) = match self.version {
            Version::V1 => ("memory.oom_control", "oom_kill"),
            Version::V2 => ("memory.events", "oom_kill"),
        };
        std::fs::read_to_string(self.path.join(file))
            .unwrap_or_default()
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == key).then(|| v.trim().parse().ok()).flatten()
            })
            .unwrap_or(0)
    }

    fn write(&self, file: &str, value: &str) -> std::io::Result<()> {
        std::fs::write(self.path.join(file), value).map_err(|e| {
            std::io::Error::new(e.kind(), format!("{}: {e}", self.path.join(file).display()))
        })
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // The last process may take a moment to leave. (A stand-in directory holds the files
        // written into it: those go first; the kernel's cgroup files cannot be removed.)
        for _ in 0..200 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            if let Ok(entries) = std::fs::read_dir(&self.path) {
                for e in entries.flatten() {
                    let _ = std::fs::remove_file(e.path());
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!(
            "netram: could not remove the cgroup {}",
            self.path.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory laid out as the kernel lays out a cgroup2 root with the memory controller
    /// available but not yet handed down (as on a systemd machine's unified mount).
    fn cgroup2_stand_in() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "netram-cgroup2-{}-{}",
            std::process::id(),
            fastrand::u32(..)
        ));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("cgroup.controllers"), "cpuset cpu io memory pids\n").unwrap();
        std::fs::write(d.join("cgroup.subtree_control"), "cpu\n").unwrap();
        std::fs::write(d.join("cgroup.procs"), "1\n").unwrap();
        d
    }

    #[test]
    fn the_memory_controller_is_found_where_it_is_mounted() {
        let v2 = cgroup2_stand_in();
        // Hybrid (this machine): cgroup2 mounted without the memory controller, v1 with it.
        let hybrid = "cgroup2 /nonexistent/unified cgroup2 rw 0 0\n\
                      cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n\
                      cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n";
        let h = Hierarchy::find_in(hybrid).unwrap();
        assert_eq!(h.version(), Version::V1);
        assert_eq!(h.root, Path::new("/sys/fs/cgroup/memory"));
        // v2 only, as current distributions mount it.
        let unified = format!("cgroup2 {} cgroup2 rw,nsdelegate 0 0\n", v2.display());
        let h = Hierarchy::find_in(&unified).unwrap();
        assert_eq!(h.version(), Version::V2);
        assert_eq!(h.root, v2);
        // Neither.
        let none = "proc /proc proc rw 0 0\ncgroup2 /nonexistent cgroup2 rw 0 0\n";
        assert!(Hierarchy::find_in(none)
            .unwrap_err()
            .contains("no memory cgroup"));
        std::fs::remove_dir_all(&v2).unwrap();
    }

    #[test]
    fn a_v2_group_is_made_as_the_kernel_expects() {
        let root = cgroup2_stand_in();
        let h = Hierarchy::at(&root, Version::V2);
        let g = h.create("bench", Some(64 << 20)).unwrap();
        let read = |p: PathBuf| std::fs::read_to_string(p).unwrap();
        // The controller handed down to children, the limit and swap set in the child.
        assert_eq!(read(root.join("cgroup.subtree_control")), "+memory");
        assert_eq!(read(g.path().join("memory.max")), (64u64 << 20).to_string());
        assert_eq!(read(g.path().join("memory.swap.max")), "max");
        assert_eq!(g.procs(), root.join("bench/cgroup.procs"));
        assert!(g.enter_then("exec \"$@\"").starts_with("echo $$ > '"));
        // What the kernel reports, read from the v2 files.
        std::fs::write(g.path().join("memory.peak"), "123456789\n").unwrap();
        assert_eq!(g.peak_bytes().unwrap(), 123_456_789);
        std::fs::write(
            g.path().join("memory.events"),
            "low 0\nhigh 0\nmax 17\noom 2\noom_kill 2\noom_group_kill 0\n",
        )
        .unwrap();
        assert_eq!(g.oom_kills(), 2);
        // Already handed down: left as it is; a group without a limit gets none.
        std::fs::write(root.join("cgroup.subtree_control"), "cpu memory\n").unwrap();
        let free = h.create("free", None).unwrap();
        assert_eq!(read(root.join("cgroup.subtree_control")), "cpu memory\n");
        assert!(!free.path().join("memory.max").exists());
        let (gp, fp) = (g.path().to_owned(), free.path().to_owned());
        drop((g, free));
        assert!(
            !gp.exists() && !fp.exists(),
            "the groups are removed on drop"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_v1_group_reads_its_own_files() {
        let root = std::env::temp_dir().join(format!("netram-cgroup1-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let g = Hierarchy::at(&root, Version::V1)
            .create("bench", Some(1 << 30))
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(g.path().join("memory.limit_in_bytes")).unwrap(),
            (1u64 << 30).to_string()
        );
        std::fs::write(g.path().join("memory.max_usage_in_bytes"), "4096\n").unwrap();
        std::fs::write(
            g.path().join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
        )
        .unwrap();
        assert_eq!(g.peak_bytes().unwrap(), 4096);
        assert_eq!(g.oom_kills(), 3);
        drop(g);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
