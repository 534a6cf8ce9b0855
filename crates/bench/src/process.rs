//! Child processes and system state a benchmark sets up, each undone by a guard: processes are
//! ended by their PID, swap devices, loop devices, mounts and cgroups are taken down in reverse
//! order, also when the benchmark fails halfway.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process, killed by its PID when dropped unless it was stopped before.
#[derive(Debug)]
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// Starts `cmd` with its stdout piped and stderr discarded.
    pub fn spawn(cmd: &mut Command) -> anyhow::Result<Self> {
        let child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {:?}: {e}", cmd.get_program()))?;
        Ok(Self(child))
    }

    /// Starts `cmd` and waits for its first line on stdout, which must start with `prefix`;
    /// returns the rest of the line (an address, a path).
    pub fn spawn_reporting(cmd: &mut Command, prefix: &str) -> anyhow::Result<(Self, String)> {
        let mut guard = Self::spawn(cmd)?;
        let stdout = guard.0.stdout.take().expect("piped");
        let mut line = String::new();
        std::io::BufReader::new(stdout).read_line(&mut line)?;
        let rest = line
            .trim()
            .strip_prefix(prefix)
            .ok_or_else(|| anyhow::anyhow!("{cmd:?}: unexpected first line {line:?}"))?
            .to_string();
        Ok((guard, rest))
    }

    /// `netram` with `args`, reporting its address or path in a first line after `prefix`.
    pub fn netram(
        exe: &std::path::Path,
        args: &[&str],
        prefix: &str,
    ) -> anyhow::Result<(Self, String)> {
        Self::spawn_reporting(Command::new(exe).args(args), prefix)
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub fn stop(mut self, grace: Duration) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.0.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Drop kills it.
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// Resident memory of a process, in bytes (0 once it is gone).
pub fn rss_of(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/statm"))
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * rustix::param::page_size() as u64)
}

/// CPU time a process has used so far, user and system, all its threads (0 once it is gone).
pub fn cpu_seconds_of(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which is in parentheses and may hold spaces: utime and
    // stime are the 12th and 13th of them.
    let ticks: u64 = stat
        .rsplit_once(')')
        .map(|(_, rest)| {
            rest.split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|t| t.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0);
    ticks as f64 / rustix::param::clock_ticks_per_second() as f64
}

/// Undo actions, run last-in first-out when the guard drops.
#[derive(Default)]
pub struct Cleanup(Vec<(String, Box<dyn FnOnce()>)>);

impl std::fmt::Debug for Cleanup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(w, _)| w))
            .finish()
    }
}

impl Cleanup {
    pub fn push(&mut self, what: &str, undo: impl FnOnce() + 'static) {
        self.0.push((what.to_string(), Box::new(undo)));
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        while let Some((what, undo)) = self.0.pop() {
            tracing::debug!("cleanup: {what}");
            undo();
        }
    }
}

/// Runs a command to completion; its stdout, or its stderr as the error.
pub fn sh(cmd: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| anyhow::anyhow!("{cmd}: {e}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{cmd} {args:?}: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Whether a program is on the PATH.
pub fn have(tool: &str) -> bool {
    sh("sh", &["-c", &format!("command -v {tool}")]).is_ok()
}

/// Polls `ok` every 20 ms until it holds or `timeout` passes.
pub fn wait_for(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !ok() {
        anyhow::ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Bytes of swap in use on `device` (as /proc/swaps names it).
pub fn swap_used(device: &str) -> u64 {
    std::fs::read_to_string("/proc/swaps")
        .unwrap_or_default()
        .lines()
        .find(|l| l.split_whitespace().next() == Some(device))
        .and_then(|l| l.split_whitespace().nth(3)?.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

static INTERRUPTED: std::sync::OnceLock<std::sync::Arc<std::sync::atomic::AtomicBool>> =
    std::sync::OnceLock::new();

/// From now on SIGINT and SIGTERM only set a flag ([`interrupted`]) that the benchmarks'
/// waiting loops check, so that they stop through their guards: swap devices, loop devices,
/// mounts, cgroups and child processes are undone rather than left behind.
pub fn catch_interrupts() -> anyhow::Result<()> {
    let flag = INTERRUPTED.get_or_init(Default::default);
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, flag.clone())?;
    }
    Ok(())
}

/// Whether SIGINT or SIGTERM arrived since [`catch_interrupts`].
pub fn interrupted() -> bool {
    INTERRUPTED
        .get()
        .is_some_and(|f| f.load(std::sync::atomic::Ordering::Relaxed))
}
