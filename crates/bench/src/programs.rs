//! `netram bench programs`: real programs from Debian's packages — nobody wrote them for
//! netram — each run three ways side by side: all in local memory, under `netram run` with a
//! quarter of its peak memory local, and (as root) under the kernel's swap to a file on the
//! local disk in a memory cgroup of that same size (what a user would pick instead). Every
//! run's output is checked against the all-local run's. Anemone §4 and Nswap §V measure the
//! same way: unmodified applications against the local disk.
//!
//! The programs: Redis (linked with jemalloc) loaded by `DEBUG POPULATE` and read by
//! redis-benchmark; sqlite3 building an indexed in-memory table; GNU sort with two threads on a
//! file larger than the local memory; Python building millions of small objects; Python
//! forking a child that reads what the parent built while the parent rewrites it.
//!
//! Each run is `sh -c SCRIPT`: its wall time and the peak resident memory of the largest
//! process of the run (code and stacks included, as `wait4` reports it).

use crate::machine::Machine;
use crate::nbd::{setup, start_servers, tempfile_dir};
use crate::process::have;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Options {
    pub quick: bool,
    pub out: PathBuf,
    /// The `netram` executable: servers and `netram run` are its children.
    pub netram_exe: PathBuf,
    /// Only these programs (by name) [default: all].
    pub only: Vec<String>,
    /// Say on stderr what runs (the demo, which shows a spinner instead, does not).
    pub progress: bool,
    /// Also run the kernel's swap 4 MiB below and above netram's size (`SWAP_AROUND_MIB`);
    /// the demo, which shows one comparison, does not.
    pub swap_around: bool,
}

/// A program: its name, what it stands for, the Debian packages it needs, and its script
/// (run by `sh -c` in `dir`, where `prepare` wrote its input).
struct Program {
    name: &'static str,
    what: &'static str,
    tools: &'static [&'static str],
    prepare: fn(dir: &Path, quick: bool) -> anyhow::Result<String>,
}

const PROGRAMS: &[Program] = &[
    Program {
        name: "redis",
        what: "Redis (jemalloc) filled by DEBUG POPULATE, read by redis-benchmark GETs",
        tools: &["redis-server", "redis-cli", "redis-benchmark"],
        prepare: redis,
    },
    Program {
        name: "sqlite3",
        what: "sqlite3: an in-memory table of short rows and its index",
        tools: &["sqlite3"],
        prepare: sqlite,
    },
    Program {
        name: "sort",
        what: "GNU sort --parallel=2 of a file larger than the local memory",
        tools: &["sort", "cksum"],
        prepare: sort,
    },
    Program {
        name: "python",
        what: "Python: a dict of millions of small tuples",
        tools: &["python3"],
        prepare: python_objects,
    },
    Program {
        name: "python_fork",
        what: "Python: a forked child reads the list its parent built while the parent rewrites it",
        tools: &["python3"],
        prepare: python_fork,
    },
];

fn redis(dir: &Path, quick: bool) -> anyhow::Result<String> {
    let keys = if quick { 100_000 } else { 1_000_000 };
    let port = 20_000 + fastrand::u16(..20_000);
    // The server in the background, the load generator, then the checks: the key count and a
    // value's checksum.
    Ok(format!(
        "redis-server --port {port} --save '' --appendonly no --enable-debug-command yes \
  --dir {dir} >/dev/null & S=$!
for i in $(seq 200); do redis-cli -p {port} ping >/dev/null 2>&1 && break; sleep 0.05; done
redis-cli -p {port} debug populate {keys} key 256 >/dev/null
redis-benchmark -p {port} -n {n} -r {keys} -t get -q >/dev/null
redis-cli -p {port} dbsize
redis-cli -p {port} get key:12345 | cksum
redis-cli -p {port} shutdown nosave >/dev/null; wait $S",
        dir = dir.display(),
        n = keys * 2,
    ))
}

/// The SQL sqlite3 runs on `rows` rows: a table of short rows and its index, queries, a delete.
pub fn sqlite_script(rows: usize) -> String {
    format!(
        "CREATE TABLE t(id INTEGER PRIMARY KEY, k TEXT, v TEXT);
WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<{rows})
INSERT INTO t SELECT x, printf('%08x', (x*2654435761) % 4294967296), printf('%0100d', x*7919) FROM c;
CREATE INDEX tk ON t(k);
SELECT count(*), sum(length(v)), count(DISTINCT substr(k,1,3)) FROM t;
SELECT id, k FROM t WHERE k > 'f' ORDER BY k LIMIT 3;
DELETE FROM t WHERE id % 3 = 0;
SELECT count(*), min(k), max(k) FROM t;
"
    )
}

