//! The kernel's swap on netram, on a machine without an NBD driver: `netram nbd` → nbdfuse
//! exposes the export as a file (or `netram nbd --fuse` exposes the device as a file itself) →
//! a loop device on that file → `mkswap` + `swapon`. A program in
//! a cgroup-v1 memory cgroup limited to a quarter of its working set writes and verifies every
//! page, while /proc/swaps shows the device in use. Needs root; everything it sets up is undone
//! in reverse order by a guard, also when the test fails.

use common::{spawn_reporting, ServerProcess};
use netram_bench::process::{sh, swap_used, wait_for, Cleanup};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

const WORKLOAD: &str = env!("CARGO_BIN_EXE_netram-workload");

fn kill_child(mut c: Child) {
    let _ = c.kill();
    let _ = c.wait();
}

/// Why this machine cannot run the swap test, if it cannot.
/// Whether this machine can run the swap tests; if not, the test is skipped, saying why.
fn prerequisites_met() -> bool {
    if !netram_testkit::have_root("swapon, losetup and memory cgroups") {
        return false;
    }
    if let Err(why) = netram_bench::cgroup::Hierarchy::find() {
        netram_testkit::skip(&why, None);
        return false;
    }
    if !Path::new("/dev/fuse").exists() {
        netram_testkit::skip("no /dev/fuse (the kernel has no FUSE)", None);
        return false;
    }
    netram_testkit::have_tools(&[
        ("nbdfuse", "libnbd-bin"),
        ("fusermount3", "fuse3"),
        ("losetup", "util-linux"),
        ("mkswap", "util-linux"),
        ("swapon", "util-linux"),
        ("swapoff", "util-linux"),
    ])
}

/// How the device becomes a file for the loop device.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Via {
    /// `netram nbd` on a unix socket, nbdfuse as its client.
    Nbdfuse,
    /// `netram nbd --fuse`: the device is a file itself.
    Fuse,
}

/// Asks a process to stop and waits for it; SIGKILL after `grace`.
fn stop_child(mut c: Child, grace: Duration) {
    // SAFETY: kill(2) on the PID of a child we have not reaped yet.
    unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    kill_child(c);
}

