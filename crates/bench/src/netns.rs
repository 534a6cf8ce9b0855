//! Hosts for the benchmarks that cross a network: network namespaces of this machine on one
//! bridge (`ip netns`, veth), each with its own address, and the processes and mounts started
//! in them, all undone when the [`Net`] is dropped (also when a benchmark fails).

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub(crate) fn run(cmd: &mut Command) -> Result<Output, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(out)
}

pub(crate) fn sh(args: &[&str]) -> Result<Output, String> {
    run(Command::new(args[0]).args(&args[1..]))
}

/// The namespaces, the processes started in them and the mounts, undone on drop.
pub(crate) struct Net {
    prefix: String,
    hosts: usize,
    subnet: u8,
    dir: tempfile::TempDir,
    pub(crate) procs: Vec<Child>,
    pub(crate) mounts: Vec<PathBuf>,
}

impl Net {
    /// `hosts` hosts on a bridge, host i at 10.`subnet`.0.i/24; `tag` (two letters) starts
    /// every namespace's and link's name.
    pub(crate) fn new(tag: &str, hosts: usize, subnet: u8) -> Result<Self, String> {
        let net = Net {
            prefix: format!("{tag}{}", std::process::id() % 100_000),
            hosts,
            subnet,
            dir: tempfile::tempdir().map_err(|e| e.to_string())?,
            procs: Vec::new(),
            mounts: Vec::new(),
        };
        let hub = net.ns(0);
        sh(&["ip", "netns", "add", &hub])?;
        sh(&["ip", "-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        sh(&["ip", "-n", &hub, "link", "set", "br0", "up"])?;
        for i in 1..=net.hosts {
            let ns = net.ns(i);
            let veth = format!("{}v{i}", net.prefix);
            sh(&["ip", "netns", "add", &ns])?;
            sh(&[
                "ip", "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            sh(&["ip", "link", "set", &veth, "netns", &hub])?;
            sh(&[
                "ip", "-n", &hub, "link", "set", &veth, "master", "br0", "up",
            ])?;
            sh(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", net.ip(i)),
                "dev",
                "eth0",
            ])?;
            sh(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    /// Host `i`'s address.
    pub(crate) fn ip(&self, i: usize) -> String {
        format!("10.{}.0.{i}", self.subnet)
    }

    pub(crate) fn ns(&self, i: usize) -> String {
        if i == 0 {
            format!("{}hub", self.prefix)
        } else {
            format!("{}h{i}", self.prefix)
        }
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `cmd` on host `i`: in its network namespace only (`nsenter --net`), so that mounts
    /// made there are everybody's, as on one machine's file system.
    pub(crate) fn on(&self, i: usize, cmd: &str) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.ns(i))).arg(cmd);
        c
    }

    pub(crate) fn spawn(&mut self, mut cmd: Command, log: &str) -> Result<u32, String> {
        let out = std::fs::File::create(self.path(log)).map_err(|e| e.to_string())?;
        let child = cmd
            .stdout(out.try_clone().map_err(|e| e.to_string())?)
            .stderr(out)
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("{cmd:?}: {e}"))?;
        let pid = child.id();
        self.procs.push(child);
        Ok(pid)
    }

    /// Ends the process `pid` (SIGTERM, then SIGKILL after `grace`).
    pub(crate) fn stop(&mut self, pid: u32, grace: Duration) {
        let Some(at) = self.procs.iter().position(|c| c.id() == pid) else {
            return;
        };
        let mut c = self.procs.swap_remove(at);
        // SAFETY: kill(2) on the PID of a child this guard owns and has not reaped.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if c.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // The daemons' logs, for a run being looked into (they go with the directory).
        if let Some(keep) = std::env::var_os("NETRAM_BENCH_KEEP_LOGS") {
            let keep = PathBuf::from(keep);
            let _ = std::fs::create_dir_all(&keep);
            if let Ok(entries) = std::fs::read_dir(self.dir.path()) {
                for e in entries.flatten() {
                    let name = e.file_name();
                    if name.to_string_lossy().ends_with(".log") {
                        let _ = std::fs::copy(e.path(), keep.join(&name));
                    }
                }
            }
        }
        for m in self.mounts.iter().rev() {
            let _ = Command::new("umount").arg("-l").arg(m).status();
        }
        for p in &mut self.procs {
            let _ = p.kill();
            let _ = p.wait();
        }
        for i in (0..=self.hosts).rev() {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(i)])
                .status();
        }
    }
}

pub(crate) fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        if Instant::now() > deadline {
            return Err(format!("{what}: not within {secs} s"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}
