//! The Debian package (`cargo xtask deb`), built from this workspace's release build: its files
//! and control fields are checked; then, as root on a machine where dpkg has no netram yet, it
//! is installed, used as a user would (the daemon started from the unit's own command lines,
//! with credentials and an edited configuration in /etc/netram; `netram run` finds its library
//! in /usr/lib/netram, and GNU sort's output is the same on the local disk and on that daemon;
//! a C program builds against netram.h and libnetram.so and pages through a region; the group
//! for /dev/userfaultfd exists) and purged, leaving nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `cmd`, which must succeed (`what` names it in the failure); its output.
fn run_ok(cmd: &mut Command, what: &str) -> Output {
    let out = cmd.output().unwrap();
    ok(&out, what);
    out
}

/// Purges the package when dropped, so that a failing test leaves no netram installed, and
/// removes the group the package made if there was none before (the package itself keeps it,
/// as Debian's policy has it for system groups).
struct Installed {
    group_was_there: bool,
    etc_made: bool,
}

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = Command::new("dpkg").args(["--purge", "netram"]).output();
        // The credentials the test put in /etc/netram (only when the package made it).
        if self.etc_made {
            let _ = std::fs::remove_dir_all("/etc/netram");
        }
        if !self.group_was_there {
            let _ = Command::new("groupdel").arg("netram").output();
        }
    }
}

fn build(out: &Path) -> PathBuf {
    let built = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["deb", "--no-build", "--out"])
        .arg(out)
        .output()
        .unwrap();
    ok(&built, "cargo xtask deb --no-build");
    // The last line (dpkg-deb says what it builds before).
    let stdout = String::from_utf8_lossy(&built.stdout);
    PathBuf::from(stdout.lines().last().expect("the package's path").trim())
}

