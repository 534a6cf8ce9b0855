//! `netram run`: unmodified programs (a C program calling every interposed function, GNU
//! sort, the bundled quicksort) with their large allocations on real `netram serve`
//! processes, as root and as an ordinary user; and the refusals.

use common::{ServerProcess, NETRAM};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

const WORKLOAD: &str = env!("CARGO_BIN_EXE_netram-workload");

fn cluster(n: usize) -> (Vec<ServerProcess>, String) {
    let s: Vec<ServerProcess> = (0..n)
        .map(|_| ServerProcess::start(&["--capacity", "256M"]))
        .collect();
    let addrs = s
        .iter()
        .map(|s| s.addr.clone())
        .collect::<Vec<_>>()
        .join(",");
    (s, addrs)
}

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("netram-run-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Threads that keep every CPU busy (one more than there are) until dropped.
struct Busy {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Busy {
    fn start() -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let n = std::thread::available_parallelism().map_or(2, |n| n.get()) + 1;
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed)
                        && std::time::Instant::now() < deadline
                    {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// `netram run ARGS -- PROGRAM...` bounded by `timeout`.
fn netram_run(args: &[&str], program: &[&str]) -> Output {
    netram_run_command(args, program).output().unwrap()
}

/// The command [`netram_run`] runs, for a test that sets more on it first.
fn netram_run_command(args: &[&str], program: &[&str]) -> Command {
    let mut c = common::netram_env(Command::new("timeout"));
    c.args(["300", NETRAM, "run"])
        .args(args)
        .arg("--")
        .args(program);
    c
}

fn report(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("the report")).unwrap()
}

fn compile_alloc_mix(dir: &Path) -> Option<PathBuf> {
    common::compile_c(dir, "alloc_mix", &[])
}

fn assert_ran(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `tests/c/NAME.c` compiled (with `libs`) and run under `netram run --local-mem LOCAL` on two
/// servers; it must succeed and print "NAME: ok". Its report, or `None` (skipped, said so)
/// without a C compiler.
fn c_program_on_netram(name: &str, libs: &[&str], local: &str) -> Option<serde_json::Value> {
    let dir = Scratch::new(name);
    let exe = common::compile_c(&dir.0, name, libs)?;
    let (_servers, addrs) = cluster(2);
    let rep = dir.0.join("report.json");
    let out = netram_run(
        &[
            "--local-mem",
            local,
            "--servers",
            &addrs,
            "--report",
            rep.to_str().unwrap(),
        ],
        &[exe.to_str().unwrap()],
    );
    assert_ran(&out, &format!("{name} under netram run"));
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("{name}: ok")));
    Some(report(&rep))
}

/// A program that makes part of its resident heap unreadable (guard pages) while it pages:
/// the handler passes those victims over instead of dying on them, and their contents are
/// intact afterwards.
#[test]
fn pages_the_program_protects_are_kept() {
    let Some(r) = c_program_on_netram("protect_none", &[], "4M") else {
        return;
    };
    let g = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert!(g("unreadable_victims") > 0, "{r}");
    assert!(g("evictions") > 5_000, "{r}");
    assert_eq!(g("errors"), 0, "{r}");
}

#[test]
fn a_c_program_runs_on_netram() {
    let dir = Scratch::new("c");
    let Some(exe) = compile_alloc_mix(&dir.0) else {
        return;
    };
    let (_servers, addrs) = cluster(2);
    let rep = dir.0.join("report.json");
    let out = netram_run(
        &[
            "--local-mem",
            "4M",
            "--servers",
            &addrs,
            "--report",
            rep.to_str().unwrap(),
        ],
        &[exe.to_str().unwrap()],
    );
    assert_ran(&out, "alloc_mix");
    assert!(String::from_utf8_lossy(&out.stdout).contains("alloc_mix: ok"));
    let r = report(&rep);
    let g = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
    // 24 + 24 + 8 + 8 + 16 MiB written through a 4 MiB budget: most of it went out and came
    // back.
    assert!(g("evictions") > 10_000, "{r}");
    // Fetched on a fault or ahead of one.
    assert!(g("fetches") + g("prefetch_installed") > 5_000, "{r}");
    assert!(g("puts") > 5_000, "{r}");
    assert!(g("released") > 0, "{r}");
    assert_eq!(g("errors"), 0, "{r}");
    assert_eq!(g("exit_code"), 0);
    // Its children inherited its memory (root: forks are followed) and the one that read it
    // was served the pages on the servers.
    assert!(g("forks") >= 2, "{r}");
    assert!(
        g("child_faults") + g("child_prefetched") + g("child_copies") > 1000,
        "{r}"
    );
}

/// A program linked with jemalloc keeps its allocator: it mixes `malloc` with jemalloc's own
/// entry points (`mallocx`, `sdallocx`, `rallocx`...), which used to get netram's pointers and
/// crash at start; its memory still goes to the cluster, through jemalloc's `mmap` calls.
#[test]
fn a_program_linked_with_jemalloc_keeps_its_allocator() {
    if !netram_testkit::have_tools(&[("jeprof", "libjemalloc-dev")]) {
        return;
    }
    let Some(r) = c_program_on_netram("jemalloc_mix", &["-ljemalloc"], "8M") else {
        return;
    };
    let g = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
    // 64 MiB of large blocks through an 8 MiB budget.
    assert!(g("evictions") > 8_000, "{r}");
    assert!(g("puts") > 8_000, "{r}");
    assert_eq!(g("errors"), 0, "{r}");
}

/// Programs linked with tcmalloc or mimalloc, which define glibc's own `__libc_malloc` too (so
/// the preload library's small blocks are theirs): `malloc_usable_size` must be theirs as well.
#[test]
fn programs_linked_with_tcmalloc_or_mimalloc_run() {
    let libs = [
        (
            "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "libtcmalloc-minimal4",
        ),
        (
            "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2",
            "libmimalloc2.0",
        ),
    ];
    let missing: Vec<&str> = libs
        .iter()
        .filter(|(path, _)| !Path::new(path).exists())
        .map(|(_, package)| *package)
        .collect();
    if !missing.is_empty() {
        netram_testkit::skip(
            "tcmalloc or mimalloc is not installed",
            Some(&missing.join(" ")),
        );
        return;
    }
    let dir = Scratch::new("allocators");
    let (_servers, addrs) = cluster(2);
    for (lib, _) in libs {
        let Some(exe) = common::compile_c(&dir.0, "plain_mix", &[lib]) else {
            return;
        };
        let out = netram_run(
            &["--local-mem", "8M", "--servers", &addrs],
            &[exe.to_str().unwrap()],
        );
        assert_ran(&out, lib);
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("plainmix: ok"),
            "{lib}"
        );
    }
}

/// `netram run redis-server`: on drop, Redis is killed (by the PID in its pidfile: `netram run`
/// waits for its program and would leave it behind), also when a test fails; `netram run` then
/// ends by itself and removes its report directory (killed after 10 s if it does not).
struct Redis {
    netram_run: std::process::Child,
    pidfile: PathBuf,
}

impl Drop for Redis {
    fn drop(&mut self) {
        if let Some(pid) = std::fs::read_to_string(&self.pidfile)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            // SAFETY: kill(2) on the PID Redis wrote for itself; no pointers.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while matches!(self.netram_run.try_wait(), Ok(None)) && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.netram_run.kill();
        let _ = self.netram_run.wait();
    }
}

/// Debian's Redis (linked with jemalloc) under `netram run` with a sixth of its data local:
/// every value written comes back, and most of its memory is on the servers.
#[test]
fn redis_runs_with_its_data_on_the_cluster() {
    if !netram_testkit::have_tools(&[
        ("redis-server", "redis-server"),
        ("redis-cli", "redis-tools"),
    ]) {
        return;
    }
    let dir = Scratch::new("redis");
    let (_servers, addrs) = cluster(2);
    let r = redis_on_the_cluster(&dir.0, &addrs, common::netram());
    let g = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert!(
        g("puts") > 5_000,
        "most of Redis's memory went to the servers: {r}"
    );
    assert_eq!(g("errors"), 0, "{r}");
}

