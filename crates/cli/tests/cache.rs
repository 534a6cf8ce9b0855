//! `netram cache` on a real directory (issue 39): every file read through the mount is the
//! source's, byte for byte, whole and at random offsets, by this test and by tools nobody here
//! wrote (sha256sum, cmp, sort); nothing can be written; a file changed at the source reads
//! as changed at its next open; neither the mount nor the source keeps the pages in the
//! kernel's page cache; the process stops on SIGTERM, unmounting and reporting its counters.
//! With `--cluster`, the pages it drops go to other daemons by the GMS epoch's plan and come
//! back from there, verified, and a daemon killed mid-run loses no data.

mod common;

use common::NETRAM;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The cache process, its stdout lines, and its mount, detached if the test fails.
struct Cache {
    child: Child,
    lines: mpsc::Receiver<String>,
    mount: PathBuf,
}

impl Cache {
    fn start(source: &Path, mount: &Path, local_mem: &str) -> Self {
        Self::start_with(Command::new(NETRAM), source, mount, local_mem, &[])
    }

    fn start_with(
        mut cmd: Command,
        source: &Path,
        mount: &Path,
        local_mem: &str,
        more: &[&str],
    ) -> Self {
        let mut child = cmd
            .args(["cache", "--source"])
            .arg(source)
            .arg("--mount")
            .arg(mount)
            .args(["--local-mem", local_mem])
            .args(more)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start netram cache");
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let first = lines
            .recv_timeout(Duration::from_secs(20))
            .expect("netram cache reports its mount");
        assert!(first.starts_with("netram cache: "), "{first}");
        Self {
            child,
            lines,
            mount: mount.to_path_buf(),
        }
    }

    /// SIGTERM, then the last line it printed (its counters).
    fn stop(mut self) -> String {
        // SAFETY: kill(2) on the PID of a child not yet reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "netram cache exited with {status}");
                break;
            }
            assert!(Instant::now() < deadline, "netram cache did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
        let last = self
            .lines
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_default();
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
        assert!(
            !mounts.contains(self.mount.to_str().unwrap()),
            "still mounted"
        );
        std::mem::forget(self);
        last
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
    }
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..n).map(|_| rng.u8(..)).collect()
}

/// Pages of `path` in the kernel's page cache, by fincore(1).
fn cached_pages(path: &Path) -> u64 {
    let out = Command::new("fincore")
        .args(["--bytes", "--noheadings", "--output", "RES"])
        .arg(path)
        .output()
        .expect("fincore");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse::<u64>()
        .unwrap_or_else(|_| panic!("fincore said {:?}", String::from_utf8_lossy(&out.stdout)))
        / 4096
}

fn drop_page_cache(path: &Path) {
    let f = std::fs::File::open(path).unwrap();
    f.sync_all().unwrap();
    rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
}

