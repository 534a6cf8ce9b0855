//! `netram bench nbd`: netram's block device against what users would otherwise pick, in one
//! run on one machine (Distributed Anemone §4's comparison with disk, brought up to date).
//!
//! Two parts, each measured side by side:
//! * fio 4k random reads and writes at depth 1 and 32 against `netram nbd` on three
//!   `netram serve` processes and against `nbdkit memory`, the same job file for both,
//!   alternating between them round by round;
//! * the kernel's swap: a random-access program and a quicksort, each working set W in a
//!   memory cgroup limited to W/4, swapping to netram (through nbdfuse and through its own
//!   FUSE file), to nbdkit's memory plugin through nbdfuse, to a swap file on the local disk,
//!   to zram, and with no limit at all; with the memory each configuration really freed.
//!
//! The benchmark holds the PM QoS request (CPUs kept out of deep idle) for its whole run, so
//! that every configuration, nbdkit's, the disk's and zram's included, runs on the same machine
//! state. netram runs without polling (`netram_polling` in the fio part adds it): on this
//! 2-vCPU machine, where the page servers, the device, fio and the kernel share two CPUs,
//! polling threads take the CPU from the threads they wait for (measured while writing this:
//! swap 61–63 µs per operation with polling, 51–57 without).
//!
//! Writes `nbd.json`, `nbd.md` and `nbd.svg`. Needs root for the swap part and fio, nbdkit
//! and nbdfuse for the rest; what cannot run is listed as skipped, with why.

use crate::machine::Machine;
use crate::process::{cpu_seconds_of, have, rss_of, sh, swap_used, wait_for, ChildGuard, Cleanup};
use crate::raw::{RawPeer, Wait};
use crate::workload::figure;
use crate::{pin_to, restore_affinity, target, Placement, Summary, Target};
use netram_client::latency::PmQos;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Options {
    pub quick: bool,
    pub out: PathBuf,
    /// The `netram` executable: servers, the NBD device and the workload run as its children.
    pub netram_exe: PathBuf,
    /// The swap workloads' working set; `None`: 2 GiB (256 MiB with `quick`).
    pub working_set: Option<u64>,
    /// How long the random workload runs after filling its memory; `None`: 20 s (3 s quick).
    pub seconds: Option<u64>,
    /// Which parts to run.
    pub fio: bool,
    pub swap: bool,
    /// The swap configurations to measure; empty: all of them.
    pub configs: Vec<String>,
}

/// Higher than any swap a machine is likely to have, so the device under test takes every page.
const SWAP_PRIORITY: &str = "32000";
const FIO_DEVICE: &str = "256M";
/// The fio jobs of the report, as keyed in `fio.<target>`.
const FIO_JOBS: [&str; 7] = [
    "randread_qd1",
    "randread_qd32",
    "randwrite_qd1",
    "randwrite_qd32",
    MIXED_JOB,
    "randread_4x_qd8",
    "randwrite_4x_qd8",
];

/// Connections of the multi-connection jobs (`_4x_`): four clients of one device at once, as a
/// multi-conn NBD client or several programs use it, each at depth 8. What issue 38's reads
/// and writes that do not hold the device across a round trip are for.
const CONNECTIONS: u32 = 4;

/// Random writes of mixed sizes, 4 to 64 KiB, at depth 32, then every block read back and
/// checked by fio (a crc32c in each block): what a file system or database on the device
/// does, and issue 38's write target. It writes the device's size once rather than for a
/// time, so that every block written is verified; a block that reads back wrong fails the run.
const MIXED_JOB: &str = "mixedwrite_verify_qd32";
const MIXED_ARGS: [&str; 6] = [
    "--rw=randwrite",
    "--bssplit=4k/25:8k/25:16k/20:32k/15:64k/15",
    "--verify=crc32c",
    "--do_verify=1",
    "--verify_fatal=1",
    // Not a file of fio's state in the working directory.
    "--verify_state_save=0",
];

#[derive(Debug, Clone, Copy, Serialize)]
struct FioFigure {
    iops: f64,
    p50_us: f64,
    p99_us: f64,
    /// Megabytes per second written or read by the job.
    mb_per_s: f64,
    /// The mixed job's reading back and checking: megabytes per second.
    #[serde(skip_serializing_if = "Option::is_none")]
    verify_mb_per_s: Option<f64>,
    /// I/Os the job made, both ways (the CPU per I/O is over these).
    #[serde(skip)]
    ios: f64,
    /// CPU time of the serving process per I/O: `netram nbd`, or nbdkit.
    device_cpu_us_per_io: f64,
    /// CPU time of netram's three page servers per I/O (none for nbdkit).
    #[serde(skip_serializing_if = "Option::is_none")]
    servers_cpu_us_per_io: Option<f64>,
}

fn cpu_of(pids: &[u32]) -> f64 {
    pids.iter().map(|&p| cpu_seconds_of(p)).sum()
}