#[test]
fn the_debian_package_installs_runs_and_purges() {
    if !netram_testkit::have_tools(&[("dpkg-deb", "dpkg")]) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("netram-deb-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let deb = build(&dir);
    let listing = Command::new("dpkg-deb")
        .arg("-c")
        .arg(&deb)
        .output()
        .unwrap();
    ok(&listing, "dpkg-deb -c");
    let listing = String::from_utf8_lossy(&listing.stdout);
    for file in [
        "./usr/bin/netram",
        "./usr/lib/netram/libnetram_preload.so",
        "./usr/lib/libnetram.so",
        "./usr/include/netram.h",
        "./lib/systemd/system/netram.service",
        "./etc/netram/netram.toml",
        "./lib/udev/rules.d/70-netram-userfaultfd.rules",
    ] {
        assert!(
            listing.contains(file),
            "{file} not in the package:\n{listing}"
        );
    }
    let field = |name: &str| {
        let out = Command::new("dpkg-deb")
            .args(["-f"])
            .arg(&deb)
            .arg(name)
            .output()
            .unwrap();
        ok(&out, "dpkg-deb -f");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    assert_eq!(field("Package"), "netram");
    assert_eq!(field("Depends"), "libc6 (>= 2.34)");
    // The declared libc is enough for every binary in it (the newest symbol version asked for).
    let stage = dir.join("stage");
    run_ok(
        Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&stage),
        "dpkg-deb -x",
    );
    if netram_testkit::have_tools(&[("objdump", "binutils")]) {
        for bin in [
            "usr/bin/netram",
            "usr/lib/netram/libnetram_preload.so",
            "usr/lib/libnetram.so",
        ] {
            let syms = Command::new("objdump")
                .arg("-T")
                .arg(stage.join(bin))
                .output()
                .unwrap();
            ok(&syms, "objdump -T");
            let newest = String::from_utf8_lossy(&syms.stdout)
                .split_whitespace()
                .filter_map(|w| w.split_once("GLIBC_").map(|(_, v)| v.trim_end_matches(')')))
                .filter_map(|v| {
                    let mut p = v.split('.').map(|n| n.parse::<u32>().unwrap_or(0));
                    Some((p.next()?, p.next().unwrap_or(0)))
                })
                .max()
                .unwrap();
            assert!(newest <= (2, 34), "{bin} needs GLIBC {newest:?}");
        }
    }

    if !netram_testkit::have_root("installing the package with dpkg") {
        return;
    }
    if !netram_testkit::have_tools(&[("dpkg", "dpkg"), ("cc", "gcc")]) {
        return;
    }
    let status = Command::new("dpkg")
        .args(["-s", "netram"])
        .output()
        .unwrap();
    if status.status.success() {
        netram_testkit::skip(
            "a netram package is installed here already: not replaced",
            None,
        );
        return;
    }
    let etc_was_there = Path::new("/etc/netram").exists();
    let _installed = Installed {
        group_was_there: Command::new("getent")
            .args(["group", "netram"])
            .output()
            .unwrap()
            .status
            .success(),
        etc_made: !etc_was_there,
    };
    run_ok(Command::new("dpkg").arg("-i").arg(&deb), "dpkg -i");
    run_ok(
        Command::new("getent").args(["group", "netram"]),
        "the group netram",
    );
    let version = Command::new("/usr/bin/netram")
        .arg("--version")
        .output()
        .unwrap();
    ok(&version, "netram --version");
    // The daemon as the unit starts it, after an operator's edits: /etc/netram holds the
    // node's credentials and an edited configuration (loopback only here), and the unit's own
    // command lines run (ExecStartPre's check, then ExecStart), `netram` found where systemd
    // looks. Not where /etc/netram held anything before the package: an operator's files are
    // left alone.
    let daemon = if etc_was_there {
        netram_testkit::skip(
            "/etc/netram existed before the package: the daemon is not started from the unit",
            None,
        );
        None
    } else {
        Some(start_from_unit(&dir))
    };
    // `netram run` finds its library where the package put it (no NETRAM_PRELOAD), on the
    // local disk (no cluster needed), and GNU sort prints what it prints alone.
    let input = dir.join("lines.txt");
    let mut x: u64 = 1;
    let text: String = (0..100_000)
        .map(|i| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            format!("{:016x} {i}\n", x)
        })
        .collect();
    std::fs::write(&input, text).unwrap();
    let plain = Command::new("sort")
        .arg(&input)
        .env("LC_ALL", "C")
        .output()
        .unwrap();
    ok(&plain, "sort");
    let run = Command::new("timeout")
        .args([
            "120",
            "/usr/bin/netram",
            "run",
            "--local-mem",
            "4M",
            "--backing",
            "disk",
            "--",
        ])
        .arg("sort")
        .arg(&input)
        .env_remove("NETRAM_PRELOAD")
        .env("LC_ALL", "C")
        .output()
        .unwrap();
    ok(&run, "the installed netram run -- sort");
    assert!(
        run.stdout == plain.stdout,
        "sort under the installed netram run differs"
    );
    assert!(
        String::from_utf8_lossy(&run.stderr).contains("1 process(es) on netram"),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    // And on the daemon the unit started: sort's buffers go out to it and come back.
    if let Some(d) = &daemon {
        let report = dir.join("report.json");
        let run = Command::new("timeout")
            .args([
                "120",
                "/usr/bin/netram",
                "run",
                "--local-mem",
                "4M",
                "--servers",
            ])
            .arg(&d.addr)
            .arg("--report")
            .arg(&report)
            .arg("--")
            .arg("sort")
            .arg(&input)
            .env_remove("NETRAM_PRELOAD")
            .env("NETRAM_TLS", dir.join("ca/node-1"))
            .env("LC_ALL", "C")
            .output()
            .unwrap();
        ok(
            &run,
            "the installed netram run -- sort, on the unit's daemon",
        );
        assert!(
            run.stdout == plain.stdout,
            "sort on the unit's daemon differs"
        );
        let r = std::fs::read_to_string(&report).unwrap();
        let puts = r
            .split("\"puts\":")
            .nth(1)
            .and_then(|t| {
                t.trim()
                    .split([',', '}'])
                    .next()?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or_else(|| panic!("puts in {r}"));
        assert!(puts > 1000, "sort's pages on the daemon: {r}");
    }
    drop(daemon);
    // The C ABI as a C programmer uses it: the installed header and library, nothing else.
    let src = dir.join("region.c");
    std::fs::write(
        &src,
        r#"#include <netram.h>
#include <stdio.h>
#include <string.h>
int main(void) {
    netram_region *r = netram_region_create(NULL, "disk", 64 << 20, 4 << 20);
    if (!r) { printf("create: %s\n", netram_last_error()); return 1; }
    unsigned char *p = netram_alloc(r, 32 << 20);
    for (size_t i = 0; i < (32u << 20); i += 4096) p[i] = (unsigned char)(i >> 12);
    for (size_t i = 0; i < (32u << 20); i += 4096)
        if (p[i] != (unsigned char)(i >> 12)) { printf("wrong page\n"); return 1; }
    struct netram_counters c;
    netram_counters(r, &c);
    printf("evictions %s\n", c.evictions > 1000 ? "many" : "few");
    netram_region_destroy(r);
    return 0;
}
"#,
    )
    .unwrap();
    let exe = dir.join("region");
    run_ok(
        Command::new("cc")
            .arg("-o")
            .arg(&exe)
            .arg(&src)
            .arg("-lnetram"),
        "cc against the installed netram.h and libnetram.so",
    );
    let out = Command::new("timeout")
        .arg("120")
        .arg(&exe)
        .output()
        .unwrap();
    ok(&out, "a C program on the installed libnetram.so");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "evictions many\n");
    if Path::new("/run/systemd/system").exists()
        && netram_testkit::have_tools(&[("systemd-analyze", "systemd")])
    {
        run_ok(
            Command::new("systemd-analyze").args(["verify", "/lib/systemd/system/netram.service"]),
            "systemd-analyze verify",
        );
    }
    run_ok(
        Command::new("dpkg").args(["--purge", "netram"]),
        "dpkg --purge",
    );
    for gone in [
        "/usr/bin/netram",
        "/usr/lib/netram/libnetram_preload.so",
        "/usr/lib/libnetram.so",
        "/usr/include/netram.h",
        "/etc/netram/netram.toml",
        "/lib/udev/rules.d/70-netram-userfaultfd.rules",
    ] {
        assert!(!Path::new(gone).exists(), "{gone} left after purge");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A daemon started from the installed unit's command line, SIGTERMed by PID when dropped.
struct UnitDaemon {
    child: std::process::Child,
    addr: String,
}

impl Drop for UnitDaemon {
    fn drop(&mut self) {
        // By its PID, with the unit's KillSignal.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .output();
        let _ = self.child.wait();
    }
}

/// Writes a cluster's credentials (node 1, a server) and a loopback configuration into
/// /etc/netram, runs the unit's ExecStartPre and starts its ExecStart.
fn start_from_unit(dir: &Path) -> UnitDaemon {
    use std::io::BufRead;
    let ca = dir.join("ca");
    run_ok(
        Command::new("/usr/bin/netram")
            .args(["cluster", "init"])
            .arg(&ca),
        "netram cluster init",
    );
    for f in ["ca.pem", "crl.pem", "node.pem", "node.key"] {
        std::fs::copy(ca.join("node-1").join(f), Path::new("/etc/netram").join(f)).unwrap();
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let ctl = dir.join("ctl");
    std::fs::create_dir_all(&ctl).unwrap();
    std::fs::write(
        "/etc/netram/netram.toml",
        format!(
            "listen = \"127.0.0.1:{port}\"\ncapacity = \"64M\"\nmetrics = \"off\"\n\
             control = \"{}\"\n",
            ctl.join("control.sock").display()
        ),
    )
    .unwrap();
    let unit = std::fs::read_to_string("/lib/systemd/system/netram.service").unwrap();
    let line = |key: &str| -> Vec<String> {
        let l = unit
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap_or_else(|| panic!("no {key} in the unit"));
        let mut words: Vec<String> = l.split_whitespace().map(str::to_owned).collect();
        // What systemd's search path finds for a name without a path: the package's.
        if !words[0].starts_with('/') {
            words[0] = format!("/usr/bin/{}", words[0]);
        }
        words
    };
    let pre = line("ExecStartPre=");
    run_ok(
        Command::new(&pre[0]).args(&pre[1..]),
        "the unit's ExecStartPre",
    );
    let start = line("ExecStart=");
    let mut child = Command::new(&start[0])
        .args(&start[1..])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let daemon = UnitDaemon {
        child,
        addr: format!("127.0.0.1:{port}"),
    };
    assert!(
        first.starts_with(&format!("netram serve: listening on 127.0.0.1:{port}")),
        "the unit's daemon said: {first:?}"
    );
    daemon
}
