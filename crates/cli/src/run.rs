//! `netram run`: an unmodified program with its heap on cluster memory, through
//! the preload library (`crates/preload`), and a summary of what netram did for it.

use anyhow::{bail, Context};
use netram_client::env::{var, RunEnv};
use netram_pager::{Backing, Scheme};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    security: crate::SecurityArgs,
    /// Local memory for the program's large allocations, e.g. 256M; the rest of them lives on
    /// the page servers (or the local disk with --backing disk).
    #[arg(long, value_name = "SIZE")]
    local_mem: String,
    /// Page servers, comma-separated (`netram serve` addresses) [default: $NETRAM_SERVERS, or
    /// else every other live member the daemon on this machine knows, asked on
    /// its control socket: $NETRAM_DAEMON or /run/netram/7077.sock]. Not needed with
    /// --backing disk.
    #[arg(long, value_delimiter = ',')]
    servers: Vec<String>,
    /// Where pages that do not fit locally go: cluster (the local disk only when the cluster
    /// is full), disk (local disk only), cluster+disk (a copy on disk too).
    #[arg(long, default_value = "cluster")]
    backing: Backing,
    /// How its pages survive the death of servers: none, mirror:N, parity:N or rs:K+M (reads
    /// of pages whose server died are served from another copy, or decoded from their stripe
    /// or parity group, and the lost copies are rebuilt on the survivors in the background,
    /// at a bounded pace, while the program runs).
    #[arg(long, default_value = "none")]
    redundancy: Scheme,
    /// The most the program can keep on netram at once (the size of its region) [default: 8
    /// times --local-mem, at least 1G]. Large allocations beyond it stay in local memory.
    #[arg(long, value_name = "SIZE")]
    max_mem: Option<String>,
    /// Local memory for each forked child's copy of the heap, or `unlimited` [default: as
    /// --local-mem]. A child (a server's background save, a worker) is served its memory from
    /// its parent's pages and held to this, its oldest pages dropped; `unlimited` lets it keep
    /// every page it touches, which is faster for a child that reads all its memory once
    /// (Redis's BGSAVE of 70 MiB with 16M local: 1.1 s and 78 MiB resident unlimited, 6.3 s
    /// and 30 MiB held).
    #[arg(long, value_name = "SIZE|unlimited")]
    child_mem: Option<String>,
    /// Allocations (malloc family, anonymous mmap) of at least this size go to netram;
    /// smaller ones stay in the C library's heap, in local memory [default: 0 (every
    /// allocation) as root or for a user who may open /dev/userfaultfd; 128K for any other
    /// ordinary user, whose userfaultfd can neither serve the faults of system calls on small
    /// buffers nor follow forks]. File mappings, shared memory and stacks always stay as they
    /// are.
    #[arg(long, value_name = "SIZE")]
    threshold: Option<String>,
    /// Keep CPUs out of deep idle while the program runs (PM QoS; needs root) and poll for
    /// faults and replies briefly before sleeping: page faults are served several times faster
    /// on machines whose idle CPUs sleep deeply (3.2× for Python paging its objects, on a
    /// 2-vCPU VM), for some CPU time and power [default: on as root, where the PM QoS request
    /// can be held; off otherwise].
    #[arg(long, overrides_with = "no_low_latency")]
    low_latency: bool,
    /// Do not keep CPUs awake nor poll (see --low-latency): for machines where power matters
    /// more than the speed of paging.
    #[arg(long, overrides_with = "low_latency")]
    no_low_latency: bool,
    /// Compress pages before they are sealed when that pays over a link of this many Mbit/s:
    /// a page goes as its LZ4 block when the wire time saved exceeds the codec's (measured
    /// at start; over 1000 Mbit/s a page must shrink by ~170 bytes, over 100 Mbit/s by ~17).
    /// Servers then see how long each compressed page is. 0: never [default: 0].
    #[arg(long, value_name = "MBPS", default_value_t = 0)]
    compress_link_mbps: u32,
    /// Write netram's counters, summed over the program's processes, to this JSON file.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Print no summary.
    #[arg(long, short)]
    quiet: bool,
    /// Directory of the spill file [default: the temp dir].
    #[arg(long)]
    spill_dir: Option<PathBuf>,
    /// The program and its arguments (after `--`).
    #[arg(trailing_var_arg = true, required = true, value_name = "PROGRAM")]
    command: Vec<String>,
}

/// Where `libnetram_preload.so` is: `$NETRAM_PRELOAD`, or next to this executable (cargo puts
/// it in `target/<profile>/` when the workspace is built and in `target/<profile>/deps/` when
/// only this binary is; the newest wins).
pub fn preload_library() -> anyhow::Result<PathBuf> {
    library("libnetram_preload.so", "NETRAM_PRELOAD", "netram-preload")
}