pub fn run(opts: &Options) -> anyhow::Result<crate::Outcome> {
    crate::process::catch_interrupts()?;
    let machine = Machine::describe();
    eprintln!("bench nbd on {}", machine.one_line());
    let (mut skipped, mut failed): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
    let root = rustix::process::geteuid().is_root();

    eprintln!("raw loopback round trip, depth 1 ...");
    let (raw, raw_fast) = raw_rtts(if opts.quick { 3_000 } else { 20_000 })?;
    let qos = PmQos::hold();
    let pm_qos_held = qos.is_some();

    let mut fio = BTreeMap::new();
    let missing: Vec<&str> = ["fio", "nbdkit"].into_iter().filter(|t| !have(t)).collect();
    if !opts.fio {
        skipped.push("fio: not asked for".into());
    } else if !missing.is_empty() {
        skipped.push(format!("fio: {} not installed", missing.join(", ")));
    } else {
        fio = fio_matrix(opts)?;
    }

    let mut swap: BTreeMap<&'static str, BTreeMap<&'static str, Value>> = BTreeMap::new();
    let missing: Vec<&str> = [
        "nbdfuse", "nbdkit", "losetup", "mkswap", "swapon", "swapoff",
    ]
    .into_iter()
    .filter(|t| !have(t))
    .collect();
    if !opts.swap {
        skipped.push("swap: not asked for".into());
    } else if !root {
        skipped.push("swap: needs root (swapon, losetup, cgroups)".into());
    } else if let Err(why) = crate::cgroup::Hierarchy::find() {
        skipped.push(format!("swap: {why}"));
    } else if !missing.is_empty() {
        skipped.push(format!("swap: {} not installed", missing.join(", ")));
    } else {
        swap = swap_matrix(opts, &mut failed)?;
    }

    drop(qos);
    let targets = targets(&fio, &swap, raw_fast.p50_us);
    let w = working_set(opts);
    let result = json!({
        "machine": machine,
        "quick": opts.quick,
        "working_set_bytes": w,
        "raw_rtt_p50_us": raw.p50_us,
        "raw_rtt_fast_p50_us": raw_fast.p50_us,
        "pm_qos_held": pm_qos_held,
        "fio": fio,
        "swap": swap,
        "targets": targets,
        "skipped": skipped,
        "failed": failed,
    });
    crate::write_json(&opts.out, "nbd.json", &result)?;
    let plotted = plot(&swap, &opts.out.join("nbd.svg"));
    if let Err(e) = &plotted {
        skipped.push(format!("plot: {e}"));
    }
    let mut md = markdown(&result, &targets, &skipped, plotted.is_ok());
    md += &crate::failed_section(&failed);
    std::fs::write(opts.out.join("nbd.md"), &md)?;
    Ok(crate::Outcome { report: md, failed })
}

fn working_set(opts: &Options) -> u64 {
    opts.working_set
        .unwrap_or(if opts.quick { 256 << 20 } else { 2 << 30 })
}

/// The raw loopback round trip plainly and in the low-latency mode (PM QoS held, polling),
/// measured as `bench core` does: server thread pinned to one CPU, client to another.
pub(crate) fn raw_rtts(n: usize) -> anyhow::Result<(Summary, Summary)> {
    let placement = Placement::choose();
    let measure = |wait: Wait| -> anyhow::Result<Summary> {
        let prev = placement.and_then(|p| pin_to(p.server_cpu));
        let peer = RawPeer::start(wait);
        if let Some(p) = placement {
            pin_to(p.client_cpu);
        }
        let mut samples = Vec::with_capacity(n);
        let result = peer.and_then(|mut peer| {
            peer.exchange(200, &mut Vec::new())?;
            peer.exchange(n, &mut samples)
        });
        restore_affinity(prev);
        result?;
        Ok(Summary::of_ns(&mut samples))
    };
    let plain = measure(Wait::Block)?;
    let qos = PmQos::hold();
    let fast = measure(Wait::Poll)?;
    drop(qos);
    Ok((plain, fast))
}

/// Three page servers, as `netram serve` processes, polling or not.
pub(crate) fn start_servers(
    exe: &Path,
    capacity: &str,
    polling: bool,
) -> anyhow::Result<(Vec<ChildGuard>, String)> {
    start_n_servers(exe, capacity, polling, 3)
}

/// `count` page servers, as `netram serve` processes, polling or not: their guards and their
/// addresses, comma-separated.
pub(crate) fn start_n_servers(
    exe: &Path,
    capacity: &str,
    polling: bool,
    count: usize,
) -> anyhow::Result<(Vec<ChildGuard>, String)> {
    let mut servers = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..count {
        let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--capacity", capacity];
        if polling {
            args.push("--low-latency");
        }
        let (s, addr) = ChildGuard::netram(exe, &args, "netram serve: listening on ")?;
        servers.push(s);
        addrs.push(addr);
    }
    Ok((servers, addrs.join(",")))
}

fn start_nbdkit(socket: &Path, size: &str) -> anyhow::Result<ChildGuard> {
    let g = ChildGuard::spawn(
        Command::new("nbdkit")
            .args(["-f", "-U"])
            .arg(socket)
            .args(["memory", size]),
    )?;
    wait_for("nbdkit's socket", Duration::from_secs(10), || {
        socket.exists()
    })?;
    Ok(g)
}