/// Sets up swap on netram and runs the workload; with `kill_server`, SIGKILLs a page server
/// once the device is in use.
fn swap_through_netram(via: Via, backing: &str, kill_server: bool) {
    if !prerequisites_met() {
        return;
    }
    // Four runs in turn; 64 MiB through a 16 MiB cgroup swaps out three quarters of it and
    // reads it all back (kernel swap through FUSE and a loop device moves a few MiB/s here;
    // `bench nbd` swaps 2 GiB the same ways, 128 MiB in CI's smoke run).
    let working_set: u64 = 64 << 20;
    let limit = working_set / 4;
    let mut cleanup = Cleanup::default();

    let servers: Vec<ServerProcess> = (0..3)
        .map(|_| ServerProcess::start(&["--capacity", "256M"]))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nbd.sock");
    let mount: PathBuf = dir.path().join("mnt");
    std::fs::create_dir(&mount).unwrap();
    let list = servers
        .iter()
        .map(|s| s.addr.clone())
        .collect::<Vec<_>>()
        .join(",");
    let mut args = vec![
        "nbd",
        "--size",
        "512M",
        "--cache",
        "16M",
        "--backing",
        backing,
        "--servers",
        &list,
    ];
    match via {
        Via::Nbdfuse => args.extend(["--socket", socket.to_str().unwrap()]),
        Via::Fuse => args.extend(["--fuse", mount.to_str().unwrap()]),
    }
    let (nbd, _) = spawn_reporting(&args, "netram nbd: serving ");
    {
        let m = mount.clone();
        cleanup.push("stop netram nbd", move || {
            // Given time to flush and unmount; if it had to be killed, its FUSE mount is left
            // dead and is detached here.
            stop_child(nbd, Duration::from_secs(10));
            if via == Via::Fuse {
                let _ = Command::new("umount")
                    .arg("-l")
                    .arg(&m)
                    .stderr(Stdio::null())
                    .status();
            }
        });
    }

    let file = match via {
        Via::Fuse => mount.join("device"),
        Via::Nbdfuse => {
            let file = mount.join("nbd");
            let nbdfuse = Command::new("nbdfuse")
                .arg(&file)
                .arg(format!("nbd+unix:///?socket={}", socket.display()))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start nbdfuse");
            let m = mount.clone();
            cleanup.push("unmount nbdfuse and stop it", move || {
                let _ = Command::new("umount").arg(&m).status();
                kill_child(nbdfuse);
            });
            file
        }
    };
    wait_for("the device's file", Duration::from_secs(10), || {
        file.exists()
    })
    .unwrap();

    let lo = sh(
        "losetup",
        &["--find", "--show", "--direct-io=on", file.to_str().unwrap()],
    )
    .expect("a loop device");
    {
        let lo = lo.clone();
        cleanup.push("detach the loop device", move || {
            let _ = sh("losetup", &["-d", &lo]);
        });
    }
    sh("mkswap", &[&lo]).expect("mkswap");
    sh("swapon", &["-p", "32000", "--discard", &lo]).expect("swapon");
    {
        let lo = lo.clone();
        cleanup.push("swapoff", move || {
            let _ = sh("swapoff", &[&lo]);
        });
    }

    // Held until the end: dropped (the group removed) after the workload has exited.
    let cg = netram_bench::cgroup::Hierarchy::find()
        .expect("a memory cgroup controller")
        .create(
            &format!("netram-swap-test-{}", std::process::id()),
            Some(limit),
        )
        .expect("create a memory cgroup");
    // The cgroup-v1 memory controller can OOM-kill a workload whose swap-ins it cannot charge
    // fast enough, whatever the device (`bench nbd` sees it with a local swap file and zram
    // too): up to three attempts, each kill said and counted by the group, as `bench nbd` does.
    let mut used_max = 0;
    let mut killed = false;
    let mut oom_kills = 0;
    let started = Instant::now();
    let (status, out) = loop {
        let mut workload = Command::new("sh")
            .arg("-c")
            .arg(cg.enter_then(&format!("exec {WORKLOAD} touch {working_set} 42")))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the workload");
        let attempt = Instant::now();
        let status = loop {
            if let Some(status) = workload.try_wait().unwrap() {
                break status;
            }
            used_max = used_max.max(swap_used(&lo));
            if kill_server && !killed && used_max > working_set / 4 {
                servers[1].signal(libc::SIGKILL);
                killed = true;
            }
            if attempt.elapsed() > Duration::from_secs(300) {
                let _ = workload.kill();
                panic!("the workload did not finish in 300 s (swap used at most {used_max} bytes)");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let out = workload.wait_with_output().unwrap();
        let group_kills = cg.oom_kills();
        if status.signal() == Some(libc::SIGKILL) && group_kills > oom_kills && oom_kills < 2 {
            eprintln!(
                "{via:?}, {backing}: the workload was OOM-killed by its memory cgroup; again"
            );
            oom_kills = group_kills;
            continue;
        }
        break (status, out);
    };
    assert!(
        status.success(),
        "workload failed: {status} (the group OOM-killed {oom_kills} earlier attempts)\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!(
        "{} pages written and verified",
        working_set / 4096
    )));
    assert!(
        used_max > working_set / 2,
        "swap on {lo} was used: at most {used_max} bytes"
    );
    if kill_server {
        assert!(killed, "a server was killed while the device was in use");
    }
    eprintln!(
        "{via:?}, {backing}: {:?}, swap used at most {} MiB, {oom_kills} OOM kills before",
        started.elapsed(),
        used_max >> 20
    );
    drop(cleanup);
    drop(servers);
}

/// `vm.page-cluster` set for the test, the machine's value put back when dropped (also when
/// the test fails).
///
/// 0 (no swap readahead) rather than the kernel's 3: with readahead, a swap-in charges up to
/// eight pages to the 16 MiB group, locked while their reads are in flight through the loop
/// device and FUSE; reclaim finds nothing it may take and the group's OOM killer ends the
/// workload (1 run in 2 of the FUSE configurations, `memory: usage 16384kB` with 10.7 MB
/// swap-cached and nothing inactive; zram, whose reads are synchronous, never; with 0, 10 of
/// 10 passed). Swapping in a small group through a device of a few MiB/s wants it so.
struct PageCluster(Option<String>);

impl PageCluster {
    const PATH: &'static str = "/proc/sys/vm/page-cluster";

    fn set(value: &str) -> Self {
        let old = std::fs::read_to_string(Self::PATH).ok();
        if old.is_some() {
            std::fs::write(Self::PATH, value).expect("set vm.page-cluster");
        }
        Self(old)
    }
}

impl Drop for PageCluster {
    fn drop(&mut self) {
        if let Some(old) = &self.0 {
            let _ = std::fs::write(Self::PATH, old.trim());
        }
    }
}

/// One test, the runs in turn: two swap devices at the same priority would be used
/// round-robin by both workloads, each reaching into the other's device.
#[test]
fn kernel_swap_through_a_loop_device() {
    if !prerequisites_met() {
        return;
    }
    let _page_cluster = PageCluster::set("0");
    swap_through_netram(Via::Nbdfuse, "cluster", false);
    swap_through_netram(Via::Nbdfuse, "cluster+disk", true);
    swap_through_netram(Via::Fuse, "cluster", false);
    swap_through_netram(Via::Fuse, "cluster+disk", true);
}