/// Where the library `name` of crate `package` is: `$var`, or next to this executable (see
/// [`preload_library`]).
pub fn library(name: &str, var: &str, package: &str) -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("{var}={}: no such file", p.display());
        }
        return Ok(p);
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("the executable has no directory")?;
    let candidates = [
        dir.join(name),
        dir.join("deps").join(name),
        dir.join("../lib/netram").join(name),
    ];
    candidates
        .iter()
        .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p.clone())
        .with_context(|| {
            format!(
                "{name} not found (looked in {}, {} and {}). In the netram source tree, \
                 `cargo build --release` builds it next to target/release/netram; `cargo \
                 install` installs binaries only, so build it there with `cargo build \
                 --release -p {package}` and copy target/release/{name} to {}, or set \
                 {var} to its path",
                candidates[0].display(),
                candidates[1].display(),
                candidates[2].display(),
                candidates[2].display()
            )
        })
}

/// Runs the program; returns its exit status as this process's (128 + signal if killed).
pub fn run(args: RunArgs) -> anyhow::Result<i32> {
    let local_mem = crate::size("--local-mem", &args.local_mem)?;
    if local_mem < 4096 {
        bail!("--local-mem must be at least one page (4K)");
    }
    let threshold = args
        .threshold
        .as_deref()
        .map(|t| crate::size("--threshold", t))
        .transpose()?;
    let max_mem = args
        .max_mem
        .as_deref()
        .map(|m| crate::size("--max-mem", m))
        .transpose()?;
    let child_mem = match args.child_mem.as_deref() {
        None => None,
        Some("unlimited") => Some(netram_client::env::CHILD_MEM_UNLIMITED),
        Some(m) => {
            let m = crate::size("--child-mem", m)?;
            if m < 4096 {
                bail!("--child-mem must be at least one page (4K), or unlimited");
            }
            Some(m)
        }
    };
    let servers: Vec<String> = if args.servers.is_empty() {
        std::env::var(var::SERVERS)
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    } else {
        args.servers.clone()
    };
    // No servers given: the local daemon's members, resolved here so that the program and
    // its children get one list and a missing daemon is said before the program starts.
    let servers = if servers.is_empty() && args.backing != Backing::Disk {
        let daemon = netram_client::discover::daemon_addr();
        let list = netram_client::discover::members(&daemon, Duration::from_secs(2)).with_context(
            || {
                format!(
                    "no --servers (or NETRAM_SERVERS) given with --backing {}",
                    args.backing
                )
            },
        )?;
        let found = netram_client::discover::servers(&list);
        if found.is_empty() {
            bail!("the local daemon at {daemon} knows no other live member of the cluster yet");
        }
        found
    } else {
        servers
    };
    let lib = preload_library()?;
    let reports = tempdir()?;
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(old) if !old.is_empty() => format!("{}:{old}", lib.display()),
        _ => lib.display().to_string(),
    };
    // SAFETY: geteuid only reads this process's effective user id.
    let root = unsafe { libc::geteuid() } == 0;
    let low_latency = !args.no_low_latency && (args.low_latency || root);
    // What the preload library reads (`netram_client::env`: one definition for both sides).
    let env = RunEnv {
        local_mem: Some(local_mem),
        servers,
        backing: Some(args.backing),
        redundancy: Some(args.redundancy),
        max_mem,
        child_mem,
        threshold,
        // The program's pager polls its sockets and its fault handler polls for faults.
        low_latency,
        spill_dir: args.spill_dir.clone(),
        samples: None,
        report: Some(reports.0.clone()),
        required: true,
        // Checked here, so that a missing credential fails before the program starts; the
        // program's pager loads them again from the same directory.
        tls: match (args.backing, &args.security) {
            (netram_pager::Backing::Disk, _) => None,
            (_, s) => {
                s.security()?;
                s.tls
                    .clone()
                    .or_else(|| (!s.insecure).then(|| netram_client::open::DEFAULT_TLS_DIR.into()))
            }
        },
        insecure: args.security.insecure,
        compress_link_mbps: args.compress_link_mbps,
    };
    if let Some(why) = cannot_attach(&args.command[0]) {
        bail!(
            "{} cannot run on netram: {why}; netram run reaches a program through the dynamic \
             loader (LD_PRELOAD)",
            args.command[0]
        );
    }
    let mut cmd = Command::new(&args.command[0]);
    cmd.args(&args.command[1..])
        .env("LD_PRELOAD", preload)
        .envs(env.to_vars());
    // The program's own PM QoS request would do, but it would be the preload library's; held
    // here it covers every process of the program.
    let qos = if low_latency {
        let q = netram_client::latency::PmQos::hold();
        if q.is_none() && args.low_latency {
            eprintln!("netram: --low-latency: cannot hold the PM QoS request (needs root)");
        }
        q
    } else {
        None
    };
    // Ctrl-C reaches the program (same process group); this process waits for it to end.
    let interrupted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, interrupted.clone())?;
    }
    let started = std::time::Instant::now();
    let status = cmd
        .status()
        .with_context(|| format!("cannot run {}", args.command[0]))?;
    let elapsed = started.elapsed();
    let peak_rss_kib = peak_rss_of_children_kib();
    use std::os::unix::process::ExitStatusExt;
    let code = status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    if code == 70 && status.code() == Some(70) && read_reports(&reports.0)?.1 == 0 {
        // The preload library refuses to run the program without netram (NETRAM_REQUIRED)
        // and has said why on stderr.
        bail!("netram could not start for {}", args.command[0]);
    }
    let (totals, processes, attached) = read_reports(&reports.0)?;
    if attached == 0 {
        // The loader ignored the library (it could not be loaded, or the program would not
        // take it): the program ran, all of it in local memory. Not a success of netram's.
        bail!(
            "netram never attached to {}, which ran entirely in local memory and {} (the \
             dynamic loader did not load {}: see its message above)",
            args.command[0],
            match status.code() {
                Some(c) => format!("exited with {c}"),
                None => "was killed by a signal".into(),
            },
            lib.display()
        );
    }
    // "exited with 135" says little: name the signal, as a shell would.
    let ended = match status.signal() {
        Some(sig) => {
            let name = match sig {
                signal_hook::consts::SIGBUS => " (SIGBUS: a page could not be read)",
                signal_hook::consts::SIGSEGV => " (SIGSEGV)",
                signal_hook::consts::SIGKILL => " (SIGKILL)",
                signal_hook::consts::SIGTERM => " (SIGTERM)",
                signal_hook::consts::SIGABRT => " (SIGABRT)",
                signal_hook::consts::SIGINT => " (SIGINT)",
                _ => "",
            };
            format!("was killed by signal {sig}{name}")
        }
        None => format!("exited with {code}"),
    };
    if let Some(path) = &args.report {
        let mut doc = totals.clone();
        doc.insert("processes".into(), processes.into());
        doc.insert("seconds".into(), elapsed.as_secs_f64().into());
        doc.insert("exit_code".into(), code.into());
        doc.insert("peak_rss_kib".into(), peak_rss_kib.into());
        doc.insert("low_latency".into(), low_latency.into());
        doc.insert("pm_qos".into(), qos.is_some().into());
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if !args.quiet && processes == 0 {
        eprintln!(
            "netram: {} {ended} after {:.1} s (no process reported netram's \
             counters: none reached exit(3) normally)",
            args.command[0],
            elapsed.as_secs_f64()
        );
    } else if !args.quiet {
        let g = |k: &str| totals.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
        eprintln!(
            "netram: {} {ended} after {:.1} s, at most {} MiB resident; {} process(es) on \
             netram: {} faults ({} fetched, {} zero-filled, {} sampled back), {} evictions \
             ({} clean), prefetched {} ({} used), {} pages stored remotely, {} spilled to disk",
            args.command[0],
            elapsed.as_secs_f64(),
            peak_rss_kib / 1024,
            processes,
            g("faults"),
            g("fetches"),
            g("zero_fills"),
            g("sample_faults"),
            g("evictions"),
            g("evicted_clean"),
            g("prefetched"),
            g("prefetch_hits"),
            g("puts"),
            g("spills"),
        );
        if g("clean_copies_dropped") > 0 {
            eprintln!(
                "netram: the full cluster dropped older pages for newer ones (cluster+disk: \
                 GMS's clean pages); {} of them were read back from the local disk",
                g("clean_copies_dropped"),
            );
        }
        if g("servers_dead") > 0 || g("pages_unrecoverable") > 0 {
            eprintln!(
                "netram: {} server(s) lost on the way: {} reads served from another copy, {} \
                 decoded from a stripe or parity group, {} pages rebuilt, {} lost for good",
                g("servers_dead"),
                g("reads_from_other_copy"),
                g("degraded_reads"),
                g("pages_rebuilt"),
                g("pages_unrecoverable"),
            );
        }
        if g("forks") > 0 {
            eprintln!(
                "netram: {} forked child(ren) served: {} faults, {} pages fetched ahead of \
                 them, {} pages dropped to stay within the budget (at most {} resident), {} \
                 pages stored as a child's own",
                g("forks"),
                g("child_faults"),
                g("child_prefetched"),
                g("child_drops"),
                g("child_peak_resident_pages"),
                g("child_private_pages"),
            );
        }
    }
    Ok(code)
}