fn sqlite(dir: &Path, quick: bool) -> anyhow::Result<String> {
    let rows = if quick { 150_000 } else { 1_500_000 };
    let sql = dir.join("sqlite.sql");
    std::fs::write(&sql, sqlite_script(rows))?;
    Ok(format!("sqlite3 :memory: < {}", sql.display()))
}

fn sort(dir: &Path, quick: bool) -> anyhow::Result<String> {
    let lines = if quick { 1_000_000 } else { 8_000_000 };
    let input = dir.join("sort.txt");
    let mut rng = fastrand::Rng::with_seed(7);
    let mut text = String::with_capacity(lines * 33);
    for _ in 0..lines {
        let _ = writeln!(text, "{:016x} {:015}", rng.u64(..), rng.u64(..1 << 48));
    }
    std::fs::write(&input, &text)?;
    // A buffer as large as the input: sort keeps it all in memory, in two threads.
    let buffer = text.len() / (1 << 20) + 16;
    // Sorted into a file, then summed: a sort that fails (or is killed) fails the run.
    Ok(format!(
        "LC_ALL=C sort --parallel=2 -S {buffer}M -T {dir} -o {dir}/sorted {input} && \
         cksum < {dir}/sorted",
        dir = dir.display(),
        input = input.display()
    ))
}

fn python_objects(dir: &Path, quick: bool) -> anyhow::Result<String> {
    let n = if quick { 300_000 } else { 3_000_000 };
    let script = dir.join("objects.py");
    std::fs::write(
        &script,
        "import sys
n = int(sys.argv[1])
d = {}
for i in range(n):
    d[i] = ('k%d' % i, [i, i * 2])
total = 0
for i in range(0, n, 3):
    total += d[i][1][1]
print(len(d), total)
",
    )?;
    Ok(format!("{} {} {n}", python3(), script.display()))
}

/// Debian's Python where it is installed, rather than whatever `python3` is first on the path:
/// a version manager's shim there (pyenv's is a bash script) starts several processes before
/// Python, each of which `netram run` sets up, which measures the shim rather than Python.
fn python3() -> &'static str {
    if Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    }
}

/// A Python script that builds a list of `argv[1]` tuples, forks, and lets the child sum them
/// (and change half) while the parent rewrites them all; it prints both sums.
pub const FORK_SCRIPT: &str = "import os, sys
n = int(sys.argv[1])
data = [('k%d' % i, i * 3) for i in range(n)]
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    s = sum(v for _, v in data)
    for i in range(0, n, 2):
        data[i] = ('x', 0)
    os.write(w, ('%d %d\\n' % (s, sum(v for _, v in data))).encode())
    os._exit(0)
os.close(w)
for i in range(n):
    data[i] = ('y', 1)
got = os.read(r, 100).decode().strip()
os.waitpid(pid, 0)
print('child', got, 'parent', sum(v for _, v in data))
";

fn python_fork(dir: &Path, quick: bool) -> anyhow::Result<String> {
    let n = if quick { 300_000 } else { 2_000_000 };
    let script = dir.join("fork.py");
    std::fs::write(&script, FORK_SCRIPT)?;
    Ok(format!("{} {} {n}", python3(), script.display()))
}

/// What one run measured.
struct Run {
    stdout: String,
    seconds: f64,
    peak_rss_kib: u64,
}

