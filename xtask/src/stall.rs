//! A test suite that hangs fails at once, with the hung processes' stacks, instead of holding
//! CI until its time runs out (a fork deadlock in one test binary, 1 run in ~40, once cost a
//! whole 90-minute CI run and said nothing of where it hung).
//!
//! [`run_watched`] runs a command with its output copied through line by line; when no line
//! has come for the stall limit, it prints, for every process below the command, its state
//! and each thread's kernel stack and wait channel (what `/proc` tells without a debugger:
//! a thread blocked in the kernel cannot be stopped by one), then kills them, each by its pid.

use std::io::{BufRead, Write};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Silence, in seconds, after which the suite counts as hung (`NETRAM_TEST_STALL_SECS`
/// overrides). libtest prints a line for a test still running after 60 s, and the longest
/// test here runs about 2 minutes: 10 minutes without a line is a hang.
const STALL_SECS: u64 = 600;

/// The stall limit: `NETRAM_TEST_STALL_SECS`, else [`STALL_SECS`].
pub(crate) fn limit() -> u64 {
    std::env::var("NETRAM_TEST_STALL_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(STALL_SECS)
}

/// How `cmd` ended; `Err` if it printed nothing for `limit` seconds (after the report) or
/// could not be started.
pub(crate) fn run_watched(cmd: &mut Command, limit: u64) -> Result<ExitStatus, String> {
    let started = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running {cmd:?}: {e}"))?;
    // Seconds since `started` at the last line seen, on either stream.
    let last = Arc::new(AtomicU64::new(0));
    let out = child.stdout.take().expect("piped");
    let err = child.stderr.take().expect("piped");
    let copiers = [
        copy_lines(out, std::io::stdout, last.clone(), started),
        copy_lines(err, std::io::stderr, last.clone(), started),
    ];
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("waiting: {e}"))? {
            break status;
        }
        let silent = started.elapsed().as_secs() - last.load(Ordering::Relaxed);
        if silent >= limit {
            let pids = descendants(child.id());
            eprintln!(
                "\nxtask: no output for {silent} s: the tests hung. The processes below `{}`:",
                cmd.get_program().to_string_lossy()
            );
            for &pid in &pids {
                eprintln!("{}", describe(pid));
            }
            // The deepest first, so that nothing restarts what is killed after it.
            for &pid in pids.iter().rev() {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "the tests hung (no output for {silent} s; NETRAM_TEST_STALL_SECS sets the limit)"
            ));
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    for c in copiers {
        let _ = c.join();
    }
    Ok(status)
}

fn copy_lines<R: std::io::Read + Send + 'static, W: Write + 'static>(
    from: R,
    to: fn() -> W,
    last: Arc<AtomicU64>,
    started: Instant,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut from = std::io::BufReader::new(from);
        let mut line = Vec::new();
        // Bytes, not strings: a test may print anything.
        while from.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
            let _ = to().write_all(&line);
            last.store(started.elapsed().as_secs(), Ordering::Relaxed);
            line.clear();
        }
    })
}

/// Every process below `root` (not `root` itself), parents before their children.
fn descendants(root: u32) -> Vec<u32> {
    let mut parent_of: Vec<(u32, u32)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if let Some(ppid) = field(pid, "PPid:").and_then(|p| p.parse().ok()) {
                parent_of.push((pid, ppid));
            }
        }
    }
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let p = found[i];
        found.extend(
            parent_of
                .iter()
                .filter(|&&(_, pp)| pp == p)
                .map(|&(c, _)| c),
        );
        i += 1;
    }
    found.remove(0);
    found
}

/// A line of `/proc/PID/status`, without its key.
fn field(pid: u32, key: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_owned()))
}

/// A process's command line and state, and each thread's name, state, wait channel and kernel
/// stack (the stack needs root; without it, the rest).
fn describe(pid: u32) -> String {
    let read = |p: String| std::fs::read_to_string(p).unwrap_or_default();
    let cmdline = read(format!("/proc/{pid}/cmdline")).replace('\0', " ");
    let mut s = format!(
        "== pid {pid} ({}): {}",
        field(pid, "State:").unwrap_or_default(),
        cmdline.trim()
    );
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return s;
    };
    for task in tasks.flatten() {
        let dir = task.path();
        let at = |f: &str| read(dir.join(f).to_string_lossy().into_owned());
        let state = at("status")
            .lines()
            .find_map(|l| l.strip_prefix("State:").map(|v| v.trim().to_owned()))
            .unwrap_or_default();
        s.push_str(&format!(
            "\n  thread {} {:?} {state}, waiting in {:?}",
            task.file_name().to_string_lossy(),
            at("comm").trim(),
            at("wchan").trim(),
        ));
        for frame in at("stack").lines() {
            s.push_str(&format!("\n    {frame}"));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_that_talks_ends_as_it_ends() {
        let status = run_watched(Command::new("sh").args(["-c", "echo one; exit 3"]), 5);
        assert_eq!(status.unwrap().code(), Some(3));
    }

    #[test]
    fn a_silent_command_and_its_children_are_killed_at_the_limit() {
        let pidfile = std::env::temp_dir().join(format!("xtask-stall-{}", std::process::id()));
        // A child that prints once, then a grandchild that sleeps (as a test binary would).
        let script = format!(
            "echo started; sleep 120 & echo $! > {}; wait",
            pidfile.display()
        );
        let started = Instant::now();
        let r = run_watched(Command::new("sh").args(["-c", &script]), 2);
        assert!(r.unwrap_err().contains("hung"));
        assert!(started.elapsed() < Duration::from_secs(60));
        let grandchild = std::fs::read_to_string(&pidfile).unwrap();
        let _ = std::fs::remove_file(&pidfile);
        // Killed by its pid: gone, or a zombie until init reaps it.
        let gone = || {
            field(grandchild.trim().parse().unwrap(), "State:").is_none_or(|s| s.starts_with('Z'))
        };
        let until = Instant::now() + Duration::from_secs(10);
        while !gone() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(gone(), "the grandchild {grandchild} still runs");
    }
}