/// The peak resident memory of the largest of the processes waited for (the program, or the
/// largest of its children that it waited for), as `getrusage` counts it: everything mapped,
/// code and stacks included.
fn peak_rss_of_children_kib() -> u64 {
    // SAFETY: getrusage writes one struct rusage, which is plain data.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut u);
        u
    };
    usage.ru_maxrss.max(0) as u64
}

/// The per-process reports summed, and how many processes wrote one.
/// The processes' reports summed, how many reported, and how many the library attached to
/// (each leaves an `attached-PID` mark when it starts, `crates/preload`).
fn read_reports(
    dir: &Path,
) -> anyhow::Result<(serde_json::Map<String, serde_json::Value>, u64, u64)> {
    let mut totals = serde_json::Map::new();
    let mut n = 0;
    let mut attached = 0;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path
            .file_name()
            .is_some_and(|f| f.to_string_lossy().starts_with("attached-"))
        {
            attached += 1;
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let Ok(serde_json::Value::Object(m)) = serde_json::from_str(&text) else {
            eprintln!("netram: ignoring a malformed report {}", path.display());
            continue;
        };
        n += 1;
        for (k, v) in m {
            if k == "pid" {
                continue;
            }
            let (was, v) = (
                totals.get(&k).and_then(|t| t.as_u64()).unwrap_or(0),
                v.as_u64().unwrap_or(0),
            );
            // Peaks are the largest of any process, the rest add up.
            let total = if k.contains("peak") {
                was.max(v)
            } else {
                was + v
            };
            totals.insert(k, total.into());
        }
    }
    Ok((totals, n, attached))
}

