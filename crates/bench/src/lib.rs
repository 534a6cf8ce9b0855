//! netram's benchmarks, and the pieces the demo shares with them: latency summaries
//! ([`Summary`]) and a description of the machine a result came from ([`machine`]). They run on
//! `netram-cluster`'s embedded local cluster.
//!
//! Benchmarks report ratios to baselines measured side by side in the same run (the raw loopback
//! round trip, first of all), because these machines are shared and noisy: an absolute figure
//! from one run says little, a ratio from one run says what netram costs.
//!
//! Errors here are `anyhow`'s, the one library crate where they are: this crate is the body of
//! the `netram bench` and `netram demo` commands, split from the binary only so that the CLI
//! and the tests link the same code. Its failures (a tool that would not start, a page read back
//! wrong, a program whose output differs from its plain run) are reports for the person running
//! it, never matched on by a caller; a typed enum would be one `Failed(String)` variant at
//! nearly every one of its ~90 sites.

pub mod ab;
pub mod adapt;
pub mod cgroup;
pub mod core;
pub mod dsm;
mod dsm_compress;
pub mod gms;
pub mod gms_real;
pub mod machine;
pub mod nbd;
pub(crate) mod netns;
pub mod process;
pub mod programs;
pub mod raw;
pub mod reliability;
pub mod security;
pub mod uffd;
pub mod workload;

use serde::Serialize;
use std::sync::OnceLock;

/// The credentials of a cluster made for one `netram bench` or `netram demo` run: the benches
/// run authenticated and sealed like a real cluster. `netram cluster init`'s work is done into
/// a temporary directory, and `NETRAM_TLS` names it for every process the run starts (servers,
/// `netram nbd`, `netram run`); dropped, the directory goes. A user's own `NETRAM_TLS` or
/// `NETRAM_INSECURE` is left as it is.
#[derive(Debug)]
pub struct RunCredentials {
    _dir: Option<tempfile::TempDir>,
}

/// Makes the run's credentials. Call it first, before any thread starts (it sets an
/// environment variable).
pub fn install_credentials() -> anyhow::Result<RunCredentials> {
    if std::env::var_os("NETRAM_TLS").is_some() || std::env::var_os("NETRAM_INSECURE").is_some() {
        return Ok(RunCredentials { _dir: None });
    }
    let dir = tempfile::Builder::new()
        .prefix("netram-cluster-")
        .tempdir()?;
    // A throwaway cluster of this process's own: its node credentials beside the CA.
    netram_net::pki::init_cluster(dir.path(), dir.path())?;
    std::env::set_var("NETRAM_TLS", dir.path());
    Ok(RunCredentials { _dir: Some(dir) })
}

/// How this run's own pagers reach the servers it starts: the credentials `NETRAM_TLS` names
/// (see [`install_credentials`]), or clear TCP under `NETRAM_INSECURE`.
pub fn security() -> anyhow::Result<netram_client::Security> {
    static SECURITY: OnceLock<netram_client::Security> = OnceLock::new();
    if let Some(s) = SECURITY.get() {
        return Ok(s.clone());
    }
    let tls = std::env::var_os("NETRAM_TLS").map(std::path::PathBuf::from);
    let insecure = std::env::var_os("NETRAM_INSECURE").is_some_and(|v| v != "0");
    let s = netram_client::security(tls.as_deref(), insecure)?;
    Ok(SECURITY.get_or_init(|| s).clone())
}

/// Percentiles of a set of latency samples, in microseconds.
#[derive(Debug, Clone, Copy, Serialize, Default)]
pub struct Summary {
    pub samples: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
}

impl Summary {
    pub fn of_ns(samples: &mut [u64]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_unstable();
        let at =
            |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0;
        let mean = samples.iter().sum::<u64>() as f64 / samples.len() as f64 / 1000.0;
        Self {
            samples: samples.len(),
            p50_us: at(0.50),
            p99_us: at(0.99),
            mean_us: mean,
        }
    }
}

