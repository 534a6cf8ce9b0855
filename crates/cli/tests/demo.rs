//! `netram demo` stopped by SIGTERM halfway, as a user's Ctrl-C or a CI timeout stops it: it
//! takes down what it set up (its swap file, its memory cgroups, the programs it started) and
//! exits non-zero. (A whole demo runs in CI's demo step; here only its way out.)

use common::NETRAM;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

/// Every process whose parent chain leads to `pid` (read from /proc).
fn descendants_of(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let p: u32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            // The fields after the command's closing parenthesis: state, ppid, ...
            let rest = &stat[stat.rfind(')')? + 2..];
            let ppid = rest.split_whitespace().nth(1)?.parse().ok()?;
            Some((p, ppid))
        })
        .collect();
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    found.remove(0);
    found
}

/// Whether `pid` is a live process (not gone, not a zombie waiting to be reaped).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rfind(')')
            .and_then(|i| s[i + 2..].chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X')
    })
}

#[test]
fn a_demo_stopped_by_sigterm_takes_down_what_it_set_up() {
    if !netram_testkit::have_root("the demo's kernel-swap baseline (swapon, memory cgroups)") {
        return;
    }
    let cgroups = match netram_bench::cgroup::Hierarchy::find() {
        Ok(h) => h,
        Err(why) => {
            netram_testkit::skip(&why, None);
            return;
        }
    };
    let out = tempfile::tempdir().unwrap();
    let mut demo = Command::new(NETRAM)
        .args(["demo", "--out"])
        .arg(out.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = demo.id();
    let swap = PathBuf::from(format!("/var/tmp/netram-bench-swap-{pid}"));
    let in_use = |f: &Path| {
        std::fs::read_to_string("/proc/swaps")
            .unwrap()
            .lines()
            .any(|l| l.split_whitespace().next() == f.to_str())
    };
    // Its first real program runs with the kernel's swap set up beside it.
    let started = Instant::now();
    while !in_use(&swap) {
        if let Some(status) = demo.try_wait().unwrap() {
            panic!("the demo ended ({status}) before its swap file was in use");
        }
        if started.elapsed() > Duration::from_secs(180) {
            let _ = demo.kill();
            panic!("no swap file {} in use after 180 s", swap.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Give it a moment to be inside a program's run.
    std::thread::sleep(Duration::from_secs(1));
    let children = descendants_of(pid);
    assert!(!children.is_empty(), "the demo runs programs");
    // SAFETY: a signal to our own child, not reaped yet.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(s) = demo.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = demo.kill();
            panic!("the demo did not stop within 90 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = demo.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout) + String::from_utf8_lossy(&output.stderr);
    assert!(!status.success(), "a stopped demo is not a success: {text}");
    assert!(text.contains("interrupted"), "{text}");
    assert!(!in_use(&swap), "its swap file is still in use");
    assert!(!swap.exists(), "its swap file {} is left", swap.display());
    // The programs it started are gone too (given a moment to be reaped).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut left: Vec<u32> = children.clone();
    while !left.is_empty() && Instant::now() < deadline {
        left.retain(|&p| alive(p));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        left.is_empty(),
        "processes of the demo left running: {left:?}"
    );
    let ours: Vec<String> = std::fs::read_dir(cgroups.root())
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| {
            n == &format!("netram-bench-{pid}")
                || n.starts_with(&format!("netram-bench-programs-{pid}-"))
        })
        .collect();
    assert!(ours.is_empty(), "cgroups left: {ours:?}");
}