/// Why the program at `program` (a path, or a name on PATH) could not have netram's library
/// loaded into it, if it can tell: a static ELF (no interpreter: no dynamic loader reads
/// LD_PRELOAD), or a set-user-ID or set-group-ID program run by another user than root (the
/// loader ignores LD_PRELOAD in secure mode). Scripts and what it cannot read are let through
/// (the attach mark tells after the run).
pub fn cannot_attach(program: &str) -> Option<String> {
    use object::read::elf::{FileHeader, ProgramHeader};
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let path = if program.contains('/') {
        PathBuf::from(program)
    } else {
        std::env::split_paths(&std::env::var_os("PATH")?)
            .map(|d| d.join(program))
            .find(|p| p.is_file())?
    };
    let meta = std::fs::metadata(&path).ok()?;
    let mode = meta.permissions().mode();
    // SAFETY: geteuid only reads this process's effective user id.
    let euid = unsafe { libc::geteuid() };
    if mode & 0o6000 != 0 && euid != 0 && meta.uid() != euid {
        return Some(format!("{} is set-user-ID or set-group-ID", path.display()));
    }
    // The program headers follow the ELF header in every binary a linker writes.
    let mut head = Vec::with_capacity(64 << 10);
    std::io::Read::read_to_end(
        &mut std::io::Read::take(std::fs::File::open(&path).ok()?, 64 << 10),
        &mut head,
    )
    .ok()?;
    fn interp<H: FileHeader>(data: &[u8]) -> Option<bool> {
        let h = H::parse(data).ok()?;
        let e = h.endian().ok()?;
        let phs = h.program_headers(e, data).ok()?;
        Some(phs.iter().any(|ph| ph.p_type(e) == object::elf::PT_INTERP))
    }
    let has_interp = match object::FileKind::parse(&head[..]).ok()? {
        object::FileKind::Elf64 => interp::<object::elf::FileHeader64<object::Endianness>>(&head),
        object::FileKind::Elf32 => interp::<object::elf::FileHeader32<object::Endianness>>(&head),
        _ => None,
    }?;
    (!has_interp).then(|| format!("{} is statically linked", path.display()))
}

/// Removes the report directories of `netram run`s of this user that ended without removing
/// their own (killed with SIGKILL, or by a machine's OOM killer): `netram-run-PID-N` in `tmp`
/// whose PID is no process. A PID reused by another process keeps its directory until that
/// one ends too; nothing of another user's is touched.
fn sweep_stale_tempdirs(tmp: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    // SAFETY: geteuid only reads this process's effective user id.
    let me = unsafe { libc::geteuid() };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("netram-run-"))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<i32>().ok())
        else {
            continue;
        };
        let ours = e.metadata().is_ok_and(|m| m.is_dir() && m.uid() == me);
        // SAFETY: kill with signal 0 sends nothing; it only asks whether `pid` exists.
        let gone = pid > 0
            && unsafe { libc::kill(pid, 0) } == -1
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if ours && gone {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// A private directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir() -> anyhow::Result<TempDir> {
    sweep_stale_tempdirs(&std::env::temp_dir());
    let dir = std::env::temp_dir().join(format!(
        "netram-run-{}-{}",
        std::process::id(),
        fastrand::u32(..)
    ));
    std::fs::create_dir(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(TempDir(dir))
}