/// One fio job: `rw` of 4 KiB blocks at `depth` on each of `connections` connections for
/// `seconds` (their figures reported as one), or [`MIXED_JOB`] (`rw` of `None`).
fn fio_job(
    uri: &str,
    rw: Option<&str>,
    depth: u32,
    connections: u32,
    seconds: u64,
) -> anyhow::Result<FioFigure> {
    let mut args = vec![
        "--name=bench".to_string(),
        "--ioengine=nbd".into(),
        format!("--uri={uri}"),
        format!("--iodepth={depth}"),
        format!("--size={FIO_DEVICE}"),
        "--norandommap".into(),
        "--randrepeat=0".into(),
        "--output-format=json".into(),
    ];
    if connections > 1 {
        // One connection per fio job (libnbd's), their figures summed into the first.
        args.extend([
            format!("--numjobs={connections}"),
            "--group_reporting".into(),
        ]);
    }
    match rw {
        Some(rw) => args.extend([
            format!("--rw={rw}"),
            "--bs=4k".into(),
            format!("--runtime={seconds}"),
            "--time_based".into(),
        ]),
        None => args.extend(MIXED_ARGS.map(String::from)),
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = sh("fio", &args)?;
    let rw = rw.unwrap_or("randwrite");
    // fio may print notes before its JSON.
    let json = out.find('{').map_or(out.as_str(), |at| &out[at..]);
    let v: Value = serde_json::from_str(json)
        .map_err(|e| anyhow::anyhow!("fio's output is not JSON ({e}): {out}"))?;
    let dir = if rw.contains("read") { "read" } else { "write" };
    let j = &v["jobs"][0][dir];
    let pct = |p: &str| j["clat_ns"]["percentile"][p].as_f64().unwrap_or(f64::NAN) / 1000.0;
    let mb = |d: &Value| d["bw_bytes"].as_f64().unwrap_or(f64::NAN) / 1e6;
    anyhow::ensure!(
        v["jobs"][0]["error"].as_i64() == Some(0),
        "fio reported an error: {}",
        v["jobs"][0]["error"]
    );
    Ok(FioFigure {
        iops: j["iops"].as_f64().unwrap_or(f64::NAN),
        p50_us: pct("50.000000"),
        p99_us: pct("99.000000"),
        mb_per_s: mb(j),
        ios: ["read", "write"]
            .iter()
            .map(|d| v["jobs"][0][d]["total_ios"].as_f64().unwrap_or(0.0))
            .sum(),
        verify_mb_per_s: (dir == "write" && j["total_ios"].as_u64().is_some())
            .then(|| mb(&v["jobs"][0]["read"]))
            .filter(|&m| m > 0.0),
        device_cpu_us_per_io: f64::NAN,
        servers_cpu_us_per_io: None,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// fio against netram and nbdkit, the two alternating job by job; the median of the rounds.
fn fio_matrix(
    opts: &Options,
) -> anyhow::Result<BTreeMap<&'static str, BTreeMap<String, FioFigure>>> {
    let (rounds, seconds) = if opts.quick { (1, 2) } else { (3, 5) };
    let scratch = tempfile_dir("netram-bench-fio")?;
    let dir = scratch.path().to_path_buf();
    let mut guards = Vec::new();
    let mut uris = Vec::new();
    // Per target: the device's PID and its servers' PIDs, for the CPU each I/O costs them.
    let mut pids: BTreeMap<&'static str, (u32, Vec<u32>)> = BTreeMap::new();
    for (name, polling) in [("netram", false), ("netram_polling", true)] {
        let (servers, list) = start_servers(&opts.netram_exe, "1G", polling)?;
        let sock = dir.join(format!("{name}.sock"));
        let mut args = vec!["nbd", "--size", FIO_DEVICE, "--servers", &list];
        if polling {
            args.push("--low-latency");
        }
        args.extend(["--socket", sock.to_str().expect("utf-8 temp dir")]);
        let (nbd, line) = ChildGuard::netram(&opts.netram_exe, &args, "netram nbd: serving ")?;
        uris.push((
            name,
            line.split(" on ").nth(1).unwrap_or_default().to_string(),
        ));
        pids.insert(
            name,
            (nbd.pid(), servers.iter().map(ChildGuard::pid).collect()),
        );
        guards.push((nbd, servers));
    }
    let kit_sock = dir.join("nbdkit.sock");
    let kit = start_nbdkit(&kit_sock, FIO_DEVICE)?;
    pids.insert("nbdkit", (kit.pid(), Vec::new()));
    uris.push((
        "nbdkit",
        format!("nbd+unix:///?socket={}", kit_sock.display()),
    ));
    let targets: Vec<(&'static str, &str)> = uris.iter().map(|(n, u)| (*n, u.as_str())).collect();
    // Random reads of never-written blocks would read holes: both devices are filled first.
    for &(name, uri) in &targets {
        eprintln!("fio: filling {name} ...");
        sh(
            "fio",
            &[
                "--name=fill",
                "--ioengine=nbd",
                &format!("--uri={uri}"),
                "--rw=write",
                "--bs=1M",
                "--iodepth=8",
                &format!("--size={FIO_DEVICE}"),
                "--output-format=json",
            ],
        )?;
    }
    let mut samples: BTreeMap<(&'static str, String), Vec<FioFigure>> = BTreeMap::new();
    let jobs = [
        (Some("randread"), 1, 1),
        (Some("randread"), 32, 1),
        (Some("randwrite"), 1, 1),
        (Some("randwrite"), 32, 1),
        (None, 32, 1),
        (Some("randread"), 8, CONNECTIONS),
        (Some("randwrite"), 8, CONNECTIONS),
    ];
    for round in 0..rounds {
        for (rw, depth, connections) in jobs {
            let key = match rw {
                None => MIXED_JOB.to_string(),
                Some(rw) if connections > 1 => format!("{rw}_{connections}x_qd{depth}"),
                Some(rw) => format!("{rw}_qd{depth}"),
            };
            debug_assert!(FIO_JOBS.contains(&key.as_str()), "{key} in the report");
            let mut order = targets.clone();
            if round % 2 == 1 {
                order.reverse();
            }
            for &(name, uri) in &order {
                eprintln!("fio: round {round}, {name} {key} ...");
                let (device, servers) = &pids[name];
                let (d0, s0) = (cpu_of(&[*device]), cpu_of(servers));
                let mut f = fio_job(uri, rw, depth, connections, seconds)?;
                f.device_cpu_us_per_io = (cpu_of(&[*device]) - d0) * 1e6 / f.ios;
                if !servers.is_empty() {
                    f.servers_cpu_us_per_io = Some((cpu_of(servers) - s0) * 1e6 / f.ios);
                }
                samples.entry((name, key.clone())).or_default().push(f);
            }
        }
    }
    let mut out: BTreeMap<&'static str, BTreeMap<String, FioFigure>> = BTreeMap::new();
    for ((name, key), figs) in samples {
        out.entry(name).or_default().insert(
            key,
            FioFigure {
                iops: median(figs.iter().map(|f| f.iops).collect()),
                p50_us: median(figs.iter().map(|f| f.p50_us).collect()),
                p99_us: median(figs.iter().map(|f| f.p99_us).collect()),
                mb_per_s: median(figs.iter().map(|f| f.mb_per_s).collect()),
                verify_mb_per_s: figs[0]
                    .verify_mb_per_s
                    .map(|_| median(figs.iter().filter_map(|f| f.verify_mb_per_s).collect())),
                ios: median(figs.iter().map(|f| f.ios).collect()),
                device_cpu_us_per_io: median(figs.iter().map(|f| f.device_cpu_us_per_io).collect()),
                servers_cpu_us_per_io: figs[0].servers_cpu_us_per_io.map(|_| {
                    median(
                        figs.iter()
                            .filter_map(|f| f.servers_cpu_us_per_io)
                            .collect(),
                    )
                }),
            },
        );
    }
    for (nbd, servers) in guards {
        nbd.stop(Duration::from_secs(10));
        drop(servers);
    }
    drop(kit);
    Ok(out)
}

/// A scratch directory of this run, removed when the guard is dropped: also when the
/// benchmark fails or is interrupted on the way (declared before the guards of what is made
/// in it, it goes after them).
pub(crate) fn tempfile_dir(prefix: &str) -> anyhow::Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new()
        .prefix(&format!("{prefix}-"))
        .tempdir()?)
}

/// The swap configurations, in the order of the report.
pub const CONFIGS: [&str; 6] = [
    "local",
    "zram",
    "disk",
    "nbdkit_nbdfuse",
    "netram_nbdfuse",
    "netram_fuse",
];

/// A swap device set up for one configuration, and the processes whose memory it costs on this
/// machine.
pub(crate) struct SwapDevice {
    /// The device or file as /proc/swaps names it; `None` for `local`.
    name: Option<String>,
    /// Processes that hold the swapped pages or serve them from this machine.
    local_pids: Vec<u32>,
    /// zram's own count of the memory it uses.
    zram: Option<String>,
    /// Page servers: remote in a real cluster, on loopback here.
    server_pids: Vec<u32>,
    cleanup: Cleanup,
}

impl SwapDevice {
    /// The device or file as /proc/swaps names it (`None` for `local`).
    pub(crate) fn path(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Memory this configuration holds on this machine, beyond the workload's own.
    fn local_bytes(&self) -> u64 {
        let zram = self.zram.as_ref().map_or(0, |dev| {
            std::fs::read_to_string(format!("/sys/block/{dev}/mm_stat"))
                .ok()
                .and_then(|s| s.split_whitespace().nth(2)?.parse::<u64>().ok())
                .unwrap_or(0)
        });
        zram + self.local_pids.iter().map(|&p| rss_of(p)).sum::<u64>()
    }

    fn server_bytes(&self) -> u64 {
        self.server_pids.iter().map(|&p| rss_of(p)).sum()
    }
}

fn swapon(cleanup: &mut Cleanup, dev: &str) -> anyhow::Result<()> {
    sh("mkswap", &[dev])?;
    sh("swapon", &["-p", SWAP_PRIORITY, "--discard", dev])?;
    let d = dev.to_string();
    cleanup.push("swapoff", move || {
        if let Err(e) = sh("swapoff", &[&d]) {
            eprintln!("swapoff {d}: {e}");
        }
    });
    Ok(())
}

fn loop_on(cleanup: &mut Cleanup, file: &Path) -> anyhow::Result<String> {
    let lo = sh(
        "losetup",
        &[
            "--find",
            "--show",
            "--direct-io=on",
            file.to_str().expect("utf-8 path"),
        ],
    )?;
    let l = lo.clone();
    cleanup.push("detach the loop device", move || {
        let _ = sh("losetup", &["-d", &l]);
    });
    Ok(lo)
}

fn nbdfuse(cleanup: &mut Cleanup, mount: &Path, uri: &str) -> anyhow::Result<(PathBuf, u32)> {
    let file = mount.join("nbd");
    let g = ChildGuard::spawn(Command::new("nbdfuse").arg(&file).arg(uri))?;
    let pid = g.pid();
    let m = mount.to_path_buf();
    cleanup.push("unmount nbdfuse", move || {
        let _ = sh("umount", &[m.to_str().unwrap_or_default()]);
        g.stop(Duration::from_secs(5));
    });
    wait_for("nbdfuse's file", Duration::from_secs(10), || file.exists())?;
    Ok((file, pid))
}

/// Sets up swap configuration `config` for a working set of `w` bytes; `exe` is netram.
pub(crate) fn setup(config: &str, w: u64, exe: &Path, dir: &Path) -> anyhow::Result<SwapDevice> {
    // Room for the whole working set and swap's own header.
    let size = (w + (64 << 20)).to_string();
    let mut c = Cleanup::default();
    let mut dev = SwapDevice {
        name: None,
        local_pids: Vec::new(),
        zram: None,
        server_pids: Vec::new(),
        cleanup: Cleanup::default(),
    };
    let mount = dir.join(format!("mnt-{config}"));
    match config {
        "local" => {}
        "zram" => {
            if !Path::new("/sys/class/zram-control").exists() {
                let _ = sh("modprobe", &["zram", "num_devices=0"]);
            }
            let n = std::fs::read_to_string("/sys/class/zram-control/hot_add")?
                .trim()
                .to_string();
            let name = format!("zram{n}");
            c.push("remove the zram device", move || {
                let _ = std::fs::write("/sys/class/zram-control/hot_remove", &n);
            });
            let _ = std::fs::write(format!("/sys/block/{name}/comp_algorithm"), "lz4");
            std::fs::write(format!("/sys/block/{name}/disksize"), &size)?;
            let path = format!("/dev/{name}");
            swapon(&mut c, &path)?;
            dev.name = Some(path);
            dev.zram = Some(name);
        }
        "disk" => {
            // Not the temp dir: it may be a tmpfs, which cannot hold swap.
            let file = PathBuf::from(format!("/var/tmp/netram-bench-swap-{}", std::process::id()));
            sh("fallocate", &["-l", &size, file.to_str().expect("utf-8")])?;
            let f = file.clone();
            c.push("remove the swap file", move || {
                let _ = std::fs::remove_file(&f);
            });
            std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
            let path = file.to_string_lossy().into_owned();
            swapon(&mut c, &path)?;
            dev.name = Some(path);
        }
        "nbdkit_nbdfuse" => {
            std::fs::create_dir_all(&mount)?;
            let sock = dir.join("nbdkit.sock");
            let kit = start_nbdkit(&sock, &size)?;
            dev.local_pids.push(kit.pid());
            c.push("stop nbdkit", move || drop(kit));
            let uri = format!("nbd+unix:///?socket={}", sock.display());
            let (file, pid) = nbdfuse(&mut c, &mount, &uri)?;
            dev.local_pids.push(pid);
            let lo = loop_on(&mut c, &file)?;
            swapon(&mut c, &lo)?;
            dev.name = Some(lo);
        }
        "netram_nbdfuse" | "netram_fuse" => {
            std::fs::create_dir_all(&mount)?;
            let capacity = ((w / 2) + (64 << 20)).to_string();
            let (servers, list) = start_servers(exe, &capacity, false)?;
            dev.server_pids = servers.iter().map(ChildGuard::pid).collect();
            c.push("stop the page servers", move || drop(servers));
            let sock = dir.join("netram.sock");
            let mut args = vec!["nbd", "--size", &size, "--servers", &list];
            let sock_s = sock.to_string_lossy().into_owned();
            let mount_s = mount.to_string_lossy().into_owned();
            if config == "netram_fuse" {
                args.extend(["--fuse", &mount_s]);
            } else {
                args.extend(["--socket", &sock_s]);
            }
            let (nbd, _) = ChildGuard::netram(exe, &args, "netram nbd: serving ")?;
            dev.local_pids.push(nbd.pid());
            let fuse = config == "netram_fuse";
            let m = mount.clone();
            c.push("stop netram nbd", move || {
                nbd.stop(Duration::from_secs(20));
                if fuse {
                    let _ = sh("umount", &["-l", m.to_str().unwrap_or_default()]);
                }
            });
            let file = if fuse {
                mount.join("device")
            } else {
                let uri = format!("nbd+unix:///?socket={}", sock.display());
                let (file, pid) = nbdfuse(&mut c, &mount, &uri)?;
                dev.local_pids.push(pid);
                file
            };
            let lo = loop_on(&mut c, &file)?;
            swapon(&mut c, &lo)?;
            dev.name = Some(lo);
        }
        other => anyhow::bail!("unknown configuration {other}"),
    }
    dev.cleanup = c;
    Ok(dev)
}

/// Runs one workload in a fresh memory cgroup (limited to W/4 unless `local`), sampling the
/// configuration's memory while it runs.
/// `limit`: the cgroup's memory limit; `None` for `local` (no limit).
pub(crate) fn run_workload(
    exe: &Path,
    w: u64,
    limit: Option<u64>,
    config: &str,
    dev: &SwapDevice,
    args: &[String],
    timeout: Duration,
) -> anyhow::Result<Value> {
    let cg = crate::cgroup::Hierarchy::find()
        .map_err(|why| anyhow::anyhow!(why))?
        .create(&format!("netram-bench-{}", std::process::id()), limit)?;
    let exe = exe.display().to_string();
    let mut child = ChildGuard::spawn(
        Command::new("sh")
            .arg("-c")
            .arg(cg.enter_then(&format!("exec {exe} workload {}", args.join(" ")))),
    )?;
    let started = Instant::now();
    let (local_cpu0, server_cpu0) = (cpu_of(&dev.local_pids), cpu_of(&dev.server_pids));
    let (mut local_max, mut server_max, mut swap_max) = (0u64, 0u64, 0u64);
    let status = loop {
        if let Some(status) = child.0.try_wait()? {
            break status;
        }
        local_max = local_max.max(dev.local_bytes());
        server_max = server_max.max(dev.server_bytes());
        if let Some(name) = &dev.name {
            swap_max = swap_max.max(swap_used(name));
        }
        anyhow::ensure!(
            started.elapsed() < timeout,
            "{config}: {args:?} did not finish in {timeout:?}"
        );
        anyhow::ensure!(!crate::process::interrupted(), "interrupted");
        std::thread::sleep(Duration::from_millis(200));
    };
    let local_cpu = cpu_of(&dev.local_pids) - local_cpu0;
    let server_cpu = cpu_of(&dev.server_pids) - server_cpu0;
    let mut line = String::new();
    if let Some(mut out) = child.0.stdout.take() {
        std::io::Read::read_to_string(&mut out, &mut line)?;
    }
    anyhow::ensure!(
        status.success(),
        "{config}: {args:?} failed: {status} {line}"
    );
    anyhow::ensure!(line.contains("verified=yes"), "{config}: {line}");
    let peak = cg.peak_bytes()?;
    // What the machine saved: the working set, less what the program kept resident, less what
    // the swap backing holds on this machine (zram's compressed pages, nbdkit's RAM, netram's
    // cache and tables).
    let freed = w as i64 - peak as i64 - local_max as i64;
    let mut v = json!({
        "cgroup_peak_bytes": peak,
        "backing_local_bytes": local_max,
        "freed_bytes": freed.max(0),
        "swap_used_max_bytes": swap_max,
        "elapsed_seconds": started.elapsed().as_secs_f64(),
    });
    if !dev.local_pids.is_empty() {
        v["backing_cpu_seconds"] = json!(local_cpu);
    }
    if server_max > 0 {
        v["servers_bytes"] = json!(server_max);
        v["servers_cpu_seconds"] = json!(server_cpu);
    }
    for key in [
        "us_per_op",
        "seconds",
        "ops",
        "fill_seconds",
        "verify_seconds",
        "total_seconds",
    ] {
        if let Some(x) = figure(&line, key) {
            v[key] = json!(x);
        }
    }
    drop(cg);
    Ok(v)
}

/// The swap configurations and workloads; a set-up or run that fails (other than by the
/// kernel's OOM killer, which is the kernel's result) goes into `failed`.
fn swap_matrix(
    opts: &Options,
    failed: &mut Vec<String>,
) -> anyhow::Result<BTreeMap<&'static str, BTreeMap<&'static str, Value>>> {
    let w = working_set(opts);
    let seconds = opts.seconds.unwrap_or(if opts.quick { 3 } else { 20 });
    let scratch = tempfile_dir("netram-bench-swap")?;
    let dir = scratch.path().to_path_buf();
    let mut out: BTreeMap<&'static str, BTreeMap<&'static str, Value>> = BTreeMap::new();
    // Generous bounds: a slow backing must not hang the benchmark forever.
    let timeout = Duration::from_secs(if opts.quick { 600 } else { 3600 });
    for config in CONFIGS {
        if !opts.configs.is_empty() && !opts.configs.iter().any(|c| c == config) {
            continue;
        }
        anyhow::ensure!(!crate::process::interrupted(), "interrupted");
        eprintln!("swap: setting up {config} ...");
        let dev = match setup(config, working_set(opts), &opts.netram_exe, &dir) {
            Ok(d) => d,
            Err(e) => {
                failed.push(format!("swap.{config}: cannot set up: {e:#}"));
                continue;
            }
        };
        for (workload, args) in [
            (
                "random",
                vec![
                    "random".to_string(),
                    w.to_string(),
                    "7".into(),
                    seconds.to_string(),
                ],
            ),
            (
                "qsort",
                vec!["qsort".to_string(), w.to_string(), "7".into()],
            ),
        ] {
            eprintln!("swap: {config}, {workload} over {} MiB ...", w >> 20);
            // The cgroup-v1 memory controller OOM-kills a program whose swap-ins it cannot
            // charge fast enough, whatever the swap device (seen here with a local swap file
            // and zram as with FUSE devices, mostly in the quicksort): up to three attempts,
            // and the kills are reported.
            let mut kills = 0;
            let result = loop {
                match run_workload(
                    &opts.netram_exe,
                    working_set(opts),
                    (config != "local").then_some(working_set(opts) / 4),
                    config,
                    &dev,
                    &args,
                    timeout,
                ) {
                    Err(e) if kills < 2 && format!("{e:#}").contains("SIGKILL") => {
                        eprintln!("  OOM-killed by the memory cgroup; again");
                        kills += 1;
                    }
                    other => break other,
                }
            };
            match result {
                Ok(mut v) => {
                    v["oom_kills"] = json!(kills);
                    eprintln!("  {v}");
                    out.entry(workload).or_default().insert(config, v);
                }
                // Killed every time: the configuration's result, not a failure of the run.
                Err(e) if format!("{e:#}").contains("SIGKILL") => {
                    eprintln!("  OOM-killed {} times: reported as its result", kills + 1);
                    out.entry(workload)
                        .or_default()
                        .insert(config, json!({ "oom_kills": kills + 1 }));
                }
                Err(_) if crate::process::interrupted() => anyhow::bail!("interrupted"),
                Err(e) => failed.push(format!(
                    "swap.{workload}.{config}: {e:#} (after {kills} OOM kills)"
                )),
            }
        }
        drop(dev.cleanup);
    }
    Ok(out)
}

fn targets(
    fio: &BTreeMap<&'static str, BTreeMap<String, FioFigure>>,
    swap: &BTreeMap<&'static str, BTreeMap<&'static str, Value>>,
    raw_fast_p50: f64,
) -> Vec<Target> {
    let mut t = Vec::new();
    let f = |target: &str, key: &str| fio.get(target).and_then(|m| m.get(key)).copied();
    if let (Some(n), Some(k)) = (f("netram", "randread_qd32"), f("nbdkit", "randread_qd32")) {
        t.push(target(
            "fio randread qd32 iops: netram / nbdkit",
            n.iops / k.iops,
            1.0,
            "ge",
        ));
    }
    if let (Some(n), Some(k)) = (f("netram", MIXED_JOB), f("nbdkit", MIXED_JOB)) {
        t.push(target(
            "fio writes of 4-64 KiB qd32, verified, MB/s: netram / nbdkit",
            n.mb_per_s / k.mb_per_s,
            1.0,
            "ge",
        ));
    }
    if let (Some(n), Some(k)) = (f("netram", "randread_qd1"), f("nbdkit", "randread_qd1")) {
        t.push(target(
            "fio randread qd1 p50: netram / (nbdkit + 1.3 × raw fast RTT)",
            n.p50_us / (k.p50_us + 1.3 * raw_fast_p50),
            1.0,
            "le",
        ));
    }
    let s = |w: &str, c: &str, key: &str| swap.get(w)?.get(c)?.get(key)?.as_f64();
    let base = s("random", "nbdkit_nbdfuse", "us_per_op");
    if let (Some(n), Some(b)) = (s("random", "netram_nbdfuse", "us_per_op"), base) {
        t.push(target(
            "swap.random: netram_nbdfuse / nbdkit_nbdfuse",
            n / b,
            1.0,
            "le",
        ));
    }
    if let (Some(n), Some(b)) = (s("random", "netram_fuse", "us_per_op"), base) {
        t.push(target(
            "swap.random: netram_fuse / nbdkit_nbdfuse",
            n / b,
            0.5,
            "le",
        ));
    }
    let disk = s("qsort", "disk", "seconds");
    if let (Some(n), Some(d)) = (s("qsort", "netram_nbdfuse", "seconds"), disk) {
        t.push(target(
            "swap.qsort: netram_nbdfuse / disk",
            n / d,
            1.0,
            "le",
        ));
    }
    if let (Some(n), Some(d)) = (s("qsort", "netram_fuse", "seconds"), disk) {
        t.push(target("swap.qsort: netram_fuse / disk", n / d, 1.0, "le"));
    }
    t
}

/// Two bar charts on a log scale: µs per random operation and seconds per sort, by
/// configuration.
fn plot(
    swap: &BTreeMap<&'static str, BTreeMap<&'static str, Value>>,
    path: &Path,
) -> anyhow::Result<()> {
    anyhow::ensure!(!swap.is_empty(), "no swap figures to plot");
    // Configurations without a figure (OOM-killed every time, failed) have no bar; the
    // report's table says why.
    let panels: Vec<crate::uffd::Panel> = [
        (
            "random",
            "us_per_op",
            "random 4 KiB read-modify-writes",
            "µs per op (log scale)",
        ),
        ("qsort", "seconds", "quicksort", "seconds (log scale)"),
    ]
    .into_iter()
    .map(|(workload, key, caption, unit)| {
        let bars = CONFIGS
            .iter()
            .filter_map(|c| {
                let v = swap.get(workload)?.get(c)?.get(key)?.as_f64()?;
                Some((c.to_string(), v))
            })
            .collect();
        (caption.to_string(), unit.to_string(), bars)
    })
    .collect();
    crate::uffd::plot_panels(
        "bench nbd: the kernel's swap on each device (lower is better; netram in blue)",
        &panels,
        path,
    )
}

fn markdown(r: &Value, targets: &[Target], skipped: &[String], plotted: bool) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# netram bench nbd\n");
    let _ = writeln!(
        s,
        "Machine: {} · {} · {} CPUs · {} MiB · kernel {}{}\n",
        r["machine"]["hostname"].as_str().unwrap_or("?"),
        r["machine"]["date_utc"].as_str().unwrap_or("?"),
        r["machine"]["cpus"],
        r["machine"]["mem_total_kib"].as_u64().unwrap_or(0) / 1024,
        r["machine"]["kernel"].as_str().unwrap_or("?"),
        if r["quick"].as_bool() == Some(true) {
            " · quick run"
        } else {
            ""
        },
    );
    let _ = writeln!(
        s,
        "Raw loopback round trip p50: {:.1} µs, {:.1} µs in the low-latency mode (PM QoS \
         held, polling). PM QoS request held for every configuration below: {}; netram \
         without polling unless named netram_polling.\n",
        r["raw_rtt_p50_us"].as_f64().unwrap_or(f64::NAN),
        r["raw_rtt_fast_p50_us"].as_f64().unwrap_or(f64::NAN),
        r["pm_qos_held"]
    );
    if let Some(fio) = r["fio"].as_object().filter(|m| !m.is_empty()) {
        let _ = writeln!(
            s,
            "## fio, nbd engine, device {FIO_DEVICE}: 4 KiB blocks, and mixed sizes\n"
        );
        let _ = writeln!(s, "| job | netram IOPS | nbdkit IOPS | ratio | netram p50 / p99 µs | nbdkit p50 / p99 µs | netram_polling IOPS, p50 µs |");
        let _ = writeln!(s, "|---|---|---|---|---|---|---|");
        for job in FIO_JOBS {
            let n = &fio["netram"][job];
            let k = &fio["nbdkit"][job];
            let np = &fio["netram_polling"][job];
            let g = |v: &Value, f: &str| v[f].as_f64().unwrap_or(f64::NAN);
            let _ = writeln!(
                s,
                "| {job} | {:.0} | {:.0} | {:.2} | {:.1} / {:.1} | {:.1} / {:.1} | {:.0}, {:.1} |",
                g(n, "iops"),
                g(k, "iops"),
                g(n, "iops") / g(k, "iops"),
                g(n, "p50_us"),
                g(n, "p99_us"),
                g(k, "p50_us"),
                g(k, "p99_us"),
                g(np, "iops"),
                g(np, "p50_us"),
            );
        }
        let _ = writeln!(
            s,
            "\n`_{CONNECTIONS}x_qd8`: {CONNECTIONS} connections at once, each at depth 8 (fio's \
             `numjobs`, one libnbd connection each); IOPS and latencies of all of them.\n"
        );
        let mixed = |t: &str, f: &str| fio[t][MIXED_JOB][f].as_f64().unwrap_or(f64::NAN);
        let _ = writeln!(
            s,
            "`{MIXED_JOB}`: random writes of 4, 8, 16, 32 and 64 KiB (25/25/20/15/15 %) over \
             the whole device at depth 32, then every block read back and checked by fio. \
             Written: netram {:.0} MB/s, nbdkit {:.0} MB/s ({:.2}×); read back and checked: \
             netram {:.0} MB/s, nbdkit {:.0} MB/s ({:.2}×).\n",
            mixed("netram", "mb_per_s"),
            mixed("nbdkit", "mb_per_s"),
            mixed("netram", "mb_per_s") / mixed("nbdkit", "mb_per_s"),
            mixed("netram", "verify_mb_per_s"),
            mixed("nbdkit", "verify_mb_per_s"),
            mixed("netram", "verify_mb_per_s") / mixed("nbdkit", "verify_mb_per_s"),
        );
        let _ = writeln!(
            s,
            "Where the CPU goes (a profile by process, from /proc/PID/stat around each job): \
             CPU µs per I/O of the serving processes; fio's own is not counted.\n"
        );
        let _ = writeln!(
            s,
            "| job | netram nbd | netram's 3 servers | netram total | nbdkit |\n|---|---|---|---|---|"
        );
        for job in FIO_JOBS {
            let n = &fio["netram"][job];
            let d = n["device_cpu_us_per_io"].as_f64().unwrap_or(f64::NAN);
            let sv = n["servers_cpu_us_per_io"].as_f64().unwrap_or(f64::NAN);
            let k = fio["nbdkit"][job]["device_cpu_us_per_io"]
                .as_f64()
                .unwrap_or(f64::NAN);
            let _ = writeln!(s, "| {job} | {d:.1} | {sv:.1} | {:.1} | {k:.1} |", d + sv);
        }
        let n = &fio["netram"]["randread_qd32"];
        let d = n["device_cpu_us_per_io"].as_f64().unwrap_or(f64::NAN);
        let sv = n["servers_cpu_us_per_io"].as_f64().unwrap_or(f64::NAN);
        let k = fio["nbdkit"]["randread_qd32"]["device_cpu_us_per_io"]
            .as_f64()
            .unwrap_or(f64::NAN);
        let _ = writeln!(
            s,
            "\nAt depth 32 the machine's CPUs are the limit. Per random read, `netram nbd` \
             alone costs {:.2}× nbdkit's CPU; the page servers, which in a cluster run on \
             other machines but here share this one's CPUs, add {:.2}× more.",
            d / k,
            sv / k
        );
        let _ = writeln!(s);
    }
    if let Some(swap) = r["swap"].as_object().filter(|m| !m.is_empty()) {
        let w = r["working_set_bytes"].as_u64().unwrap_or(0);
        let _ = writeln!(
            s,
            "## Kernel swap, working set {} MiB, memory cgroup limit {} MiB\n",
            w >> 20,
            w >> 22
        );
        let _ = writeln!(s, "| configuration | random µs/op | qsort s | freed MiB (random) | backing on this machine MiB | page servers MiB | backing CPU s (random) | servers CPU s (random) |");
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
        for c in CONFIGS {
            let rnd = &swap
                .get("random")
                .map(|m| m[c].clone())
                .unwrap_or(Value::Null);
            let qs = &swap
                .get("qsort")
                .map(|m| m[c].clone())
                .unwrap_or(Value::Null);
            let mib = |v: &Value| {
                v.as_f64()
                    .map_or("–".to_string(), |x| format!("{:.0}", x / 1048576.0))
            };
            let num =
                |v: &Value, p: usize| v.as_f64().map_or("–".to_string(), |x| format!("{x:.p$}"));
            let _ = writeln!(
                s,
                "| {c} | {} | {} | {} | {} | {} | {} | {} |",
                num(&rnd["us_per_op"], 2),
                num(&qs["seconds"], 1),
                mib(&rnd["freed_bytes"]),
                mib(&rnd["backing_local_bytes"]),
                mib(&rnd["servers_bytes"]),
                num(&rnd["backing_cpu_seconds"], 1),
                num(&rnd["servers_cpu_seconds"], 1),
            );
        }
        let _ = writeln!(s);
        if plotted {
            let _ = writeln!(s, "![swap figures](nbd.svg)\n");
        }
    }
    if !targets.is_empty() {
        let _ = writeln!(
            s,
            "## Targets\n\n| target | ratio | limit | met |\n|---|---|---|---|"
        );
        s += &crate::target_rows(targets);
        let _ = writeln!(s);
    }
    if !skipped.is_empty() {
        let _ = writeln!(s, "## Not measured\n");
        for k in skipped {
            let _ = writeln!(s, "- {k}");
        }
    }
    s
}