#[test]
fn a_directory_reads_through_the_mount_byte_for_byte() {
    if !netram_testkit::have_root("mounting FUSE") {
        return;
    }
    if !Path::new("/dev/fuse").exists() {
        netram_testkit::skip("no /dev/fuse (the kernel has no FUSE)", None);
        return;
    }
    if !netram_testkit::have_tools(&[("fincore", "util-linux"), ("sha256sum", "coreutils")]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir_all(src.join("sub/deeper")).unwrap();
    std::fs::create_dir(&mnt).unwrap();
    let sizes = [0usize, 1, 4095, 4096, 4097, 3 * 1024 * 1024 + 123];
    for (i, &n) in sizes.iter().enumerate() {
        std::fs::write(src.join(format!("f{i}")), random_bytes(n, i as u64)).unwrap();
    }
    std::fs::write(src.join("sub/deeper/data.bin"), random_bytes(100_000, 77)).unwrap();
    let text: String = (0..20_000)
        .map(|i| format!("line {}\n", (i * 7919) % 20_000))
        .collect();
    std::fs::write(src.join("sub/words.txt"), &text).unwrap();
    std::os::unix::fs::symlink("deeper/data.bin", src.join("sub/link")).unwrap();
    for e in walk(&src) {
        drop_page_cache(&e);
    }

    // 1 MiB of pages for 3+ MiB of files: the cache must drop pages and read them again.
    let cache = Cache::start(&src, &mnt, "1M");
    for e in walk(&src) {
        let rel = e.strip_prefix(&src).unwrap();
        let through = std::fs::read(mnt.join(rel)).unwrap();
        assert!(through == std::fs::read(&e).unwrap(), "{rel:?} differs");
    }
    let names: Vec<String> = std::fs::read_dir(mnt.join("sub"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");
    assert_eq!(
        std::fs::read_link(mnt.join("sub/link")).unwrap(),
        Path::new("deeper/data.bin")
    );
    // Random reads of the large file.
    let big_src = std::fs::File::open(src.join("f5")).unwrap();
    let big = std::fs::File::open(mnt.join("f5")).unwrap();
    let mut rng = fastrand::Rng::with_seed(5);
    for _ in 0..300 {
        let off = rng.u64(0..3 * 1024 * 1024 + 200);
        let len = rng.usize(1..70_000);
        let (mut a, mut b) = (vec![0u8; len], vec![0u8; len]);
        let na = big.read_at(&mut a, off).unwrap();
        let nb = big_src.read_at(&mut b, off).unwrap();
        assert_eq!((na, &a[..na]), (nb, &b[..nb]), "at {off}+{len}");
    }
    // Tools nobody here wrote.
    let sha = |p: &Path| {
        let o = Command::new("sha256sum").arg(p).output().unwrap();
        String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .next()
            .unwrap()
            .to_string()
    };
    assert_eq!(sha(&mnt.join("f5")), sha(&src.join("f5")));
    assert!(Command::new("cmp")
        .arg(mnt.join("sub/deeper/data.bin"))
        .arg(src.join("sub/deeper/data.bin"))
        .status()
        .unwrap()
        .success());
    let sorted = |p: &Path| Command::new("sort").arg(p).output().unwrap().stdout;
    assert_eq!(
        sorted(&mnt.join("sub/words.txt")),
        sorted(&src.join("sub/words.txt"))
    );
    // Read-only.
    let e = std::fs::OpenOptions::new()
        .write(true)
        .open(mnt.join("f1"))
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    assert!(std::fs::write(mnt.join("new"), b"x").is_err());
    // One copy: the mount's files are not in the page cache, nor are the source's pages
    // this file system read (the test's own reads of the source above were dropped again).
    assert_eq!(
        cached_pages(&mnt.join("f5")),
        0,
        "the mount's pages in the page cache"
    );
    drop_page_cache(&src.join("f4"));
    std::fs::read(mnt.join("f4")).unwrap();
    assert_eq!(
        cached_pages(&src.join("f4")),
        0,
        "the source's pages in the page cache"
    );
    // A file changed at its source reads as changed at its next open (attributes are cached
    // for a second).
    let newer = random_bytes(9_000, 99);
    std::fs::write(src.join("f3"), &newer).unwrap();
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(std::fs::read(mnt.join("f3")).unwrap(), newer);

    // While a file is open the mount is busy and the process keeps serving (a signal does
    // not pull the files from under their readers).
    drop(big);
    let last = cache.stop();
    assert!(last.starts_with("netram cache: stopped; hits "), "{last}");
    let counter = |name: &str| counter(&last, name);
    assert!(counter("evicted") > 0, "{last}");
    assert!(counter("hits") > 0, "{last}");
    assert_eq!(counter("files_changed"), 1, "{last}");
    assert_eq!(counter("source_errors"), 0, "{last}");
}

/// Counter `name` in the line `netram cache` prints as it stops.
fn counter(last: &str, name: &str) -> u64 {
    last.split(", ")
        .find_map(|kv| {
            kv.strip_prefix(&format!("{name} "))
                .or_else(|| kv.strip_prefix(&format!("netram cache: stopped; {name} ")))
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {last:?}"))
}

fn sha256(p: &Path) -> String {
    let o = Command::new("sha256sum").arg(p).output().unwrap();
    assert!(o.status.success(), "sha256sum {}", p.display());
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// Three daemons (TLS, one machine's worth of loopback) and `netram cache --cluster` beside
/// the first, with 2 MiB of its own for 24 MiB of files: the pages it drops go to the other
/// two by the GMS plan their epochs agree on, the next pass reads them back from there
/// (verified by this test with sha256sum, and by the cache against what it sent), and a
/// daemon killed between passes costs reads from the source, not data.
#[test]
fn pages_dropped_here_come_back_from_the_cluster() {
    if !netram_testkit::have_root("mounting FUSE") {
        return;
    }
    if !Path::new("/dev/fuse").exists() {
        netram_testkit::skip("no /dev/fuse (the kernel has no FUSE)", None);
        return;
    }
    if !netram_testkit::have_tools(&[("sha256sum", "coreutils")]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (src, mnt) = (dir.path().join("src"), dir.path().join("mnt"));
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir(&mnt).unwrap();
    for i in 0..3 {
        std::fs::write(src.join(format!("part{i}")), random_bytes(8 << 20, 100 + i)).unwrap();
    }
    let files: Vec<PathBuf> = walk(&src);
    let want: Vec<String> = files.iter().map(|f| sha256(f)).collect();
    // Each may hold 3/4 of its capacity for one client: 60 MiB between them, room for all.
    let (mut ds, control) = common::daemons(dir.path(), 390, ["8M", "40M", "40M"]);
    let mut d3 = ds.pop();
    let (d2, d1) = (ds.pop().unwrap(), ds.pop().unwrap());
    let daemon = control(1);
    // The epochs have begun and every daemon has weight: the plan knows the idle memory.
    common::eventually("a GMS plan weighing all three daemons", 30, || {
        netram_client::discover::gms_plan(&daemon, Duration::from_secs(2))
            .is_ok_and(|p| p.epoch >= 1 && p.weights.len() == 3)
    });

    let prom = dir.path().join("cache.prom");
    let cache = Cache::start_with(
        common::netram(),
        &src,
        &mnt,
        "2M",
        &[
            "--cluster",
            "--daemon",
            &daemon,
            "--metrics-file",
            prom.to_str().unwrap(),
        ],
    );
    let pass = |what: &str| {
        for (f, w) in files.iter().zip(&want) {
            let through = mnt.join(f.strip_prefix(&src).unwrap());
            assert_eq!(&sha256(&through), w, "{what}: {}", through.display());
        }
    };
    pass("first pass, from the source");
    pass("second pass, from the cluster");
    let taken = |d: &common::ServerProcess| d.stat("clean_taken");
    assert!(taken(&d2) > 0, "nothing read back from daemon 2");
    assert!(
        taken(d3.as_ref().unwrap()) > 0,
        "nothing read back from daemon 3"
    );
    // A daemon dies: its pages are read from the source again, and nothing else changes.
    drop(d3.take());
    pass("third pass, one daemon dead");
    let last = cache.stop();
    eprintln!("{last}");
    let pages = 3 * (8 << 20) / 4096;
    let c = |name: &str| counter(&last, name);
    assert_eq!(c("source_errors"), 0, "{last}");
    assert_eq!(c("cluster_remote_mismatch"), 0, "{last}");
    // The second pass came from the cluster (the third's half too, from daemon 2).
    assert!(
        c("cluster_hits") >= pages as u64 / 2,
        "fewer than half a pass from the cluster: {last}"
    );
    assert!(
        c("source_reads") < 3 * pages as u64,
        "every pass from the source: {last}"
    );
    assert!(c("cluster_forwarded") > 0, "{last}");
    // Pages the plan sent to the dead daemon went to the live one instead.
    assert_eq!(c("cluster_forward_failed"), 0, "{last}");
    // The same counters for Prometheus (node_exporter's textfile collector), as they ended.
    let text = std::fs::read_to_string(&prom).unwrap();
    for name in ["cluster_hits", "source_reads", "cluster_remote_mismatch"] {
        assert!(
            text.contains(&format!("\nnetram_cache_{name} {}\n", c(name))),
            "{name} in {text}"
        );
    }
    drop(d2);
    drop(d1);
}

/// GMS's shared pages between two machines (as two TLS identities, each with its own daemon
/// among three): B mirrors the data set under the same `--source-name` as A and holds its
/// first file in memory. A, with room for a quarter of a file, reads the second file (its own
/// pages: the two other daemons take them all, nearly filling their offers) and then the
/// first: every page of it that A lets go is a duplicate (B holds it) and goes first — dropped,
/// or into a frame nobody else wants — so that none of the second file's pages, though older,
/// leaves the cluster for it, and A's next read of the second file comes from the cluster.
/// When B stops, its sessions end and the homes forget its pages. Every file is checked with
/// sha256sum through both mounts.
#[test]
fn pages_another_machine_holds_go_first() {
    if !netram_testkit::have_root("mounting FUSE") {
        return;
    }
    if !Path::new("/dev/fuse").exists() {
        netram_testkit::skip("no /dev/fuse (the kernel has no FUSE)", None);
        return;
    }
    if !netram_testkit::have_tools(&[("sha256sum", "coreutils")]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let (mnt_a, mnt_b) = (dir.path().join("a"), dir.path().join("b"));
    for d in [&src, &mnt_a, &mnt_b] {
        std::fs::create_dir(d).unwrap();
    }
    let pages_per_file = (8 << 20) / 4096;
    for i in 0..2 {
        std::fs::write(src.join(format!("part{i}")), random_bytes(8 << 20, 200 + i)).unwrap();
    }
    let files = walk(&src);
    let want: Vec<String> = files.iter().map(|f| sha256(f)).collect();
    // Each may hold 3/4 of its capacity for one client: 2304 pages between them for A, room
    // for the second file's 2048 and a little more.
    let (daemons, sock) = common::daemons(dir.path(), 410, ["8M", "6M", "6M"]);
    let sum = |name: &str| daemons.iter().map(|d| d.stat(name)).sum::<u64>();
    common::eventually("a GMS plan weighing all three daemons", 30, || {
        netram_client::discover::gms_plan(&sock(1), Duration::from_secs(2))
            .is_ok_and(|p| p.epoch >= 1 && p.weights.len() == 3)
    });
    let start = |cmd: Command, mnt: &Path, mem: &str, daemon: &str| {
        Cache::start_with(
            cmd,
            &src,
            mnt,
            mem,
            &["--cluster", "--daemon", daemon, "--source-name", "data-set"],
        )
    };
    let check = |mnt: &Path, which: &[usize], what: &str| {
        for &i in which {
            let through = mnt.join(files[i].strip_prefix(&src).unwrap());
            assert_eq!(sha256(&through), want[i], "{what}: {}", through.display());
        }
    };
    // B: another machine (its own identity and daemon), room for the whole first file.
    let mut b_cmd = Command::new(NETRAM);
    b_cmd.env("NETRAM_TLS", common::node_dir(419));
    let b = start(b_cmd, &mnt_b, "12M", &sock(2));
    check(&mnt_b, &[0], "B reads the first file");
    common::eventually("B's pages registered at their homes", 20, || {
        sum("gcd_entries") >= pages_per_file
    });
    // A: room for a quarter of a file.
    let a = start(common::netram(), &mnt_a, "2M", &sock(1));
    check(&mnt_a, &[1], "A reads the second file");
    check(&mnt_a, &[0], "A reads the first file");
    check(&mnt_a, &[1], "A reads the second file again");
    let last = a.stop();
    eprintln!("A: {last}");
    let c = |name: &str| counter(&last, name);
    assert_eq!(c("source_errors"), 0, "{last}");
    assert_eq!(c("cluster_gcd_failed"), 0, "{last}");
    assert_eq!(c("cluster_remote_mismatch"), 0, "{last}");
    // The first file's pages that left A were duplicates, sent as the oldest...
    let dups = c("cluster_duplicates");
    assert!(dups >= pages_per_file - 512 - 16, "{last}");
    assert!(c("cluster_forwarded_duplicate") + c("cluster_dropped_duplicate") <= dups);
    // ... and took no frame from the second file's pages: the third pass found them all in
    // the cluster but for the quarter A held itself.
    assert!(c("cluster_hits") >= pages_per_file - 512 - 64, "{last}");
    assert!(sum("gcd_duplicates") >= dups);
    // B stops: its sessions end, and the homes forget its pages.
    let last_b = b.stop();
    eprintln!("B: {last_b}");
    assert_eq!(counter(&last_b, "source_errors"), 0, "{last_b}");
    assert!(counter(&last_b, "cluster_gcd_registered") >= pages_per_file);
    common::eventually("B's pages forgotten", 20, || sum("gcd_entries") == 0);
    assert!(sum("gcd_forgotten") >= pages_per_file);
}

/// Every regular file below `root`.
fn walk(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(root).unwrap() {
        let e = e.unwrap();
        let t = e.file_type().unwrap();
        if t.is_dir() {
            out.extend(walk(&e.path()));
        } else if t.is_file() {
            out.push(e.path());
        }
    }
    out.sort();
    out
}