/// A target of a benchmark: a ratio measured in one run and the limit it is held to.
#[derive(Debug, Serialize)]
pub struct Target {
    pub name: &'static str,
    pub ratio: f64,
    pub limit: f64,
    /// "le": the ratio must be at most the limit; "ge": at least.
    pub sense: &'static str,
    pub met: bool,
}

pub fn target(name: &'static str, ratio: f64, limit: f64, sense: &'static str) -> Target {
    let met = if sense == "le" {
        ratio <= limit
    } else {
        ratio >= limit
    };
    Target {
        name,
        ratio,
        limit,
        sense,
        met,
    }
}

/// Deterministic page contents, so a reader can verify a page without keeping a copy.
/// Writes a benchmark's result as `DIR/NAME` (pretty JSON), creating `DIR` if need be.
/// What a benchmark produced: its report (also written to its directory), and every run that
/// failed or whose result did not verify. The command prints the report and then exits
/// non-zero naming those: a benchmark whose verification failed never looks like a success,
/// and no figure is given for such a run.
#[derive(Debug)]
pub struct Outcome {
    pub report: String,
    pub failed: Vec<String>,
}

/// The report's list of failed runs (empty when none failed).
pub fn failed_section(failed: &[String]) -> String {
    if failed.is_empty() {
        return String::new();
    }
    let mut s = String::from(
        "\n**Failed** (no figure is given for these; the command exits non-zero):\n\n",
    );
    for k in failed {
        s += &format!("- {k}\n");
    }
    s
}

pub fn write_json<T: Serialize>(dir: &std::path::Path, name: &str, r: &T) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(name), serde_json::to_string_pretty(r)? + "\n")?;
    Ok(())
}

/// The markdown rows of a targets table (after its header), one per target.
pub fn target_rows(targets: &[Target]) -> String {
    let mut s = String::new();
    for t in targets {
        s += &format!(
            "| {} | {:.3} | {} {} | {} |\n",
            t.name,
            t.ratio,
            if t.sense == "le" { "≤" } else { "≥" },
            t.limit,
            if t.met { "yes" } else { "**no**" }
        );
    }
    s
}

pub fn page_content(seed: u64, page: u64, out: &mut [u8]) {
    let mut rng = fastrand::Rng::with_seed(seed ^ page.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    for chunk in out.chunks_exact_mut(8) {
        chunk.copy_from_slice(&rng.u64(..).to_le_bytes());
    }
}

/// Thread placement for depth-1 measurements: the client on one CPU, every server thread on
/// another, as client and servers are on different machines in a cluster. Left to the scheduler,
/// two threads sometimes share a vCPU (a local switch, ~7 µs) and sometimes not (an idle exit,
/// ~70 µs), which decided whole runs of the default mode before placement was fixed.
#[derive(Debug, Clone, Copy)]
pub struct Placement {
    pub client_cpu: usize,
    pub server_cpu: usize,
}

impl Placement {
    /// The first two CPUs this process may use; `None` on a single CPU.
    pub fn choose() -> Option<Self> {
        let set = rustix::thread::sched_getaffinity(None).ok()?;
        let mut cpus = (0..rustix::thread::CpuSet::MAX_CPU).filter(|&c| set.is_set(c));
        Some(Self {
            client_cpu: cpus.next()?,
            server_cpu: cpus.next()?,
        })
    }
}

/// Pins the calling thread, and the threads it spawns from now on, to one CPU; gives back the
/// mask it had, for [`restore_affinity`].
pub fn pin_to(cpu: usize) -> Option<rustix::thread::CpuSet> {
    let prev = rustix::thread::sched_getaffinity(None).ok()?;
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set).ok()?;
    Some(prev)
}

pub fn restore_affinity(prev: Option<rustix::thread::CpuSet>) {
    if let Some(prev) = prev {
        let _ = rustix::thread::sched_setaffinity(None, &prev);
    }
}