/// Redis as `netram` (the command given, which may run it as another user) starts it in
/// `dir`, with 16M local: 100,000 keys of 512 bytes are written and every one read back, and
/// redis-benchmark's SETs and GETs all answered; its report.
fn redis_on_the_cluster(dir: &Path, addrs: &str, mut netram: Command) -> serde_json::Value {
    let rep = dir.join("report.json");
    let port = common::reserved_port().to_string();
    let pidfile = dir.join("redis.pid");
    let mut redis = Redis {
        netram_run: netram
            .args(["run", "--local-mem", "16M", "--servers", addrs])
            .args(["--report", rep.to_str().unwrap(), "--", "redis-server"])
            .args(["--port", &port, "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--enable-debug-command", "yes"])
            .arg("--dir")
            .arg(dir)
            .arg("--pidfile")
            .arg(&pidfile)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
        pidfile,
    };
    let cli = |args: &[&str]| {
        common::netram_env(Command::new("timeout"))
            .args(["60", "redis-cli", "-p", &port])
            .args(args)
            .output()
            .unwrap()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while cli(&["ping"]).stdout != b"PONG\n" {
        assert!(std::time::Instant::now() < deadline, "redis did not start");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // 100,000 keys of 512-byte values (about 70 MiB with Redis's overheads).
    assert_eq!(
        cli(&["debug", "populate", "100000", "key", "512"]).stdout,
        b"OK\n"
    );
    assert_eq!(cli(&["dbsize"]).stdout, b"100000\n");
    every_populated_value_is_intact(&port, 100_000, 512);
    // Requests from a load generator, read into and answered from Redis's own buffers
    // (jemalloc's memory, on the region; as an ordinary user the kernel cannot fault those
    // pages in itself: Redis closed the connections with EFAULT before the I/O was guarded).
    let bench = common::netram_env(Command::new("timeout"))
        .args(["120", "redis-benchmark", "-p", &port, "-q", "-n", "20000"])
        .args(["-r", "100000", "-d", "200", "-t", "set,get", "-P", "16"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&bench.stdout).replace('\r', "\n");
    assert!(
        bench.status.success()
            && text.contains("SET:")
            && text.contains("GET:")
            && !text.contains("Error"),
        "redis-benchmark: {text} {}",
        String::from_utf8_lossy(&bench.stderr)
    );
    // Again, after the load generator's SETs (other keys: `key:` and twelve digits) have
    // pushed most of them out and back.
    every_populated_value_is_intact(&port, 100_000, 512);
    cli(&["shutdown", "nosave"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(status) = redis.netram_run.try_wait().unwrap() {
            break status;
        }
        assert!(std::time::Instant::now() < deadline, "redis did not stop");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(0), "redis's exit");
    report(&rep)
}

/// Debian's Redis under `netram run --local-mem 16M` holding about 70 MiB saves with BGSAVE,
/// which forks a child that reads every page: the child is held to the budget as its parent
/// is (issue 38; it used to grow to the whole data set), while the parent keeps taking writes
/// (its pages change under the child, which keeps them as at the fork). The dump is checked by
/// loading it into a plain Redis and reading every value back.
#[test]
fn redis_saves_in_the_background_within_its_budget() {
    if !netram_testkit::have_tools(&[
        ("redis-server", "redis-server"),
        ("redis-cli", "redis-tools"),
        ("redis-benchmark", "redis-tools"),
    ]) {
        return;
    }
    let dir = Scratch::new("redis-bgsave");
    let (_servers, addrs) = cluster(2);
    let rep = dir.0.join("report.json");
    let port = common::reserved_port().to_string();
    let pidfile = dir.0.join("redis.pid");
    let mut redis = Redis {
        netram_run: common::netram()
            .args(["run", "--local-mem", "16M", "--servers", &addrs])
            .args(["--report", rep.to_str().unwrap(), "--", "redis-server"])
            .args(["--port", &port, "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--enable-debug-command", "yes"])
            .arg("--dir")
            .arg(&dir.0)
            .arg("--pidfile")
            .arg(&pidfile)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
        pidfile: pidfile.clone(),
    };
    let cli = |port: &str, args: &[&str]| {
        let out = common::netram_env(Command::new("timeout"))
            .args(["60", "redis-cli", "-p", port])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while cli(&port, &["ping"]) != "PONG\n" {
        assert!(std::time::Instant::now() < deadline, "redis did not start");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(
        cli(&port, &["debug", "populate", "100000", "key", "512"]),
        "OK\n"
    );
    let parent: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // Writes to other keys while the child saves: pages of the parent change under it.
    let writer = common::netram_env(Command::new("timeout"))
        .args(["60", "redis-benchmark", "-p", &port, "-q", "-n", "30000"])
        .args(["-r", "100000", "-d", "200", "-t", "set", "-P", "16"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let _writer = KillOnDrop(writer);
    assert!(cli(&port, &["bgsave"]).contains("started"));
    // The child's peak resident memory, read while it lives (VmHWM keeps the largest).
    let mut child_peak_kib = 0u64;
    let mut child_seen = false;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let children = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
            .unwrap_or_default();
        let mut any = false;
        for child in children.split_whitespace() {
            let status =
                std::fs::read_to_string(format!("/proc/{child}/status")).unwrap_or_default();
            if let Some(kib) = status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches(" kB").parse::<u64>().ok())
            {
                any = true;
                child_peak_kib = child_peak_kib.max(kib);
            }
        }
        child_seen |= any;
        if !any && cli(&port, &["info", "persistence"]).contains("rdb_bgsave_in_progress:0") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the save did not end");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let persistence = cli(&port, &["info", "persistence"]);
    assert!(
        persistence.contains("rdb_last_bgsave_status:ok"),
        "{persistence}"
    );
    assert!(child_seen, "the saving child was never seen");
    eprintln!("the saving child held at most {child_peak_kib} KiB");
    // 16 MiB of the region, plus Redis's code and libraries and netram's own tables (the
    // parent held 34 MiB in all here); the data set is 70 MiB, which the child read whole.
    assert!(
        child_peak_kib <= 40 << 10,
        "the saving child held {child_peak_kib} KiB"
    );
    cli(&port, &["shutdown", "nosave"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while redis.netram_run.try_wait().unwrap().is_none() {
        assert!(std::time::Instant::now() < deadline, "redis did not stop");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let r = report(&rep);
    let g = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
    eprintln!(
        "pager waits {}, faults deferred over the fork {}",
        g("pager_waits"),
        g("faults_deferred")
    );
    // Every page of the data set read by the child: on a fault, or fetched ahead of one.
    assert!(
        g("forks") >= 1 && g("child_faults") + g("child_prefetched") > 17_000,
        "{r}"
    );
    assert!(g("child_drops") > 10_000, "the child dropped pages: {r}");
    // The budget, plus the faults served while a batch was being chosen.
    assert!(g("child_peak_resident_pages") <= 4096 + 64, "{r}");
    assert_eq!(g("errors"), 0, "{r}");
    // The dump, loaded by a plain Redis: every value as written.
    let port2 = common::reserved_port().to_string();
    let plain = Command::new("redis-server")
        .args(["--port", &port2, "--bind", "127.0.0.1", "--save", ""])
        .args(["--appendonly", "no", "--dbfilename", "dump.rdb"])
        .arg("--dir")
        .arg(&dir.0)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let _plain = KillOnDrop(plain);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while cli(&port2, &["ping"]) != "PONG\n" {
        assert!(
            std::time::Instant::now() < deadline,
            "the plain redis did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    every_populated_value_is_intact(&port2, 100_000, 512);
}

/// Forked children that close every descriptor they inherited (their agent's socket with
/// them), one after forking a grandchild that keeps a copy of it for a minute: each still
/// sees its memory exactly (they keep what they touch once their agent is gone), and none
/// waits for the grandchild.
#[test]
fn children_that_close_their_descriptors_keep_their_memory() {
    if !netram_testkit::have_root("following forks (CAP_SYS_PTRACE)") {
        return;
    }
    let dir = Scratch::new("child-closes-all");
    let Some(exe) = common::compile_c(&dir.0, "child_closes_all", &[]) else {
        return;
    };
    let (_servers, addrs) = cluster(2);
    let started = std::time::Instant::now();
    let out = netram_run(
        &["--local-mem", "8M", "--servers", &addrs],
        &[exe.to_str().unwrap()],
    );
    assert_ran(&out, "child_closes_all");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "children: ok\n");
    // Not a measure of speed: a child waiting for its agent, which is gone, would wait until
    // the grandchild lets go of the socket, a minute (the run takes a few seconds).
    assert!(
        started.elapsed() < std::time::Duration::from_secs(40),
        "a child waited for an agent that was gone"
    );
}

/// A process killed (by its PID) and reaped when the test ends, passed or not.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads every key `DEBUG POPULATE n key size` wrote back from the Redis on `port` and checks
/// each value byte for byte: `value:K` padded with zero bytes to `size` (Redis's own
/// definition). The GETs are pipelined over one connection in batches of 1,000, in Redis's
/// protocol (RESP), spoken here directly: redis-cli would take a process per key.
fn every_populated_value_is_intact(port: &str, n: u32, size: usize) {
    use std::io::{BufRead, BufReader, Read, Write};
    let stream = std::net::TcpStream::connect(format!("127.0.0.1:{port}")).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    let mut w = stream.try_clone().unwrap();
    let mut r = BufReader::new(stream);
    let mut checked = 0u32;
    for start in (0..n).step_by(1000) {
        let end = (start + 1000).min(n);
        let mut req = Vec::new();
        for k in start..end {
            let key = format!("key:{k}");
            write!(req, "*2\r\n$3\r\nGET\r\n${}\r\n{key}\r\n", key.len()).unwrap();
        }
        w.write_all(&req).unwrap();
        for k in start..end {
            let mut head = String::new();
            r.read_line(&mut head).unwrap();
            let len: usize = head
                .strip_prefix('$')
                .and_then(|l| l.trim_end().parse().ok())
                .unwrap_or_else(|| panic!("key:{k}: reply {head:?}"));
            let mut value = vec![0u8; len + 2];
            r.read_exact(&mut value).unwrap();
            value.truncate(len);
            let mut want = format!("value:{k}").into_bytes();
            want.resize(size, 0);
            assert!(
                value == want,
                "key:{k} read back wrong: {:?}",
                String::from_utf8_lossy(&value[..len.min(40)])
            );
            checked += 1;
        }
    }
    assert_eq!(checked, n);
}

/// The program's only server is SIGKILLed while most of its memory is there: its next touch of
/// a lost page ends it with SIGBUS and a message naming the page and the server, as the kernel
/// ends a program whose swap-in cannot be read (it used to fault again forever, spinning).
#[test]
fn a_program_whose_pages_are_lost_dies_of_sigbus() {
    let dir = Scratch::new("sigbus");
    let Some(exe) = common::compile_c(&dir.0, "touch_after_pause", &[]) else {
        return;
    };
    let server = ServerProcess::start(&["--capacity", "256M"]);
    let mut run = common::netram_env(Command::new("timeout"))
        .args(["120", NETRAM, "run", "--local-mem", "4M", "--servers"])
        .arg(&server.addr)
        .arg("--")
        .arg(&exe)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(run.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    assert_eq!(line, "filled\n", "the program filled its memory");
    server.signal(libc::SIGKILL);
    // Dead (a zombie until its guard reaps it): its sockets are closed.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !std::fs::read_to_string(format!("/proc/{}/stat", server.pid()))
        .unwrap_or_default()
        .rsplit_once(')')
        .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the server did not die"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    std::io::Write::write_all(&mut run.stdin.take().unwrap(), b"go\n").unwrap();
    let out = run.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(128 + libc::SIGBUS),
        "netram run reports death by SIGBUS: {err}"
    );
    assert!(
        err.contains("cannot be read") && err.contains("lost with dead server"),
        "the reason is on stderr: {err}"
    );
    assert!(err.contains("killed by signal 7 (SIGBUS"), "{err}");
}

/// Under `rs:2+2` one of five servers is SIGKILLed while most of the program's memory is on
/// the servers: the program reads every page back right (its faults on pages whose data piece
/// died are decoded from their stripes, by ticket, without holding the region), and the report
/// says what the redundancy did.
#[test]
fn a_program_reads_its_memory_back_after_a_server_dies_under_reed_solomon() {
    let dir = Scratch::new("rs-degraded");
    let Some(exe) = common::compile_c(&dir.0, "touch_after_pause", &[]) else {
        return;
    };
    let (servers, addrs) = cluster(5);
    let rep = dir.0.join("report.json");
    let mut run = common::netram_env(Command::new("timeout"))
        .args([
            "120",
            NETRAM,
            "run",
            "--local-mem",
            "4M",
            "--redundancy",
            "rs:2+2",
        ])
        .args(["--servers", &addrs, "--report", rep.to_str().unwrap(), "--"])
        .arg(&exe)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(run.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    assert_eq!(line, "filled\n", "the program filled its memory");
    servers[2].signal(libc::SIGKILL);
    std::io::Write::write_all(&mut run.stdin.take().unwrap(), b"go\n").unwrap();
    let out = run.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    line.clear();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    assert_eq!(line, "checked\n", "every page read back right: {err}");
    assert!(out.status.success(), "{err}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&rep).unwrap()).unwrap();
    let n = |k: &str| report[k].as_u64().unwrap_or(0);
    assert!(n("servers_dead") >= 1, "the death was seen: {report}");
    assert!(n("degraded_reads") > 0, "pages were decoded: {report}");
    assert_eq!(n("pages_unrecoverable"), 0, "{report}");
    assert!(err.contains("server(s) lost on the way"), "{err}");
}

/// A scratch directory holding `in.txt`: 300,000 random lines (9 MB) for sort.
fn sort_input(name: &str, seed: u64) -> (Scratch, PathBuf) {
    let dir = Scratch::new(name);
    let input = dir.0.join("in.txt");
    let mut rng = fastrand::Rng::with_seed(seed);
    let text: String = (0..300_000)
        .map(|_| format!("{:016x} {}\n", rng.u64(..), rng.u32(..)))
        .collect();
    std::fs::write(&input, text).unwrap();
    (dir, input)
}

/// GNU sort of `input` through `cmd` (plain `sort`, or `netram run … -- sort`) with a 32 MiB
/// buffer, in the C locale.
fn sort_with(cmd: &mut Command, input: &Path) -> std::process::Output {
    cmd.args(["-S", "32M", "--parallel=1"])
        .arg(input)
        .env("LC_ALL", "C")
        .output()
        .unwrap()
}

/// GNU sort under `netram run` with 8 MiB local on two servers, `extra` options given: its
/// output is plain sort's; the run's report.
fn sort_on_netram(name: &str, seed: u64, extra: &[&str]) -> serde_json::Value {
    let (dir, input) = sort_input(name, seed);
    let plain = sort_with(&mut Command::new("sort"), &input);
    assert_ran(&plain, "sort");
    let (_servers, addrs) = cluster(2);
    let rep = dir.0.join("report.json");
    let out = sort_with(
        common::netram_env(Command::new("timeout"))
            .args([
                "300",
                NETRAM,
                "run",
                "--local-mem",
                "8M",
                "--servers",
                &addrs,
            ])
            .args(extra)
            .args(["--report", rep.to_str().unwrap(), "--", "sort"]),
        &input,
    );
    assert_ran(&out, &format!("sort under netram run {extra:?}"));
    assert!(
        out.stdout == plain.stdout,
        "sort's output differs under netram run {extra:?}"
    );
    report(&rep)
}

/// GNU sort keeps its buffer in one large malloc: sorted under netram with a quarter of it
/// local, the output is the same as without.
#[test]
fn gnu_sort_gives_the_same_output() {
    let r = sort_on_netram("sort", 7, &[]);
    assert!(r["evictions"].as_u64().unwrap() > 100, "{r}");
    let fetched = r["fetches"].as_u64().unwrap() + r["prefetch_installed"].as_u64().unwrap();
    assert!(fetched > 100, "{r}");
}

/// GNU sort under `netram run --compress-link-mbps 100`: its buffer of hex text compresses,
/// so its pages go to the servers as sealed LZ4 blocks (and come back from them), and the
/// output is the same as without.
#[test]
fn gnu_sort_with_compressed_pages_gives_the_same_output() {
    let r = sort_on_netram("sort-lz4", 13, &["--compress-link-mbps", "100"]);
    let n = |k: &str| r[k].as_u64().unwrap_or(0);
    assert!(n("pages_compressed") > 100, "{r}");
    // Hex text and numbers: LZ4 takes a good share off each page.
    assert!(
        n("bytes_saved_compressing") > n("pages_compressed") * 1000,
        "{r}"
    );
    assert!(n("fetches") + n("prefetch_installed") > 100, "{r}");
}

/// GNU sort under `netram run --backing cluster+disk` with one small daemon: its pages are
/// also on its disk, so the full daemon drops the oldest (GMS's clean pages) rather than
/// refuse the newest, and sort reads those back from the disk. Same output as plain sort.
#[test]
fn gnu_sort_with_cluster_disk_backing_on_a_full_daemon_gives_the_same_output() {
    let (dir, input) = sort_input("sort-clean", 11);
    let sort = |cmd: &mut Command| sort_with(cmd, &input);
    let plain = sort(&mut Command::new("sort"));
    assert_ran(&plain, "sort");
    let server = ServerProcess::start(&["--capacity", "2M", "--max-client-memory", "2M"]);
    let rep = dir.0.join("report.json");
    let out = sort(
        common::netram_env(Command::new("timeout"))
            .args(["300", NETRAM, "run", "--local-mem", "8M"])
            .args(["--backing", "cluster+disk", "--servers", &server.addr])
            .args(["--report", rep.to_str().unwrap(), "--", "sort"]),
    );
    assert_ran(&out, "sort under netram run --backing cluster+disk");
    assert!(
        out.stdout == plain.stdout,
        "sort's output differs under netram"
    );
    let r = report(&rep);
    assert!(r["evictions"].as_u64().unwrap() > 4096, "{r}");
    // Sort read back pages the daemon had dropped, from the disk, and netram says so.
    assert!(r["clean_copies_dropped"].as_u64().unwrap() > 0, "{r}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("read back from the local disk"), "{said}");
    assert!(r["disk_fallbacks"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["spills"].as_u64(), Some(0), "{r}");
    // The daemon took every page (none was refused) and dropped the oldest for the newest.
    assert_eq!(server.stat("puts_refused_full"), 0);
    assert!(server.stat("clean_owned_dropped") > 0, "{r}");
}

/// `PROGRAM` with `stdin` run plainly and under `netram run --local-mem 8M --threshold 0`
/// (every allocation on the cluster); the two outputs and the run's report.
fn plain_and_on_netram(program: &[&str], stdin: &[u8]) -> (Output, Output, serde_json::Value) {
    use std::io::Write;
    let run = |cmd: &mut Command| {
        let mut child = cmd
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(stdin).unwrap();
        child.wait_with_output().unwrap()
    };
    let plain = run(common::netram_env(Command::new("timeout"))
        .arg("300")
        .args(program)
        .env("LC_ALL", "C"));
    assert_ran(&plain, program[0]);
    let (_servers, addrs) = cluster(2);
    let dir = Scratch::new(&format!("small-{}", program[0]));
    let rep = dir.0.join("report.json");
    let out = run(common::netram_env(Command::new("timeout"))
        .args([
            "300",
            NETRAM,
            "run",
            "--local-mem",
            "8M",
            "--threshold",
            "0",
        ])
        .args(["--servers", &addrs, "--report", rep.to_str().unwrap(), "--"])
        .args(program)
        .env("LC_ALL", "C"));
    assert_ran(&out, &format!("{} under netram run", program[0]));
    (plain, out, report(&rep))
}

/// A process that forks and then leaves by `_exit` (Python's `os._exit`, as a daemon's parent
/// may) hands its child its memory first, as at `exit`: before, the child was left with
/// its pages on servers nobody served any more and read garbage (a forked Python was seen
/// spinning at full CPU for good).
#[test]
fn a_child_keeps_its_memory_when_its_parent_leaves_by_underscore_exit() {
    a_child_outlives_its_parent(
        "parent-exits",
        "pid = os.fork()\nif pid == 0:\n    child()\nos._exit(0)\n",
    );
}

/// The same for a program that daemonizes itself with the C library's `daemon(3)` (`ssh -f`,
/// iproute2's `nstat -d`; here Python through ctypes): the C library's `daemon` forks and
/// leaves by its own internal calls, which nothing interposes, so the child read zeros where
/// its pages were on the servers; `netram run`'s library has its own `daemon`.
#[test]
fn a_child_keeps_its_memory_when_its_parent_daemonizes_it() {
    a_child_outlives_its_parent(
        "daemon",
        "import ctypes\nif ctypes.CDLL(None).daemon(1, 0) != 0:\n    sys.exit(1)\nchild()\n",
    );
}

/// A parent killed with SIGKILL cannot hand its child the pages it holds for it on the
/// servers: the child's agent sees its parent's end of their socket close without the word
/// that every page was handed over and ends the child, saying why on its stderr, before the
/// child computes on the zeros the kernel would read where those pages were. (Before, the
/// child read zeros there and went on: a wrong sum, or a Python spinning.)
#[test]
fn a_child_whose_parent_is_killed_is_ended_rather_than_read_zeros() {
    a_child_outlives_its_parent(
        "parent-killed",
        "import signal\npid = os.fork()\nif pid == 0:\n    child()\ntime.sleep(0.5)\n\
         os.kill(os.getpid(), signal.SIGKILL)\n",
    );
}

/// The same with a child that is busy when its parent is killed: it sums the list again and
/// again, so it faults on the servers' pages all the time. Its agent must still win the race
/// with its next fault: the agent holds the child's own userfaultfd, so the parent's death
/// leaves that fault waiting rather than zero-filled. (Before, such a child read zeros within
/// microseconds, before its agent woke: Redis's BGSAVE child died of SIGSEGV; here a wrong
/// sum, a Python exception or a crash, with nothing said of why.)
#[test]
fn a_busy_child_whose_parent_is_killed_is_ended_before_it_reads_zeros() {
    a_child_outlives_its_parent(
        "parent-killed-busy",
        "import signal\npid = os.fork()\nif pid == 0:\n    child()\ntime.sleep(0.5)\n\
         os.kill(os.getpid(), signal.SIGKILL)\n",
    );
}

/// The same for a child held to no budget (`--child-mem unlimited`): it has an agent too, which
/// only watches for its parent's death. (Before, such a child had none, and read zeros.)
#[test]
fn a_busy_child_without_a_budget_whose_parent_is_killed_is_ended() {
    a_child_outlives_its_parent(
        "parent-killed-busy-unlimited",
        "import signal\npid = os.fork()\nif pid == 0:\n    child()\ntime.sleep(0.5)\n\
         os.kill(os.getpid(), signal.SIGKILL)\n",
    );
}

/// A Python under `netram run --local-mem 8M` builds a list of 300,000 tuples (most of it on
/// the servers), and `leave` (Python) makes a child that calls `child()` and a parent that
/// goes. The child waits until its parent is gone, then sums the list: the sum must be
/// right; or, when the parent goes by SIGKILL (`name` "parent-killed…"), the child must be
/// ended by netram with a message, before it writes any sum. A child whose `name` says
/// "busy" sums the list over and over meanwhile (and writes a wrong sum at once), until 2 s
/// after its parent is gone; one whose `name` ends in "unlimited" runs with `--child-mem
/// unlimited`.
fn a_child_outlives_its_parent(name: &str, leave: &str) {
    if !netram_testkit::have_root("following forks (CAP_SYS_PTRACE)")
        || !netram_testkit::have_tools(&[("python3", "python3")])
    {
        return;
    }
    let dir = Scratch::new(name);
    let (result, pid_file) = (dir.0.join("result"), dir.0.join("child.pid"));
    let script = format!(
        r#"import os, sys, time
n = int(sys.argv[1])
data = [('k%d' % i, i * 3) for i in range(n)]
parent = os.getpid()
busy = sys.argv[4] == 'busy'
expected = sum(v for _, v in data)
def child():
    with open(sys.argv[3] + '.tmp', 'w') as f:
        f.write('%d' % os.getpid())
    os.rename(sys.argv[3] + '.tmp', sys.argv[3])
    fd = os.open(os.devnull, os.O_RDWR)
    for s in (0, 1):
        os.dup2(fd, s)
    err = os.open(sys.argv[3] + '.err', os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(err, 2)
    t, left = time.time(), None
    while time.time() - t < 60:
        if left is None and os.getppid() != parent:
            left = time.time()
        if left is not None and (not busy or time.time() - left > 2):
            break
        if busy:
            if sum(v for _, v in data) != expected:
                break
        else:
            time.sleep(0.01)
    with open(sys.argv[2] + '.tmp', 'w') as f:
        f.write('%d\n' % sum(v for _, v in data))
    os.rename(sys.argv[2] + '.tmp', sys.argv[2])
    os._exit(0)
{leave}"#
    );
    let (_servers, addrs) = cluster(2);
    let rep = dir.0.join("report.json");
    let py = dir.0.join("leave.py");
    std::fs::write(&py, script).unwrap();
    let out = common::netram_env(Command::new("timeout"))
        .args(["120", NETRAM, "run", "--local-mem", "8M"])
        .args(if name.ends_with("unlimited") {
            &["--child-mem", "unlimited"][..]
        } else {
            &[]
        })
        .args(["--servers", &addrs, "--report", rep.to_str().unwrap()])
        .args(["--", "python3"])
        .arg(&py)
        .arg("300000")
        .arg(&result)
        .arg(&pid_file)
        .arg(if name.contains("busy") {
            "busy"
        } else {
            "idle"
        })
        .output()
        .unwrap();
    let killed = name.starts_with("parent-killed");
    if killed {
        assert_eq!(
            out.status.code(),
            Some(128 + 9),
            "the parent died of SIGKILL"
        );
    } else {
        assert_ran(&out, "python3 under netram run");
    }
    // A child that dies or spins before it writes its pid is found by its script's path,
    // unique to this test, and killed by its pid.
    let _stray = KillRunning(py.clone());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let child: i32 = loop {
        if let Ok(pid) = std::fs::read_to_string(&pid_file) {
            break pid.trim().parse().unwrap();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the child never wrote its pid"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    // The child by its pid, whatever happens below.
    let _child = KillPid(child);
    if killed {
        // SAFETY: kill(2) with signal 0 sends nothing and takes no pointers.
        while unsafe { libc::kill(child, 0) } == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the child (pid {child}) still runs a minute after its parent was killed"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let err = std::fs::read_to_string(pid_file.with_extension("pid.err")).unwrap_or_default();
        assert!(
            !result.exists(),
            "the child computed on memory it no longer had: {:?}\n{err}",
            std::fs::read_to_string(&result)
        );
        assert!(
            err.contains("ended without handing it over"),
            "the child's stderr: {err}"
        );
        return;
    }
    while !result.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the child (pid {child}) never wrote its sum: it lost its memory with its parent"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let expected: u64 = (0..300_000u64).map(|i| i * 3).sum();
    assert_eq!(
        std::fs::read_to_string(&result).unwrap().trim(),
        expected.to_string()
    );
    // The parent's counters reached the report though it skipped `exit`.
    let r = report(&rep);
    assert!(r["forks"].as_u64().unwrap_or(0) >= 1, "{r}");
}

/// Kills a process by its pid when dropped (if it still runs).
struct KillPid(i32);

/// Kills, when dropped, every process still running the script at this path (a path unique
/// to its test), each by its pid.
struct KillRunning(PathBuf);

impl Drop for KillRunning {
    fn drop(&mut self) {
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return;
        };
        let script = self.0.as_os_str().as_encoded_bytes();
        for entry in procs.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<i32>().ok())
            else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            if cmdline.split(|&b| b == 0).any(|arg| arg == script) {
                // SAFETY: kill(2) takes no pointers; the process runs this test's script.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

impl Drop for KillPid {
    fn drop(&mut self) {
        // SAFETY: kill(2) takes no pointers; the pid is the test's own grandchild.
        unsafe { libc::kill(self.0, libc::SIGKILL) };
    }
}

/// A program whose memory is all small blocks, run with `--threshold 0`, keeps to its local
/// memory: its blocks live on the cluster (many pages written out), and its peak resident
/// memory is the budget plus code and stacks, well under what it takes without netram.
fn assert_heap_paged(what: &str, plain: &Output, out: &Output, r: &serde_json::Value) {
    assert!(
        out.stdout == plain.stdout,
        "{what}'s output differs under netram:\n{}\nvs\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&plain.stdout)
    );
    let puts = r["puts"].as_u64().unwrap();
    assert!(puts > 2000, "{what}: pages on the cluster: {r}");
    assert!(
        r["heap_spans"].as_u64().unwrap() > 0,
        "{what}: small blocks on the region: {r}"
    );
    let peak = r["peak_rss_kib"].as_u64().unwrap();
    assert!(
        peak < (8 + 16) << 10,
        "{what}: {peak} KiB resident with 8M local: {r}"
    );
}

/// An in-memory SQL database (Debian's sqlite3): rows of a few hundred bytes and an index,
/// every block small.
#[test]
fn an_in_memory_database_keeps_to_its_local_memory() {
    if !netram_testkit::have_tools(&[("sqlite3", "sqlite3")]) {
        return;
    }
    // The SQL `netram bench programs` runs, on 150,000 rows.
    let sql = netram_bench::programs::sqlite_script(150_000);
    let (plain, out, r) = plain_and_on_netram(&["sqlite3", ":memory:"], sql.as_bytes());
    assert!(
        String::from_utf8_lossy(&plain.stdout).starts_with("150000|15000000|4096"),
        "{}",
        String::from_utf8_lossy(&plain.stdout)
    );
    assert_heap_paged("sqlite3", &plain, &out, &r);
}

/// The region's tables (13 bytes per page of it) cost resident memory only for the part of
/// the region in use: a small program with an 8 GiB region (27 MiB of tables, were they all
/// written at start) holds about what it holds with a 1 GiB one.
#[test]
fn a_large_region_costs_no_memory_until_used() {
    if !netram_testkit::have_tools(&[("perl", "perl")]) {
        return;
    }
    let (_servers, addrs) = cluster(1);
    let dir = Scratch::new("large-region");
    let peak = |max_mem: &str| {
        let rep = dir.0.join(format!("report-{max_mem}.json"));
        let out = netram_run(
            &[
                "--local-mem",
                "8M",
                "--max-mem",
                max_mem,
                "--servers",
                &addrs,
                "--report",
                rep.to_str().unwrap(),
            ],
            &["perl", "-e", "my @a = (1..1000); print scalar(@a), qq(\n)"],
        );
        assert_ran(&out, "perl under netram run");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "1000\n");
        let r = report(&rep);
        // The region was made (perl allocates at once): its counters are in the report.
        assert_eq!(r["processes"].as_u64(), Some(1), "{r}");
        r["peak_rss_kib"].as_u64().unwrap()
    };
    let (small, large) = (peak("1G"), peak("8G"));
    assert!(
        large < small + 4096,
        "peak resident memory {large} KiB with an 8 GiB region, {small} KiB with 1 GiB"
    );
}

/// An interpreter building many small objects (Debian's perl, whose values are `malloc`ed
/// one by one).
#[test]
fn an_interpreter_full_of_small_objects_keeps_to_its_local_memory() {
    if !netram_testkit::have_tools(&[("perl", "perl")]) {
        return;
    }
    let script = br#"my %h; my @a;
for my $i (1..30000) { $h{"k$i"} = [$i, "v" x ($i % 50)]; push @a, {n => $i}; }
my $t = 0; for my $i (1..30000) { $t += $h{"k$i"}[0] + length($h{"k$i"}[1]) + $a[$i-1]{n}; }
print scalar(keys %h), " $t\n";
"#;
    let (plain, out, r) = plain_and_on_netram(&["perl", "-"], script);
    assert_eq!(String::from_utf8_lossy(&plain.stdout), "30000 900765000\n");
    assert_heap_paged("perl", &plain, &out, &r);
}

/// A program that forks while its threads fault (every allocation on the cluster): each
/// child sees its memory as at its fork, pages on the servers included, while the parent
/// rewrites all of it; the parent's memory stays its own.
#[test]
fn a_program_that_forks_while_its_threads_fault() {
    // Following forks (and every allocation on the region) needs root.
    if !netram_testkit::have_root("following forks (CAP_SYS_PTRACE)") {
        return;
    }
    let Some(r) = c_program_on_netram("fork_while_faulting", &["-pthread"], "8M") else {
        return;
    };
    assert!(r["forks"].as_u64().unwrap() >= 3, "{r}");
    // The children were served pages that were on the servers at their fork (on a fault or
    // ahead of one), or given them before the parent rewrote them.
    let g = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert!(
        g("child_faults") + g("child_prefetched") + g("child_copies") > 1000,
        "{r}"
    );
}

/// A Java program run under `netram run`: the JDK's source launcher on `CLASS.java`.
struct JavaRun {
    /// `java JVM_FLAGS CLASS.java ARG`, to run it without netram too.
    java: Vec<String>,
    out: Output,
    report: serde_json::Value,
    _dir: Scratch,
}

/// `source` as `class`.java, run as `java JVM_FLAGS CLASS.java ARG` under `netram run
/// --local-mem LOCAL RUN_FLAGS` on two servers of `capacity` each; `None` (skipped, said so)
/// without a JDK.
fn java_on_netram(
    class: &str,
    source: &str,
    jvm: &[&str],
    arg: &str,
    local: &str,
    capacity: &str,
    run_flags: &[&str],
) -> Option<JavaRun> {
    if !netram_testkit::have_tools(&[("javac", "openjdk-17-jdk-headless")]) {
        return None;
    }
    let dir = Scratch::new(&format!("jvm-{class}"));
    let src = dir.0.join(format!("{class}.java"));
    std::fs::write(&src, source).unwrap();
    let mut java: Vec<String> = vec!["java".into()];
    java.extend(jvm.iter().map(|s| s.to_string()));
    java.push(src.to_str().unwrap().into());
    java.push(arg.into());
    let servers: Vec<ServerProcess> = (0..2)
        .map(|_| ServerProcess::start(&["--capacity", capacity]))
        .collect();
    let addrs = servers
        .iter()
        .map(|s| s.addr.clone())
        .collect::<Vec<_>>()
        .join(",");
    let rep = dir.0.join("report.json");
    let mut args = vec![
        "--local-mem",
        local,
        "--servers",
        &addrs,
        "--report",
        rep.to_str().unwrap(),
    ];
    args.extend_from_slice(run_flags);
    let program: Vec<&str> = java.iter().map(String::as_str).collect();
    let out = netram_run(&args, &program);
    assert_ran(&out, &format!("{class} under netram run"));
    let report = report(&rep);
    Some(JavaRun {
        java,
        out,
        report,
        _dir: dir,
    })
}

/// A JVM (Debian's OpenJDK) building a million-entry HashMap: its heap, which it reserves
/// `PROT_NONE` (at an address of its choosing, for compressed pointers) and commits with
/// `MAP_FIXED` mappings, is on netram, and its output is the same.
#[test]
fn a_jvm_keeps_its_heap_on_netram() {
    let Some(run) = java_on_netram(
        "Objs",
        r#"import java.util.*;
public class Objs {
  public static void main(String[] a) {
    int n = Integer.parseInt(a[0]);
    HashMap<Integer, String> m = new HashMap<>();
    for (int i = 0; i < n; i++) m.put(i, "v" + i);
    long t = 0;
    for (int i = 0; i < n; i += 3) t += m.get(i).length();
    System.out.println(m.size() + " " + t);
  }
}
"#,
        &["-Xmx512m"],
        "1000000",
        "64M",
        "256M",
        &["--max-mem", "2G"],
    ) else {
        return;
    };
    let plain = common::netram_env(Command::new("timeout"))
        .arg("300")
        .args(&run.java)
        .output()
        .unwrap();
    assert_ran(&plain, "java");
    assert_eq!(String::from_utf8_lossy(&plain.stdout), "1000000 2296298\n");
    assert_eq!(run.out.stdout, plain.stdout);
    let r = &run.report;
    let g = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
    // Its heap went out through a 64 MiB budget (all local, it peaks at ~230 MiB here).
    assert!(g("puts") > 10_000, "{r}");
    assert!(g("evictions") > 10_000, "{r}");
    assert_eq!(g("errors"), 0, "{r}");
}

/// Libraries loaded after start (as a JVM loads `libjvm`): the dynamic loader's blocks for
/// them stay off the region even as root, where every other block of the program is on it,
/// and after everything has been pushed out the libraries still work (the handler never
/// faults on the loader's memory).
///
/// Run on a busy machine (more spinning threads than CPUs, as CI's parallel tests make it):
/// there netram's threads had not started when the program's `dlopen` took the loader's lock
/// and its library's constructor faulted; their start registers thread-local destructors,
/// which takes that lock, and the program hung for good (every time here, with 3 spinners on
/// 2 CPUs, before `loader::thread_atexit`).
#[test]
fn libraries_loaded_after_start_keep_the_loader_off_the_region() {
    if !netram_testkit::have_root("every block of the program on the region") {
        return;
    }
    let _busy = Busy::start();
    let Some(r) = c_program_on_netram("dlopen_late", &["-pthread"], "8M") else {
        return;
    };
    assert!(r["evictions"].as_u64().unwrap() > 10_000, "{r}");
    assert_eq!(r["errors"].as_u64(), Some(0), "{r}");
}

/// The JVM that hung for good (issue 37): Debian's OpenJDK with a 1.2 GiB heap of small arrays
/// on a 210 MiB budget, over TLS. Its handler's first `send` came after the loader's lists
/// (allocated through the program's `malloc`, `libjvm`'s among them) had been evicted, and the
/// lazy lookup of `send` walked them: the handler faulted on its own region. Interposed
/// functions are now looked up at load, and the loader's blocks kept off the region.
#[test]
fn a_jvm_that_outgrows_its_budget_many_times_completes() {
    let Some(run) = java_on_netram(
        "Big",
        r#"import java.util.*;
public class Big {
  public static void main(String[] a) {
    int n = Integer.parseInt(a[0]);
    HashMap<Integer, long[]> m = new HashMap<>();
    for (int i = 0; i < n; i++) { long[] v = new long[16]; v[i % 16] = i; m.put(i, v); }
    long t = 0;
    for (int i = 0; i < n; i += 7) t += m.get(i)[i % 16];
    System.out.println(m.size() + " " + t);
  }
}
"#,
        &["-Xmx1200m", "-XX:+UseSerialGC"],
        "3000000",
        "210M",
        "1G",
        &[],
    ) else {
        return;
    };
    // The sum of the multiples of 7 below 3,000,000, each read from its own array.
    assert_eq!(
        String::from_utf8_lossy(&run.out.stdout),
        "3000000 642857357142\n"
    );
    let r = &run.report;
    let g = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
    // All-local it peaks at ~700 MiB here: most of the heap went out and came back.
    assert!(g("evictions") > 100_000, "{r}");
    assert!(g("faults") > 100_000, "{r}");
    assert_eq!(g("errors"), 0, "{r}");
    assert!(g("peak_rss_kib") < 400 << 10, "{r}");
}

/// A shell script that runs many short commands: each one is a process of its own on netram
/// (its own region and sessions on the servers), and each session ends with the process, not
/// when its lease runs out. (Left to their leases, 64 commands in a few seconds filled the
/// servers' session table for one address, and the next command could not start.)
#[test]
fn a_script_of_many_short_commands_runs() {
    let (servers, addrs) = cluster(2);
    let scratch = Scratch::new("script");
    let rpath = scratch.0.join("report.json");
    let out = netram_run(
        &[
            "--local-mem",
            "16M",
            "--servers",
            &addrs,
            "--report",
            rpath.to_str().unwrap(),
        ],
        &[
            "sh",
            "-c",
            "i=0; while [ $i -lt 200 ]; do /bin/true || exit 1; i=$((i+1)); done; echo $i",
        ],
    );
    assert_ran(&out, "the script");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "200");
    let r = report(&rpath);
    assert!(r["processes"].as_u64().unwrap() >= 200, "{r}");
    for s in &servers {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        // The one left is the session of the query asking.
        while s.stat("live_sessions") > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(
            s.stat("live_sessions"),
            1,
            "sessions outlived their processes"
        );
        assert_eq!(s.stat("handshakes_refused_peer_sessions"), 0);
        assert!(s.stat("sessions_closed") > 200);
    }
}

/// Programs nobody wrote for netram that fork: a Python script whose child sums a million
/// tuples built by the parent (os.fork, as multiprocessing does), and bash, whose command
/// substitutions fork subshells that read its arrays.
#[test]
fn python_and_bash_fork_under_netram() {
    if !netram_testkit::have_root("following forks (CAP_SYS_PTRACE)")
        || !netram_testkit::have_tools(&[("python3", "python3"), ("bash", "bash")])
    {
        return;
    }
    // The script `netram bench programs` runs, for 300,000 tuples.
    let py = netram_bench::programs::FORK_SCRIPT.as_bytes();
    let (plain, out, r) = plain_and_on_netram(&["python3", "-", "300000"], py);
    assert_eq!(
        String::from_utf8_lossy(&plain.stdout),
        "child 134999550000 67500000000 parent 300000\n"
    );
    assert_eq!(
        out.stdout,
        plain.stdout,
        "python3's output under netram (its stderr: {})",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(r["forks"].as_u64().unwrap() >= 1, "{r}");
    let sh = br#"a=(); for i in $(seq 1 60000); do a+=("item$i-$((i*7))"); done
x=$(printf "%s\n" "${a[@]}" | sort | tail -1)
for i in 1 2 3 4 5; do y=$(echo ${a[$((i*10000))]}); echo -n "$y "; done; echo $x ${#a[@]}
"#;
    let (plain, out, r) = plain_and_on_netram(&["bash", "-s"], sh);
    assert!(
        String::from_utf8_lossy(&plain.stdout).ends_with(" item9999-69993 60000\n"),
        "{}",
        String::from_utf8_lossy(&plain.stdout)
    );
    assert_eq!(
        out.stdout,
        plain.stdout,
        "bash's output under netram (its stderr: {})",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(r["forks"].as_u64().unwrap() >= 5, "{r}");
}

/// The bundled quicksort (a Rust program: its vector is one large malloc), on the cluster and
/// on the local disk only; it verifies its own result.
#[test]
fn the_quicksort_workload_runs_on_cluster_and_disk() {
    let (_servers, addrs) = cluster(2);
    for (backing, servers) in [("cluster", addrs.as_str()), ("disk", "")] {
        let mut args = vec!["--local-mem", "8M", "--backing", backing];
        if !servers.is_empty() {
            args.extend(["--servers", servers]);
        }
        let out = netram_run(&args, &[WORKLOAD, "qsort", "33554432", "5"]);
        assert_ran(&out, backing);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("1 process(es) on netram"), "{err}");
    }
}

#[test]
fn bad_configurations_are_refused_clearly() {
    let cases: [(&[&str], &str); 6] = [
        (
            &["--local-mem", "8M", "--servers", "127.0.0.1:1"],
            "no page server could be reached",
        ),
        (
            &["--local-mem", "8M", "--child-mem", "1", "--backing", "disk"],
            "--child-mem must be at least one page (4K), or unlimited",
        ),
        (
            &[
                "--local-mem",
                "8M",
                "--child-mem",
                "most",
                "--backing",
                "disk",
            ],
            "is not a size",
        ),
        (
            &["--local-mem", "lots", "--servers", "x:1"],
            "is not a size",
        ),
        (
            // No servers and no daemon to ask (NETRAM_DAEMON below names nothing).
            &["--local-mem", "8M"],
            "no --servers (or NETRAM_SERVERS) given",
        ),
        (
            &["--local-mem", "1", "--backing", "disk"],
            "at least one page",
        ),
    ];
    for (args, want) in cases {
        let out = common::netram()
            .arg("run")
            .args(args)
            .args(["--", "true"])
            .env_remove("NETRAM_SERVERS")
            .env("NETRAM_DAEMON", "/nonexistent/netram-daemon.sock")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // The program's own exit status comes through.
    let out = netram_run(
        &["--local-mem", "8M", "--backing", "disk", "-q"],
        &["sh", "-c", "exit 3"],
    );
    assert_eq!(out.status.code(), Some(3));
}

/// A `netram run` killed with SIGKILL leaves its report directory behind (`netram-run-PID-N`
/// in the temporary directory); the next `netram run` removes those whose process is gone,
/// and keeps a live one's.
#[test]
fn a_killed_runs_directory_is_removed_by_the_next_run() {
    let tmp = Scratch::new("sweep");
    let mut dead = Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    let stale = tmp.0.join(format!("netram-run-{dead_pid}-7"));
    let live = tmp.0.join(format!("netram-run-{}-7", std::process::id()));
    for d in [&stale, &live] {
        std::fs::create_dir(d).unwrap();
        std::fs::write(d.join("attached-1"), b"").unwrap();
    }
    let out = netram_run_command(&["--local-mem", "8M", "--backing", "disk", "-q"], &["true"])
        .env("TMPDIR", &tmp.0)
        .output()
        .unwrap();
    assert_ran(&out, "netram run -- true");
    assert!(!stale.exists(), "the dead run's directory is gone");
    assert!(live.exists(), "a live process's directory stays");
    let left: Vec<_> = std::fs::read_dir(&tmp.0)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left.len(), 1, "nothing else is left: {left:?}");
}

/// As root, the C program again as the user nobody: the preload library's region uses a
/// user-mode-only userfaultfd there.
#[test]
fn works_for_an_ordinary_user() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: the other tests already ran as an ordinary user");
        return;
    }
    if !netram_testkit::have_tools(&[
        ("setpriv", "util-linux"),
        ("sqlite3", "sqlite3"),
        ("perl", "perl"),
        ("jeprof", "libjemalloc-dev"),
    ]) {
        return;
    }
    let dir = Scratch::new("nobody");
    let Some(exe) = compile_alloc_mix(&dir.0) else {
        return;
    };
    let Some(jemalloc) = common::compile_c(&dir.0, "jemalloc_mix", &["-ljemalloc"]) else {
        return;
    };
    let (netram, lib, tls) = files_for_nobody(&dir.0, 65534);
    let sql = dir.0.join("db.sql");
    std::fs::write(&sql, netram_bench::programs::sqlite_script(50_000)).unwrap();
    let input = dir.0.join("sort.txt");
    let mut rng = fastrand::Rng::with_seed(9);
    let text: String = (0..100_000)
        .map(|_| format!("{:016x} {}\n", rng.u64(..), rng.u32(..)))
        .collect();
    std::fs::write(&input, text).unwrap();
    let pl = dir.0.join("objects.pl");
    std::fs::write(
        &pl,
        r#"my %h; for my $i (1..30000) { $h{"k$i"} = [$i, "v" x ($i % 50)]; }
my $t = 0; $t += $h{"k$_"}[0] for 1..30000; print scalar(keys %h), " $t\n";
"#,
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    for p in [&exe, &jemalloc] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    for p in [&sql, &pl, &input] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let (_servers, addrs) = cluster(2);
    let as_nobody = |program: &[&std::ffi::OsStr], local: &str| {
        Command::new("timeout")
            .env("NETRAM_TLS", &tls)
            .args([
                "300",
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
            ])
            .arg(&netram)
            .args(["run", "--local-mem", local, "--servers", &addrs, "--"])
            .args(program)
            .env("NETRAM_PRELOAD", &lib)
            .env("TMPDIR", "/tmp")
            .env("LC_ALL", "C")
            // An ordinary user's region is not inherited by a child (following forks needs
            // CAP_SYS_PTRACE): alloc_mix expects its child's SIGSEGV.
            .env("ALLOC_MIX_FORK_SEGV", "1")
            .output()
            .unwrap()
    };
    let out = as_nobody(&[exe.as_os_str()], "4M");
    assert_ran(&out, "alloc_mix as nobody");
    assert!(String::from_utf8_lossy(&out.stdout).contains("alloc_mix: ok"));
    let out = as_nobody(&[jemalloc.as_os_str()], "8M");
    assert_ran(&out, "jemalloc_mix as nobody");
    assert!(String::from_utf8_lossy(&out.stdout).contains("jemalloc_mix: ok"));
    // Debian's programs, each against its own run without netram: only their blocks of 128K
    // or more are on netram here (see `netram run --help`), but every one of those is. GNU
    // sort reads its input straight into its large buffer (24 MB of fresh region memory, with
    // 4M local): a user-mode-only userfaultfd cannot serve the kernel's fault there, so the preload
    // library brings the pages in before the read (it failed with EFAULT before that).
    let read_sql = format!(".read {}", sql.display());
    let programs: [Vec<&std::ffi::OsStr>; 3] = [
        vec!["sqlite3".as_ref(), ":memory:".as_ref(), read_sql.as_ref()],
        vec!["perl".as_ref(), pl.as_os_str()],
        vec![
            "sort".as_ref(),
            "-S".as_ref(),
            "24M".as_ref(),
            "--parallel=2".as_ref(),
            input.as_os_str(),
        ],
    ];
    for program in &programs {
        let plain = Command::new(program[0])
            .args(&program[1..])
            .env("LC_ALL", "C")
            .output()
            .unwrap();
        assert_ran(&plain, &format!("{program:?}"));
        let out = as_nobody(program, "4M");
        assert_ran(&out, &format!("{program:?} as nobody"));
        assert!(
            out.stdout == plain.stdout,
            "{program:?} as nobody: different output"
        );
    }
    // Redis reads requests into, and writes replies from, jemalloc's memory, which is on the
    // region: the same guard.
    if netram_testkit::have_tools(&[
        ("redis-server", "redis-server"),
        ("redis-cli", "redis-tools"),
    ]) {
        let rw = dir.0.join("redis");
        std::fs::create_dir(&rw).unwrap();
        std::fs::set_permissions(&rw, std::fs::Permissions::from_mode(0o777)).unwrap();
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&netram)
            .env("NETRAM_TLS", &tls)
            .env("NETRAM_PRELOAD", &lib);
        let r = redis_on_the_cluster(&rw, &addrs, cmd);
        let g = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
        assert!(g("puts") > 5_000, "Redis's memory on the servers: {r}");
        assert!(g("io_guarded") > 0, "its reads and writes guarded: {r}");
        assert_eq!(g("errors"), 0, "{r}");
    }
}

/// What the user nobody needs in `dir` to run `netram run`: copies of the binary and the
/// preload library that nobody may run, and a client certificate of node `node` issued by
/// `netram keygen` and readable by nobody only (what an operator does to let a user page).
fn files_for_nobody(dir: &Path, node: u64) -> (PathBuf, PathBuf, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let netram = dir.join("netram");
    std::fs::copy(NETRAM, &netram).unwrap();
    let lib = dir.join("libnetram_preload.so");
    let built = Path::new(NETRAM).parent().unwrap();
    let src = [
        built.join("libnetram_preload.so"),
        built.join("deps/libnetram_preload.so"),
    ]
    .into_iter()
    .filter(|p| p.exists())
    .max_by_key(|p| p.metadata().unwrap().modified().unwrap())
    .expect("the preload library is built with the binary");
    std::fs::copy(src, &lib).unwrap();
    for p in [dir, &netram, &lib] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let tls = dir.join("tls-nobody");
    let issued = {
        let _one = common::KEYGEN.lock().unwrap_or_else(|e| e.into_inner());
        Command::new(NETRAM)
            .args(["keygen", "--cluster"])
            .arg(common::ca_dir())
            .args(["--node", &node.to_string(), "--out"])
            .arg(&tls)
            .output()
            .unwrap()
    };
    assert_ran(&issued, "netram keygen");
    for p in std::iter::once(tls.clone())
        .chain(std::fs::read_dir(&tls).unwrap().map(|e| e.unwrap().path()))
    {
        std::os::unix::fs::chown(&p, Some(65534), Some(65534)).unwrap();
    }
    (netram, lib, tls)
}

/// Issue "A newcomer's first hour": an ordinary user whom the administrator lets open
/// `/dev/userfaultfd` (here: a device node of the test's own, group nogroup, mode 0660,
/// bind-mounted over `/dev/userfaultfd` in a mount namespace of the test's own, so nothing
/// changes outside) gets everything root gets: every allocation on netram, faults inside
/// system calls served, forked children served their copy (the child opens a descriptor of
/// its own and sends it to the parent's handler). Debian's sqlite3 building an in-memory
/// table of ~190 MiB stays near its 16 MiB budget and prints what it prints alone; without
/// the device (`works_for_an_ordinary_user`) it kept its whole heap local.
#[test]
fn an_ordinary_user_allowed_dev_userfaultfd_pages_everything() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: cannot make a device node for the user nobody");
        return;
    }
    let Ok(dev) = std::fs::metadata("/dev/userfaultfd") else {
        netram_testkit::skip("no /dev/userfaultfd (Linux 6.1 and later have it)", None);
        return;
    };
    if !netram_testkit::have_tools(&[
        ("setpriv", "util-linux"),
        ("unshare", "util-linux"),
        ("sqlite3", "sqlite3"),
    ]) {
        return;
    }
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = Scratch::new("nobody-dev");
    let Some(exe) = compile_alloc_mix(&dir.0) else {
        return;
    };
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (netram, lib, tls) = files_for_nobody(&dir.0, 65533);
    let node = dir.0.join("userfaultfd");
    let made = Command::new("mknod")
        .arg(&node)
        .arg("c")
        .arg(rustix::fs::major(dev.rdev()).to_string())
        .arg(rustix::fs::minor(dev.rdev()).to_string())
        .output()
        .unwrap();
    assert_ran(&made, "mknod");
    std::os::unix::fs::chown(&node, Some(0), Some(65534)).unwrap();
    std::fs::set_permissions(&node, std::fs::Permissions::from_mode(0o660)).unwrap();
    let sql = dir.0.join("db.sql");
    std::fs::write(
        &sql,
        "CREATE TABLE t(k INTEGER PRIMARY KEY, v TEXT);
WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x < 400000)
INSERT INTO t SELECT x, printf('%0200d', x * 7919) FROM c;
CREATE INDEX i ON t(v);
SELECT count(*), sum(length(v)), max(v) FROM t;
",
    )
    .unwrap();
    std::fs::set_permissions(&sql, std::fs::Permissions::from_mode(0o644)).unwrap();
    let rep = dir.0.join("report.json");
    let (_servers, addrs) = cluster(2);
    let as_nobody = |program: &[&std::ffi::OsStr]| {
        let _ = std::fs::remove_file(&rep);
        Command::new("timeout")
            .arg("300")
            .args(["unshare", "--mount", "--propagation", "private", "sh", "-c"])
            .arg(r#"mount --bind "$0" /dev/userfaultfd && exec "$@""#)
            .arg(&node)
            .args([
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
            ])
            .arg(&netram)
            .args(["run", "--local-mem", "16M", "--servers", &addrs, "--report"])
            .arg(&rep)
            .arg("--")
            .args(program)
            .env("NETRAM_TLS", &tls)
            .env("NETRAM_PRELOAD", &lib)
            .env("TMPDIR", "/tmp")
            .env("LC_ALL", "C")
            .output()
            .unwrap()
    };
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o777)).unwrap();
    // Forks followed: alloc_mix's child reads what its parent wrote, evicted or not.
    let out = as_nobody(&[exe.as_os_str()]);
    assert_ran(&out, "alloc_mix as nobody with /dev/userfaultfd");
    assert!(String::from_utf8_lossy(&out.stdout).contains("alloc_mix: ok"));
    let r = report(&rep);
    let g = |r: &serde_json::Value, k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert!(g(&r, "forks") > 0 && g(&r, "child_faults") > 0, "{r}");
    // sqlite3: its output, and its memory.
    let read_sql = format!(".read {}", sql.display());
    let plain = Command::new("/usr/bin/time")
        .args(["-f", "%M"])
        .args(["sqlite3", ":memory:", &read_sql])
        .output();
    let out = as_nobody(&["sqlite3".as_ref(), ":memory:".as_ref(), read_sql.as_ref()]);
    assert_ran(&out, "sqlite3 as nobody with /dev/userfaultfd");
    let expected = Command::new("sqlite3")
        .args([":memory:", &read_sql])
        .output()
        .unwrap();
    assert_ran(&expected, "sqlite3 alone");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&expected.stdout)
    );
    let r = report(&rep);
    assert_eq!(g(&r, "errors"), 0, "{r}");
    // Small blocks too: sqlite3's pages are 4 KiB blocks of its page cache.
    assert!(g(&r, "heap_small_bytes") > 0, "{r}");
    assert!(
        g(&r, "puts") > 100_000,
        "its table went out to the servers: {r}"
    );
    let peak = g(&r, "peak_rss_kib");
    if let Ok(plain) = plain {
        if let Ok(kib) = String::from_utf8_lossy(&plain.stderr).trim().parse::<u64>() {
            assert!(kib > 150_000, "sqlite3 alone peaked at {kib} KiB");
        }
    }
    // 16 MiB of its heap, the program, its libraries and netram's own.
    assert!(peak < 48 * 1024, "peak resident {peak} KiB: {r}");
}

/// Issue "A newcomer's first hour": `netram run` of a program netram cannot reach used to run
/// it in local memory and say nothing. A static program (Debian's `ldconfig` is static-pie:
/// no dynamic loader reads LD_PRELOAD) is refused before it starts, with the reason; a program
/// into which the loader did not load the library (here: NETRAM_PRELOAD names an empty file,
/// which the loader ignores with a message) makes `netram run` exit non-zero after it ends,
/// saying so. A program netram does reach is not affected.
#[test]
fn a_program_netram_cannot_reach_is_refused_or_reported() {
    let ldconfig = Path::new("/usr/sbin/ldconfig");
    if !ldconfig.exists() {
        netram_testkit::skip(
            "no /usr/sbin/ldconfig (a static program) here",
            Some("libc-bin"),
        );
        return;
    }
    let out = netram_run(
        &["--local-mem", "8M", "--backing", "disk"],
        &["/usr/sbin/ldconfig", "-p"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a static program ran: {err}");
    assert!(err.contains("is statically linked"), "{err}");
    assert!(out.stdout.is_empty(), "it was not started");

    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.so");
    std::fs::write(&empty, b"").unwrap();
    let out = common::netram_env(Command::new("timeout"))
        .args([
            "60",
            NETRAM,
            "run",
            "--local-mem",
            "8M",
            "--backing",
            "disk",
        ])
        .args(["--", "sh", "-c", "echo ran"])
        .env("NETRAM_PRELOAD", &empty)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "ran\n",
        "the program ran"
    );
    assert!(
        !out.status.success(),
        "netram run succeeded without netram: {err}"
    );
    assert!(err.contains("netram never attached to sh"), "{err}");

    let out = netram_run(
        &["--local-mem", "8M", "--backing", "disk"],
        &["sh", "-c", "echo ran"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A `netram` without its preload library beside it (as `cargo install` leaves it: binaries
/// only) refuses to run a program and says exactly where the library goes and how to build it.
#[test]
fn a_netram_without_its_library_says_how_to_get_it() {
    let dir = Scratch::new("no-library");
    let bin = dir.0.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let exe = bin.join("netram");
    std::fs::copy(NETRAM, &exe).unwrap();
    let out = Command::new(&exe)
        .args([
            "run",
            "--insecure",
            "--local-mem",
            "8M",
            "--servers",
            "127.0.0.1:9",
        ])
        .args(["--", "/bin/true"])
        .env_remove("NETRAM_PRELOAD")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("libnetram_preload.so not found"), "{err}");
    assert!(
        err.contains("cargo build --release -p netram-preload"),
        "{err}"
    );
    // Where it would be found: beside the binary's directory, in lib/netram.
    let lib_dir = dir.0.join("bin/../lib/netram");
    assert!(err.contains(&lib_dir.display().to_string()), "{err}");
    // Put there as the message says, it is found: the program runs on netram.
    let built = Path::new(NETRAM).with_file_name("libnetram_preload.so");
    let built = if built.exists() {
        built
    } else {
        Path::new(NETRAM).with_file_name("deps/libnetram_preload.so")
    };
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::fs::copy(&built, lib_dir.join("libnetram_preload.so")).unwrap();
    let out = common::netram_env(Command::new(&exe))
        .args(["run", "--local-mem", "8M", "--backing", "disk"])
        .args(["--", "/bin/true"])
        .env_remove("NETRAM_PRELOAD")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
