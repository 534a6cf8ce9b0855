//! `cargo xtask …`: netram's chores in one command (foyer's `cargo x`, STYLE example 13).
//!
//! `cargo xtask test [--no-skip] [-- ARGS]` runs the whole test suite: `cargo test --workspace
//! --release ARGS`, with the tools the tests talk to installed first when it runs as root on a
//! Debian machine (otherwise it names the packages). A test that cannot run here says so on
//! stderr and is recorded by `netram_testkit::skip`; at the end every skipped test is listed
//! with its reason and counted. `--no-skip` (what CI passes) makes any skip a failure. A
//! suite that hangs fails after 10 minutes without output, with its processes' stacks
//! (`stall.rs`).
//!
//! `cargo xtask deb` builds a Debian package (see `deb`).
//!
//! Standard library only: it must build on a fresh machine before anything else does.

mod deb;
mod stall;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// The tools the full suite uses, and the Debian package each comes from.
const TOOLS: &[(&str, &str)] = &[
    ("nbdinfo", "libnbd-bin"),
    ("nbdcopy", "libnbd-bin"),
    ("nbdfuse", "libnbd-bin"),
    ("nbdkit", "nbdkit"),
    ("fio", "fio"),
    ("qemu-img", "qemu-utils"),
    ("fusermount3", "fuse3"),
    ("losetup", "util-linux"),
    ("mkswap", "util-linux"),
    ("swapon", "util-linux"),
    ("setpriv", "util-linux"),
    ("cc", "gcc"),
    // A program linked with jemalloc (its headers and -ljemalloc), and Debian's Redis, which is.
    ("jeprof", "libjemalloc-dev"),
    ("redis-server", "redis-server"),
    ("redis-cli", "redis-tools"),
    ("sqlite3", "sqlite3"),
    ("perl", "perl"),
    ("python3", "python3"),
    ("redis-benchmark", "redis-tools"),
    ("javac", "openjdk-17-jdk-headless"),
    // Hosts of their own for the multi-host tests: network namespaces, veth, a bridge, tbf.
    ("ip", "iproute2"),
    // A terminal for `netram top`'s live view.
    ("tmux", "tmux"),
    // System V programs under `netram shm run`: stress-ng's shared-memory stressor.
    ("stress-ng", "stress-ng"),
    // PostgreSQL's shared buffers in System V shared memory, under `netram shm run`.
    ("pg_ctlcluster", "postgresql"),
    ("tc", "iproute2"),
];

/// Files the suite uses that are not commands on the PATH (libraries a test preloads or links,
/// `/usr/bin/time`, which a shell's `time` keyword hides from `command -v`), and their
/// packages. A path is looked for under each multiarch library directory when it has none.
const FILES: &[(&str, &str)] = &[
    ("libtcmalloc_minimal.so.4", "libtcmalloc-minimal4"),
    ("libmimalloc.so.2", "libmimalloc2.0"),
    ("/usr/bin/time", "time"),
];

const USAGE: &str = "\
usage: cargo xtask test [--no-skip] [--no-install] [-- ARGS for cargo test]

  test          the whole test suite (cargo test --workspace --release), then the list of
                tests that could not run here and why
  --no-skip     fail if any test was skipped (CI)
  --no-install  do not install missing packages, even as root