/// Runs `prefix... sh -c SCRIPT` in `dir`, bounded by `timeout` (killed by PID if it runs
/// over): its output, wall time and the peak resident memory of the largest process of the
/// run (code and stacks included), as `/usr/bin/time` reports it.
///
/// `/usr/bin/time` stands between, where it is installed, because a child started from this
/// process inherits its peak: `std::process::Command` starts it with `vfork`, and `exec`
/// records the peak of the memory it leaves — this process's, which held the generated input
/// (measured: GNU sort's 21 MiB reported as 37). Without it (a fresh machine, the demo) the
/// figure comes from `wait4` and may be that much too high.
fn timed(prefix: &[String], script: &str, dir: &Path, timeout: Duration) -> anyhow::Result<Run> {
    let time = Path::new("/usr/bin/time");
    let rss_file = dir.join(format!("rss-{}.txt", fastrand::u32(..)));
    let mut args: Vec<&str> = Vec::new();
    if time.exists() {
        args.extend([
            "/usr/bin/time",
            "-o",
            rss_file.to_str().expect("utf-8"),
            "-f",
            "%M",
        ]);
    }
    args.extend(prefix.iter().map(String::as_str));
    args.extend(["sh", "-c", script]);
    let mut child = Command::new(args[0])
        .args(&args[1..])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, ended as a whole when it runs over: a script's background
        // server or a program's children go with it.
        .process_group(0)
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot start {}: {e}", args[0]))?;
    // Read while it runs: a full pipe would stop it.
    let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let out = drain(child.stdout.take().map(|o| Box::new(o) as _));
    let err = drain(child.stderr.take().map(|e| Box::new(e) as _));
    let pid = child.id() as libc::pid_t;
    let started = Instant::now();
    let mut over = None;
    let (status, usage) = loop {
        let mut status = 0;
        // SAFETY: a zeroed rusage is valid plain data; wait4 fills it.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: waits for our own child, writing to the two locals.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            break (status, usage);
        }
        anyhow::ensure!(r == 0, "wait4: {}", std::io::Error::last_os_error());
        if over.is_none() {
            if started.elapsed() >= timeout {
                over = Some(format!("ran over {timeout:?}"));
            } else if crate::process::interrupted() {
                over = Some("interrupted".into());
            }
            if over.is_some() {
                // SAFETY: a signal to our own child's process group; the child is not reaped
                // yet, so the group's ID is still its.
                unsafe { libc::kill(-pid, libc::SIGKILL) };
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let seconds = started.elapsed().as_secs_f64();
    let (stdout, stderr) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    if let Some(why) = over {
        anyhow::bail!("{why}");
    }
    let status = std::process::ExitStatus::from_raw(status);
    let timed_rss = std::fs::read_to_string(&rss_file).ok();
    let _ = std::fs::remove_file(&rss_file);
    anyhow::ensure!(status.success(), "{status}: {}", stderr.trim());
    let peak_rss_kib = match timed_rss.as_deref().and_then(|t| t.lines().last()) {
        Some(line) => line.trim().parse()?,
        None => usage.ru_maxrss.max(0) as u64,
    };
    Ok(Run {
        stdout,
        seconds,
        peak_rss_kib,
    })
}

/// One program three ways: its figures, with `failed` listing every way that failed or whose
/// output differs from the all-local run's (no ratio is given for those). An all-local run
/// that fails is an error: nothing can be compared.
fn measure(
    p: &Program,
    opts: &Options,
    servers: &str,
    swap: Option<&Path>,
    dir: &Path,
) -> anyhow::Result<Value> {
    let script = (p.prepare)(dir, opts.quick)?;
    let timeout = Duration::from_secs(if opts.quick { 300 } else { 1800 });
    let say = |what: &str| {
        if opts.progress {
            eprintln!("programs: {} {what} ...", p.name);
        }
    };
    say("all local");
    let local = timed(&[], &script, dir, timeout)
        .map_err(|e| anyhow::anyhow!("the all-local run failed: {e:#}"))?;
    // A quarter of the peak, which includes code and stacks (not on netram): netram's budget
    // is a quarter of everything, the cgroup's the same.
    let quarter = (local.peak_rss_kib << 10) / 4;
    let mut v = json!({
        "what": p.what,
        "local": { "seconds": local.seconds, "peak_rss_kib": local.peak_rss_kib },
        "local_mem_bytes": quarter,
    });
    let mut failed = Vec::new();
    say("under netram run");
    let report = dir.join("netram-report.json");
    let prefix: Vec<String> = [
        opts.netram_exe.to_str().expect("utf-8"),
        "run",
        "-q",
        "--local-mem",
        &quarter.to_string(),
        "--servers",
        servers,
        "--report",
        report.to_str().expect("utf-8"),
        "--spill-dir",
        dir.to_str().expect("utf-8"),
        "--",
    ]
    .map(String::from)
    .to_vec();
    v["netram"] = match timed(&prefix, &script, dir, timeout) {
        Ok(run) => {
            let r: Value = serde_json::from_str(&std::fs::read_to_string(&report)?)?;
            let output_ok = run.stdout == local.stdout;
            if !output_ok {
                failed.push(format!(
                    "netram: output differs from the all-local run's ({:?} against {:?})",
                    run.stdout.trim(),
                    local.stdout.trim()
                ));
            }
            json!({
                "seconds": run.seconds,
                "peak_rss_kib": run.peak_rss_kib,
                "output_ok": output_ok,
                "faults": r["faults"],
                "fetches": r["fetches"],
                "prefetch_installed": r["prefetch_installed"],
                "pages_written_out": r["puts"],
                "evictions": r["evictions"],
                "forks": r["forks"],
                "child_faults": r["child_faults"],
                "child_prefetched": r["child_prefetched"],
                "child_drops": r["child_drops"],
                "processes": r["processes"],
                "program_peak_rss_kib": r["peak_rss_kib"],
            })
        }
        Err(e) => {
            failed.push(format!("netram: {e:#}"));
            json!({ "error": format!("{e:#}") })
        }
    };
    if swap.is_some() {
        say("under the kernel's swap to disk");
        // The kernel gets as much memory as netram's run held (a quarter, plus the code,
        // stacks and netram's own tables that its budget does not count).
        let limit = quarter.max(v["netram"]["peak_rss_kib"].as_u64().unwrap_or(0) << 10);
        let (k, why) = swap_run(&script, dir, limit, &local.stdout, timeout, opts.progress);
        failed.extend(why.map(|w| format!("swap_disk: {w}")));
        v["swap_disk"] = k;
        // The kernel's time swings with a few MiB: also a little below and above that size,
        // once each (each ratio is netram's time over that run's).
        let mut around = Vec::new();
        for mib in SWAP_AROUND_MIB.iter().filter(|_| opts.swap_around) {
            let size = limit.saturating_add_signed(*mib << 20).max(1 << 20);
            say(&format!(
                "under the kernel's swap to disk in {} MiB",
                size >> 20
            ));
            let (k, why) = swap_once(&script, dir, size, &local.stdout, timeout);
            failed.extend(why.map(|w| format!("swap_disk at {} MiB: {w}", size >> 20)));
            around.push(k);
        }
        if opts.swap_around {
            v["swap_disk_around"] = json!(around);
        }
    }
    // Ratios only between runs that completed with the right output.
    let verified = |w: &str| w == "local" || v[w]["output_ok"].as_bool() == Some(true);
    let ratio = |a: &str, b: &str| {
        (verified(a) && verified(b))
            .then(|| Some(v[a]["seconds"].as_f64()? / v[b]["seconds"].as_f64()?.max(0.01)))
            .flatten()
    };
    let (over_local, over_swap) = (ratio("netram", "local"), ratio("netram", "swap_disk"));
    let around: Option<Vec<Option<f64>>> = v["swap_disk_around"].as_array().map(|runs| {
        runs.iter()
            .map(|k| {
                (verified("netram") && k["output_ok"].as_bool() == Some(true))
                    .then(|| {
                        Some(v["netram"]["seconds"].as_f64()? / k["seconds"].as_f64()?.max(0.01))
                    })
                    .flatten()
            })
            .collect()
    });
    v["netram_over_local"] = json!(over_local);
    v["netram_over_swap_disk"] = json!(over_swap);
    if let Some(ratios) = around {
        v["netram_over_swap_disk_around"] = json!(ratios);
    }
    v["failed"] = json!(failed);
    Ok(v)
}

/// The other sizes at which the kernel's swap runs each program, in MiB beside the size of
/// netram's run (issue 38: its time swings with a few MiB, so one size says little).
const SWAP_AROUND_MIB: [i64; 2] = [-4, 4];

/// The script in a memory cgroup of `limit` bytes with the swap file on. When the kernel's
/// OOM killer ends it, that is the kernel's result at that size (recorded in
/// `oom_killed_at_bytes`) and it is tried again with more memory; if every size is killed,
/// that is its result. Any other failure, or an output that differs from `expected`, is a
/// failure of the run (the second value says why).
fn swap_run(
    script: &str,
    dir: &Path,
    limit: u64,
    expected: &str,
    timeout: Duration,
    progress: bool,
) -> (Value, Option<String>) {
    let hierarchy = match crate::cgroup::Hierarchy::find() {
        Ok(h) => h,
        Err(why) => return (json!({ "error": why }), Some(why)),
    };
    let mut killed_at = Vec::new();
    for eighths in crate::uffd::SWAP_LIMITS_EIGHTHS {
        let size = limit / 8 * eighths;
        match swap_try(&hierarchy, script, dir, size, expected, timeout) {
            SwapTry::Ran(mut v, why) => {
                v["oom_killed_at_bytes"] = json!(killed_at);
                return (v, why);
            }
            SwapTry::OomKilled => {
                if progress {
                    eprintln!(
                        "  the kernel's OOM killer ended it at {} MiB; again with more",
                        size >> 20
                    );
                }
                killed_at.push(size);
            }
            SwapTry::Failed(why) => {
                return (
                    json!({ "error": why, "cgroup_limit_bytes": size, "oom_killed_at_bytes": killed_at }),
                    Some(why),
                );
            }
        }
    }
    // The kernel's own result: it could not run the program in any of these sizes.
    (
        json!({ "oom_killed_at_bytes": killed_at, "output_ok": false }),
        None,
    )
}

/// The script once in a memory cgroup of exactly `size` bytes with the swap file on (a size
/// beside netram's peak, `SWAP_AROUND_MIB`): an OOM kill is the kernel's result at that size
/// (`oom_killed`), not a failure of the run, and is not tried again with more.
fn swap_once(
    script: &str,
    dir: &Path,
    size: u64,
    expected: &str,
    timeout: Duration,
) -> (Value, Option<String>) {
    let hierarchy = match crate::cgroup::Hierarchy::find() {
        Ok(h) => h,
        Err(why) => return (json!({ "error": why }), Some(why)),
    };
    match swap_try(&hierarchy, script, dir, size, expected, timeout) {
        SwapTry::Ran(v, why) => (v, why),
        SwapTry::OomKilled => (
            json!({ "cgroup_limit_bytes": size, "oom_killed": true, "output_ok": false }),
            None,
        ),
        SwapTry::Failed(why) => (
            json!({ "error": why, "cgroup_limit_bytes": size }),
            Some(why),
        ),
    }
}

/// How one run of a script under the kernel's swap ended.
enum SwapTry {
    /// It ran: its figures, and why it counts as failed (an output that differs), if it does.
    Ran(Value, Option<String>),
    /// The kernel's OOM killer ended it.
    OomKilled,
    /// It could not be run, or failed otherwise.
    Failed(String),
}

/// The script once in a new memory cgroup of `size` bytes (of `hierarchy`), its output
/// checked against `expected`.
fn swap_try(
    hierarchy: &crate::cgroup::Hierarchy,
    script: &str,
    dir: &Path,
    size: u64,
    expected: &str,
    timeout: Duration,
) -> SwapTry {
    let name = format!(
        "netram-bench-programs-{}-{}",
        std::process::id(),
        fastrand::u32(..)
    );
    let cg = match hierarchy.create(&name, Some(size)) {
        Ok(c) => c,
        Err(e) => return SwapTry::Failed(format!("cannot make a memory cgroup: {e}")),
    };
    let enter = ["sh", "-c", &cg.enter_then("exec \"$@\""), "sh"].map(String::from);
    match timed(&enter, script, dir, timeout) {
        Ok(run) => {
            let ok = run.stdout == expected;
            let v = json!({
                "seconds": run.seconds,
                "peak_rss_kib": run.peak_rss_kib,
                "output_ok": ok,
                "cgroup_limit_bytes": size,
            });
            let why = (!ok).then(|| {
                format!(
                    "output differs from the all-local run's ({:?} against {:?})",
                    run.stdout.trim(),
                    expected.trim()
                )
            });
            SwapTry::Ran(v, why)
        }
        Err(_) if cg.oom_kills() > 0 => SwapTry::OomKilled,
        Err(e) => SwapTry::Failed(format!("{e:#}")),
    }
}

/// What program `name` stands for (its line in the report), and the commands it needs that
/// this machine lacks; `None` for a name that is not one of the programs.
pub fn describe(name: &str) -> Option<(&'static str, Vec<&'static str>)> {
    let p = PROGRAMS.iter().find(|p| p.name == name)?;
    Some((
        p.what,
        p.tools.iter().copied().filter(|t| !have(t)).collect(),
    ))
}

/// One program (by name: `sort`, …) three ways on `servers`, as the demo runs GNU sort: its
/// figures, as in `programs.json`. As root it sets up (and takes down) a swap file of its own
/// for the kernel's way; without root that way is left out.
pub fn run_one(name: &str, quick: bool, netram_exe: &Path, servers: &str) -> anyhow::Result<Value> {
    let p = PROGRAMS
        .iter()
        .find(|p| p.name == name)
        .ok_or_else(|| anyhow::anyhow!("no program {name}"))?;
    let missing: Vec<&str> = p.tools.iter().copied().filter(|t| !have(t)).collect();
    anyhow::ensure!(missing.is_empty(), "not installed: {}", missing.join(", "));
    let scratch = tempfile_dir("netram-program")?;
    let dir = scratch.path().to_path_buf();
    let result = (|| {
        let swap_dev = match crate::uffd::Way::SwapDisk.unavailable() {
            Some(_) => None,
            None => Some(setup("disk", 1 << 30, netram_exe, &dir)?),
        };
        let swap_path = swap_dev.as_ref().and_then(|d| d.path().map(PathBuf::from));
        let opts = Options {
            quick,
            out: dir.clone(),
            netram_exe: netram_exe.into(),
            only: Vec::new(),
            progress: false,
            swap_around: false,
        };
        let pdir = dir.join(name);
        std::fs::create_dir_all(&pdir)?;
        measure(p, &opts, servers, swap_path.as_deref(), &pdir)
    })();
    result
}

pub fn run(opts: &Options) -> anyhow::Result<crate::Outcome> {
    std::fs::create_dir_all(&opts.out)?;
    crate::process::catch_interrupts()?;
    let scratch = tempfile_dir("netram-bench-programs")?;
    let dir = scratch.path().to_path_buf();
    let (mut skipped, mut failed) = (Vec::new(), Vec::new());
    let capacity = if opts.quick { "1G" } else { "4G" };
    let (servers, list) = start_servers(&opts.netram_exe, capacity, false)?;
    // The swap file, as root with a memory cgroup: the kernel's paging to the local disk.
    let swap_dev = match crate::uffd::Way::SwapDisk.unavailable() {
        Some(why) => {
            skipped.push(format!("swap_disk: {why}"));
            None
        }
        None => Some(setup(
            "disk",
            if opts.quick { 1 << 30 } else { 4 << 30 },
            &opts.netram_exe,
            &dir,
        )?),
    };
    let swap_path = swap_dev.as_ref().and_then(|d| d.path().map(PathBuf::from));
    let mut results = serde_json::Map::new();
    for p in PROGRAMS {
        if !opts.only.is_empty() && !opts.only.iter().any(|o| o == p.name) {
            continue;
        }
        let missing: Vec<&str> = p.tools.iter().copied().filter(|t| !have(t)).collect();
        if !missing.is_empty() {
            skipped.push(format!("{}: not installed: {}", p.name, missing.join(", ")));
            continue;
        }
        let pdir = dir.join(p.name);
        std::fs::create_dir_all(&pdir)?;
        match measure(p, opts, &list, swap_path.as_deref(), &pdir) {
            Ok(v) => {
                for why in v["failed"].as_array().into_iter().flatten() {
                    failed.push(format!("{}: {}", p.name, why.as_str().unwrap_or_default()));
                }
                results.insert(p.name.into(), v);
            }
            Err(_) if crate::process::interrupted() => anyhow::bail!("interrupted"),
            Err(e) => failed.push(format!("{}: {e:#}", p.name)),
        }
        let _ = std::fs::remove_dir_all(&pdir);
    }
    drop(swap_dev);
    drop(servers);
    let machine = Machine::describe();
    let over_swap: Vec<f64> = results
        .values()
        .filter_map(|v| v["netram_over_swap_disk"].as_f64())
        .collect();
    let doc = json!({
        "bench": "programs",
        "machine": machine,
        "machine_line": machine.one_line(),
        "quick": opts.quick,
        // Over the programs the kernel's swap ran with the right output (issue 38's target:
        // at most 0.6).
        "geomean_netram_over_swap_disk": geomean(&over_swap),
        "programs_over_swap_disk": over_swap.len(),
        "programs": results,
        "skipped": skipped,
        "failed": failed,
    });
    std::fs::write(
        opts.out.join("programs.json"),
        serde_json::to_string_pretty(&doc)?,
    )?;
    let panels: Vec<crate::uffd::Panel> = results.iter().map(|(n, v)| panel(n, v)).collect();
    if let Err(e) = crate::uffd::plot_panels(
        "bench programs: seconds per run, outputs checked (lower is better; netram in blue)",
        &panels,
        &opts.out.join("programs.svg"),
    ) {
        eprintln!("programs: no plot: {e:#}");
    }
    let md = markdown(&doc);
    std::fs::write(opts.out.join("programs.md"), &md)?;
    Ok(crate::Outcome { report: md, failed })
}

/// The geometric mean of `xs` (`None` for none).
fn geomean(xs: &[f64]) -> Option<f64> {
    (!xs.is_empty()).then(|| (xs.iter().map(|x| x.ln()).sum::<f64>() / xs.len() as f64).exp())
}

/// A program's panel in a plot: the seconds of its run all local, and of the runs under
/// netram and the kernel's swap whose output was right (`v`: one program's results, as
/// `programs.json` and `demo.json` hold them).
pub fn panel(name: &str, v: &Value) -> crate::uffd::Panel {
    let bars = [
        ("local", "all local"),
        ("netram", "netram run"),
        ("swap_disk", "kernel swap"),
    ]
    .iter()
    .filter(|(w, _)| *w == "local" || v[*w]["output_ok"].as_bool() == Some(true))
    .filter_map(|(w, label)| Some((label.to_string(), v[*w]["seconds"].as_f64()?)))
    .collect();
    (name.to_string(), "seconds (log scale)".to_string(), bars)
}

fn markdown(doc: &Value) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# netram bench programs\n");
    let _ = writeln!(
        s,
        "{}\n\nEach program all in local memory, under `netram run` with a quarter of its peak \
         resident memory local, and under the kernel's swap to a file on the local disk in a \
         memory cgroup of that size; outputs checked against the all-local run's.\n",
        doc["machine_line"].as_str().unwrap_or_default()
    );
    let _ = writeln!(
        s,
        "| program | local s | peak MiB | netram s | peak MiB | faults | pages out | output | swap s | peak MiB | output | netram/local | netram/swap |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let empty = serde_json::Map::new();
    for (name, v) in doc["programs"].as_object().unwrap_or(&empty) {
        let f = |w: &str, k: &str| {
            v[w][k]
                .as_f64()
                .map_or("—".to_string(), |x| format!("{x:.1}"))
        };
        let mib = |w: &str| {
            v[w]["peak_rss_kib"]
                .as_u64()
                .map_or("—".to_string(), |k| (k / 1024).to_string())
        };
        let ok = |w: &str| {
            if let Some(e) = v[w]["error"].as_str() {
                return format!("**failed**: {}", e.lines().next().unwrap_or(""));
            }
            let killed: Vec<String> = v[w]["oom_killed_at_bytes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|b| Some(format!("{} MiB", b.as_u64()? >> 20)))
                .collect();
            let oom = if killed.is_empty() {
                String::new()
            } else {
                format!(" (OOM-killed at {})", killed.join(", "))
            };
            match v[w]["output_ok"].as_bool() {
                Some(true) if !killed.is_empty() => format!(
                    "same, in {} MiB{oom}",
                    v[w]["cgroup_limit_bytes"].as_u64().unwrap_or(0) >> 20
                ),
                Some(true) => format!("same{oom}"),
                Some(false) if v[w]["seconds"].is_null() => format!("no result{oom}"),
                Some(false) => "**differs**".to_string(),
                None => "—".to_string(),
            }
        };
        let r = |k: &str| v[k].as_f64().map_or("—".to_string(), |x| format!("{x:.2}"));
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            f("local", "seconds"),
            mib("local"),
            f("netram", "seconds"),
            mib("netram"),
            v["netram"]["faults"]
                .as_u64()
                .map_or("—".into(), |x| x.to_string()),
            v["netram"]["pages_written_out"]
                .as_u64()
                .map_or("—".into(), |x| x.to_string()),
            ok("netram"),
            f("swap_disk", "seconds"),
            mib("swap_disk"),
            ok("swap_disk"),
            r("netram_over_local"),
            // The kernel given more memory than netram's run, after OOM kills: said so.
            match v["swap_disk"]["oom_killed_at_bytes"].as_array() {
                Some(k) if !k.is_empty() && v["netram_over_swap_disk"].is_number() => format!(
                    "{} (the kernel with more memory)",
                    r("netram_over_swap_disk")
                ),
                _ => r("netram_over_swap_disk"),
            },
        );
    }
    if let Some(g) = doc["geomean_netram_over_swap_disk"].as_f64() {
        let _ = writeln!(
            s,
            "\nGeometric mean of netram/swap over the {} programs the kernel ran: {g:.2} \
             (target: at most 0.6).",
            doc["programs_over_swap_disk"]
        );
    }
    let around: Vec<String> = doc["programs"]
        .as_object()
        .unwrap_or(&empty)
        .iter()
        .filter_map(|(name, v)| {
            let runs = v["swap_disk_around"].as_array()?;
            let ratios = v["netram_over_swap_disk_around"].as_array();
            let cells: Vec<String> = runs
                .iter()
                .enumerate()
                .map(|(i, k)| {
                    let mib = k["cgroup_limit_bytes"].as_u64().unwrap_or(0) >> 20;
                    let ratio = ratios
                        .and_then(|r| r.get(i)?.as_f64())
                        .map_or(String::new(), |x| format!(", netram/swap {x:.2}"));
                    match (k["seconds"].as_f64(), k["oom_killed"].as_bool()) {
                        (_, Some(true)) => format!("{mib} MiB: OOM-killed"),
                        (Some(t), _) if k["output_ok"].as_bool() == Some(true) => {
                            format!("{mib} MiB: {t:.1} s{ratio}")
                        }
                        (Some(_), _) => format!("{mib} MiB: **output differs**"),
                        _ => format!("{mib} MiB: **failed**"),
                    }
                })
                .collect();
            Some(format!("| {name} | {} |", cells.join(" · ")))
        })
        .collect();
    if !around.is_empty() {
        let _ = writeln!(
            s,
            "\nThe kernel's swap beside that size (its time swings with a few MiB), once each:\n\n\
             | program | runs |\n|---|---|\n{}",
            around.join("\n")
        );
    }
    let failed: Vec<String> = doc["failed"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| Some(f.as_str()?.to_string()))
        .collect();
    s += &crate::failed_section(&failed);
    let skipped = doc["skipped"].as_array().cloned().unwrap_or_default();
    if !skipped.is_empty() {
        let _ = writeln!(s, "\nNot run:\n");
        for k in skipped {
            let _ = writeln!(s, "- {}", k.as_str().unwrap_or_default());
        }
    }
    let _ = writeln!(
        s,
        "\nPeak resident memory is the largest process's, code and stacks included (a forked \
         child is held to `--local-mem` as its parent is)."
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_geometric_mean_is_of_the_ratios_given() {
        assert_eq!(geomean(&[]), None);
        let g = geomean(&[0.5, 2.0, 4.0]).unwrap();
        assert!((g - 4f64.powf(1.0 / 3.0)).abs() < 1e-12, "{g}");
    }

    /// The report says every size the kernel ran at: a run, an OOM kill, a wrong output.
    #[test]
    fn the_report_gives_the_kernel_at_every_size() {
        let doc = json!({
            "machine_line": "vm",
            "geomean_netram_over_swap_disk": 1.5,
            "programs_over_swap_disk": 1,
            "programs": { "sort": {
                "local": { "seconds": 1.0, "peak_rss_kib": 4096 },
                "netram": { "seconds": 3.0, "output_ok": true },
                "swap_disk": { "seconds": 2.0, "output_ok": true, "oom_killed_at_bytes": [] },
                "netram_over_local": 3.0,
                "netram_over_swap_disk": 1.5,
                "swap_disk_around": [
                    { "cgroup_limit_bytes": 60u64 << 20, "oom_killed": true, "output_ok": false },
                    { "cgroup_limit_bytes": 68u64 << 20, "seconds": 1.0, "output_ok": true },
                    { "cgroup_limit_bytes": 72u64 << 20, "seconds": 1.0, "output_ok": false },
                ],
                "netram_over_swap_disk_around": [null, 3.0, null],
            }},
            "failed": [],
            "skipped": [],
        });
        let md = markdown(&doc);
        assert!(
            md.contains("over the 1 programs the kernel ran: 1.50"),
            "{md}"
        );
        assert!(
            md.contains(
                "| sort | 60 MiB: OOM-killed · 68 MiB: 1.0 s, netram/swap 3.00 · 72 MiB: \
                 **output differs** |"
            ),
            "{md}"
        );
    }
}