A suite that prints nothing for 10 minutes has hung: the stacks of its processes are printed,
they are killed and the run fails (NETRAM_TEST_STALL_SECS sets the limit).";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (ours, passed) = match args.iter().position(|a| a == "--") {
        Some(i) => (&args[..i], &args[i + 1..]),
        None => (&args[..], &[][..]),
    };
    match ours.first().map(String::as_str) {
        Some("test") => {}
        Some("deb") => {
            return match deb::deb(&ours[1..]) {
                Ok(path) => {
                    println!("{}", path.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("xtask: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Some("-h" | "--help") => {
            println!("{USAGE}\n\n{}", deb::USAGE);
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    }
    let mut no_skip = false;
    let mut install = true;
    for a in &ours[1..] {
        match a.as_str() {
            "--no-skip" => no_skip = true,
            "--no-install" => install = false,
            other => {
                eprintln!("unknown option {other}\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    match test(no_skip, install, passed) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn test(no_skip: bool, install: bool, passed: &[String]) -> Result<ExitCode, String> {
    let missing = missing_packages();
    if !missing.is_empty() {
        let list = missing.iter().cloned().collect::<Vec<_>>().join(" ");
        if install && is_root() && has("apt-get") {
            eprintln!("xtask: installing what the tests use: {list}");
            run(Command::new("apt-get").arg("update"))?;
            run(Command::new("apt-get")
                .args(["install", "-y"])
                .args(&missing)
                .env("DEBIAN_FRONTEND", "noninteractive"))?;
        } else {
            eprintln!(
                "xtask: not installed: {list}; the tests that need them will be skipped \
                 (as root: apt-get install {list})"
            );
        }
    }
    let log = target_dir().join("skipped-tests.txt");
    std::fs::create_dir_all(log.parent().expect("a file in a directory"))
        .map_err(|e| format!("creating {}: {e}", log.display()))?;
    // A fresh log per run: only this run's skips count.
    let _ = std::fs::remove_file(&log);
    // Watched: a hang fails in minutes, with its stacks (see `stall.rs`).
    let status = stall::run_watched(
        cargo()
            .args(["test", "--workspace", "--release"])
            .args(passed)
            .env("NETRAM_SKIP_LOG", &log),
        stall::limit(),
    )?;
    let skipped: Vec<String> = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect();
    println!();
    if skipped.is_empty() {
        println!("xtask: no test was skipped");
    } else {
        println!("xtask: {} test(s) skipped on this machine:", skipped.len());
        for line in &skipped {
            let (name, why) = line.split_once('\t').unwrap_or((line, ""));
            println!("  {name}: {why}");
        }
    }
    if !status.success() {
        return Ok(ExitCode::FAILURE);
    }
    if no_skip && !skipped.is_empty() {
        println!("xtask: --no-skip: a skipped test is a failure here");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// Python modules the suite imports (Debian's python3, `/usr/bin/python3`), and their packages:
/// Python's System V IPC, run under `netram shm run`.
const PYTHON_MODULES: &[(&str, &str)] = &[("sysv_ipc", "python3-sysv-ipc")];

/// The packages of the tools that are not on the PATH, of the files that are not there and of
/// the Python modules that do not import.
fn missing_packages() -> BTreeSet<String> {
    let tools = TOOLS.iter().filter(|(tool, _)| !has(tool));
    let files = FILES.iter().filter(|(file, _)| !has_file(file));
    let modules = PYTHON_MODULES.iter().filter(|(m, _)| !imports(m));
    tools
        .chain(files)
        .chain(modules)
        .map(|(_, package)| (*package).to_owned())
        .collect()
}

/// Whether Debian's python3 imports `module`.
fn imports(module: &str) -> bool {
    Command::new("/usr/bin/python3")
        .args(["-c", &format!("import {module}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether `file` exists: an absolute path as it is, a library's name in a library directory.
fn has_file(file: &str) -> bool {
    if file.starts_with('/') {
        return Path::new(file).exists();
    }
    ["/usr/lib", "/lib", "/usr/lib64"].iter().any(|dir| {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return false;
        };
        Path::new(dir).join(file).exists()
            || entries
                .flatten()
                .any(|e| e.path().is_dir() && e.path().join(file).exists())
    })
}

fn has(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool} >/dev/null")])
        .status()
        .is_ok_and(|s| s.success())
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

/// Cargo, as the shell that ran `cargo xtask` would start it: without the variables `cargo run`
/// set for this program (`CARGO_MANIFEST_DIR`, `CARGO_PKG_NAME` …). Build scripts that read
/// those (ring's does, through `rerun-if-env-changed`) would otherwise see them change between
/// this cargo and the user's next one, and ring and every crate above it would be built again:
/// `cargo run -- demo` after `cargo xtask test` cost CI 2.5 minutes that way.
pub(crate) fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        if key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_MANIFEST_")
            || matches!(
                key,
                "CARGO_CRATE_NAME" | "CARGO_BIN_NAME" | "CARGO_PRIMARY_PACKAGE"
            )
        {
            cmd.env_remove(key);
        }
    }
    cmd
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let status = cmd.status().map_err(|e| format!("{cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed: {status}"))
    }
}

/// The workspace's target directory (`CARGO_TARGET_DIR` if set).
fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .join("target")
}
