//! netram between real hosts: five network namespaces, each a host with its own address, joined
//! by veth pairs through a bridge (in a sixth namespace, so the machine's own network is not
//! touched), every host's link shaped to 1 Gbit/s with `tc … tbf`. Every host runs `netram
//! serve` with its own node certificate and finds the others through one seed; two hosts run
//! `netram nbd` with no server list (their daemons name the others) and fio's NBD engine
//! writes and verifies every block through it; a program on the donor host grows until the
//! donor gives back most of its memory (the daemon reads the real /proc) while the two others
//! page to it; their pages migrate, every block verifies, nothing is lost, the donor's resident
//! memory falls. A fifth host joins and leaves.
//!
//! Root only (namespaces, bridges, tc); every namespace, link and process is removed by a
//! guard, also when the test fails.

mod common;

use netram_testkit::{have_root, have_tools};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const HOSTS: usize = 5;

/// The namespaces and the processes started in them, undone on drop.
struct Net {
    prefix: String,
    procs: Vec<Child>,
    /// Where the hosts' daemons put their control sockets.
    ctl: tempfile::TempDir,
}

fn sh(args: &[&str]) -> Output {
    Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

fn must(args: &[&str]) {
    let out = sh(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Net {
    fn new(shaped: bool) -> Self {
        Self::tagged(shaped, if shaped { 's' } else { 'u' })
    }

    /// A net whose namespaces' names carry `tag`: tests that run at once each their own.
    fn tagged(shaped: bool, tag: char) -> Self {
        let net = Net {
            prefix: format!("nr{}{tag}", std::process::id() % 100_000),
            procs: Vec::new(),
            ctl: tempfile::tempdir().unwrap(),
        };
        let hub = net.hub();
        must(&["ip", "netns", "add", &hub]);
        must(&["ip", "-n", &hub, "link", "add", "br0", "type", "bridge"]);
        must(&["ip", "-n", &hub, "link", "set", "br0", "up"]);
        for i in 1..=HOSTS {
            let ns = net.ns(i);
            let veth = format!("{}v{i}", net.prefix);
            must(&["ip", "netns", "add", &ns]);
            must(&[
                "ip", "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ]);
            must(&["ip", "link", "set", &veth, "netns", &hub]);
            must(&[
                "ip", "-n", &hub, "link", "set", &veth, "master", "br0", "up",
            ]);
            must(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", ip(i)),
                "dev",
                "eth0",
            ]);
            must(&["ip", "-n", &ns, "link", "set", "eth0", "up"]);
            must(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
            if shaped {
                must(&[
                    "ip", "netns", "exec", &ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                    "rate", "1gbit", "burst", "512kb", "latency", "10ms",
                ]);
            }
        }
        net
    }

    fn hub(&self) -> String {
        format!("{}hub", self.prefix)
    }

    fn ns(&self, i: usize) -> String {
        format!("{}h{i}", self.prefix)
    }

    /// Host `i`'s daemon's control socket (the hosts share one file system: each its own),
    /// which everything run on host `i` asks (`NETRAM_DAEMON`).
    fn control(&self, i: usize) -> PathBuf {
        self.ctl.path().join(format!("h{i}.sock"))
    }

    /// `netram ARGS` on host `i`, its output collected.
    fn netram(&self, i: usize, args: &[&str]) -> Output {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(i), common::NETRAM])
            .args(args)
            .env("NETRAM_DAEMON", self.control(i));
        c.output().unwrap()
    }

    /// Starts `cmd ARGS` on host `i`, killed by its PID when the net is dropped.
    fn spawn(&mut self, i: usize, cmd: &str, args: &[&str], log: &Path) -> u32 {
        let out = std::fs::File::create(log).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns(i), cmd])
            .args(args)
            .env("NETRAM_DAEMON", self.control(i))
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        self.procs.push(child);
        pid
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for p in &mut self.procs {
            let _ = p.kill();
            let _ = p.wait();
        }
        for i in 1..=HOSTS {
            let _ = sh(&["ip", "netns", "del", &self.ns(i)]);
        }
        let _ = sh(&["ip", "netns", "del", &self.hub()]);
    }
}

fn ip(i: usize) -> String {
    format!("10.77.0.{i}")
}

fn addr(i: usize) -> String {
    format!("{}:7077", ip(i))
}

fn eventually(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn mem_available() -> u64 {
    let m = std::fs::read_to_string("/proc/meminfo").unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap()
        * 1024
}

fn rss(pid: u32) -> u64 {
    common::vm_rss(pid)
}

/// Host `i`'s certificate, naming its address.
fn credentials(dir: &Path, i: usize) -> PathBuf {
    let out = dir.join(format!("node{i}"));
    let st = common::netram()
        .args(["keygen", "--cluster"])
        .arg(common::ca_dir())
        .args([
            "--node",
            &i.to_string(),
            "--server",
            "--ip",
            &ip(i),
            "--out",
        ])
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success());
    out
}

fn members_alive(net: &Net, on: usize) -> Vec<u64> {
    let out = net.netram(on, &["members", "--json"]);
    if !out.status.success() {
        return Vec::new();
    }
    let list: netram_member::MemberList = match serde_json::from_slice(&out.stdout) {
        Ok(l) => l,
        Err(_) => return Vec::new(),
    };
    let mut v: Vec<u64> = list
        .members
        .iter()
        .filter(|r| r.state == netram_member::Liveness::Alive)
        .map(|r| r.node)
        .collect();
    v.sort();
    v
}

fn stat(net: &Net, on: usize, tls: &Path, name: &str) -> u64 {
    let out = net.netram(
        on,
        &["stats", &addr(on), "--json", "--tls", tls.to_str().unwrap()],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v[name].as_u64().unwrap_or_else(|| panic!("no {name}"))
}

/// fio through host `i`'s NBD socket: writes (and verifies) or only verifies the same blocks.
fn fio(net: &Net, i: usize, socket: &Path, verify_only: bool, scratch: &Path) -> serde_json::Value {
    let uri = format!("--uri=nbd+unix:///?socket={}", socket.display());
    let mut args = vec![
        "netns".to_string(),
        "exec".into(),
        net.ns(i),
        "fio".into(),
        "--name=netns".into(),
        "--ioengine=nbd".into(),
        uri,
        "--rw=randwrite".into(),
        "--bs=4k".into(),
        "--iodepth=16".into(),
        "--size=160M".into(),
        "--randseed=7".into(),
        "--verify=crc32c".into(),
        "--verify_fatal=1".into(),
        "--output-format=json".into(),
        format!("--filename={}", scratch.join(format!("fio{i}")).display()),
    ];
    if verify_only {
        args.push("--verify_only".into());
    } else {
        args.push("--do_verify=1".into());
    }
    let out = Command::new("ip").args(&args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "fio on host {i}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = &text[text.find('{').expect("fio JSON")..];
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(v["jobs"][0]["error"], 0, "fio on host {i}");
    v
}

fn cluster_pages_to_a_growing_donor(shaped: bool) {
    if !have_root("network namespaces") {
        return;
    }
    if !have_tools(&[
        ("ip", "iproute2"),
        ("tc", "iproute2"),
        ("fio", "fio"),
        ("python3", "python3"),
    ]) {
        return;
    }
    // One scenario at a time: each measures the machine's available memory and grows a
    // program against it.
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let mut net = Net::new(shaped);
    // creds[i] is host i's (creds[0] unused).
    let creds: Vec<PathBuf> = std::iter::once(PathBuf::new())
        .chain((1..=HOSTS).map(|i| credentials(dir, i)))
        .collect();
    let daemon = |net: &mut Net, i: usize, extra: &[&str]| -> u32 {
        let tls = creds[i].to_str().unwrap().to_string();
        let mut args = vec![
            "serve",
            "--tls",
            &tls,
            "--listen",
            &addr(i) as &str,
            "--seed",
            "10.77.0.1:7077",
        ]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
        args.extend(["--control".into(), net.control(i).display().to_string()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        net.spawn(i, common::NETRAM, &args, &dir.join(format!("serve{i}.log")))
    };
    // Host 1 gives its memory to the cluster while its own programs leave it idle: it keeps
    // 1 GiB less than the machine has now for them, and offers up to 512 MiB.
    let reserve = format!("{}M", mem_available().saturating_sub(1 << 30) >> 20);
    let donor = daemon(
        &mut net,
        1,
        &[
            "--capacity",
            "512M",
            "--adapt",
            "--reserve",
            &reserve,
            "--chunk",
            "32M",
            "--grow-after",
            "200ms",
        ],
    );
    daemon(&mut net, 2, &["--capacity", "32M"]);
    daemon(&mut net, 3, &["--capacity", "32M"]);
    daemon(&mut net, 4, &["--capacity", "512M"]);
    for h in 1..=4 {
        eventually(&format!("host {h} sees the four"), 30, || {
            members_alive(&net, h) == [1, 2, 3, 4]
        });
    }
    let tls1 = creds[1].clone();
    eventually("the donor offers its 512 MiB", 30, || {
        stat(&net, 1, &tls1, "capacity_pages") == 131_072
    });

    // Hosts 2 and 3: a device on the cluster, with no server list.
    let mut sockets = Vec::new();
    for h in [2, 3] {
        let socket = dir.join(format!("nbd{h}.sock"));
        let tls = creds[h].to_str().unwrap().to_string();
        net.spawn(
            h,
            common::NETRAM,
            &[
                "nbd",
                "--size",
                "256M",
                "--cache",
                "8M",
                "--tls",
                &tls,
                "--socket",
                socket.to_str().unwrap(),
            ],
            &dir.join(format!("nbd{h}.log")),
        );
        sockets.push((h, socket));
    }
    for (_, s) in &sockets {
        eventually("the NBD socket", 30, || s.exists());
    }
    for (h, s) in &sockets {
        fio(&net, *h, s, false, dir);
    }
    let held = stat(&net, 1, &tls1, "stored_pages");
    let on_four = stat(&net, 4, &creds[4], "stored_pages");
    assert!(held > 10_000, "the donor holds {held} pages");
    let rss_before = rss(donor);

    // A program on host 1 grows by 1.25 GiB and holds it; the clients keep verifying meanwhile.
    net.spawn(
        1,
        "python3",
        &[
            "-c",
            "import time\nb=[]\nfor i in range(80):\n b.append(b'\\x01'*(16<<20))\n time.sleep(0.02)\ntime.sleep(60)",
        ],
        &dir.join("grow.log"),
    );
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(8) {
        for (h, s) in &sockets {
            fio(&net, *h, s, true, dir);
        }
    }
    eventually("the donor's pages have left", 120, || {
        stat(&net, 1, &tls1, "stored_pages") < held / 10
            && stat(&net, 1, &tls1, "pages_beyond_offer") == 0
    });
    // Every block of both devices, after the move.
    for (h, s) in &sockets {
        fio(&net, *h, s, true, dir);
    }
    let rss_after = rss(donor);
    assert!(
        rss_after + held * 4096 / 2 < rss_before,
        "the donor's resident memory fell from {rss_before} to only {rss_after}"
    );
    let moved = stat(&net, 4, &creds[4], "stored_pages").saturating_sub(on_four);
    // Server to server (Nswap's MIGRATE), not through the clients: host 4 adopted what the
    // donor handed over.
    let adopted = stat(&net, 4, &creds[4], "pages_adopted");
    let handed = stat(&net, 1, &tls1, "pages_handed_over");
    eprintln!(
        "netns ({}): the donor held {held} pages; {moved} more on host 4 after ({adopted} \
         adopted from the donor's {handed} handed over); donor RSS {} -> {} MiB; offer now {} \
         pages",
        if shaped { "1 Gbit/s" } else { "unshaped" },
        rss_before >> 20,
        rss_after >> 20,
        stat(&net, 1, &tls1, "capacity_pages")
    );
    assert!(
        moved > held / 2,
        "{moved} of the donor's {held} pages went to host 4"
    );
    assert!(
        adopted > held / 2 && handed >= adopted,
        "{adopted} of the donor's {held} pages went to host 4 server to server ({handed} handed \
         over)"
    );

    // Host 5 joins, then leaves: everyone sees it come and go.
    let five = daemon(&mut net, 5, &["--capacity", "32M"]);
    eventually("host 5 joined", 30, || {
        members_alive(&net, 2) == [1, 2, 3, 4, 5]
    });
    // SAFETY: kill(2) on the PID of a child this test started and has not reaped.
    unsafe { libc::kill(five as i32, libc::SIGTERM) };
    eventually("host 5 left", 30, || members_alive(&net, 3) == [1, 2, 3, 4]);
}

#[test]
fn netns_cluster_shaped_1gbit() {
    cluster_pages_to_a_growing_donor(true);
}

#[test]
fn netns_cluster_unshaped() {
    cluster_pages_to_a_growing_donor(false);
}

/// Memory shared between five hosts (MIRAGE+; issue 40), over links shaped to 1 Gbit/s: every
/// host's daemon its own certificate, every host running real processes. Randomized adds and
/// loads on hot words from all five at once: no process reads a word below what it saw
/// before (per-location order), and each word ends equal to the adds made to it (none lost).
/// Then an unmodified System V program: a matrix multiply's coordinator on host 1 and a
/// worker on each of the four others, its product checked entry by entry.
#[test]
fn netns_shared_memory_on_five_hosts() {
    if !have_root("network namespaces") {
        return;
    }
    if !have_tools(&[("ip", "iproute2"), ("tc", "iproute2")]) {
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let Some(matmul) = common::compile_c(dir, "sysv_matmul", &[]) else {
        return;
    };
    let matmul = matmul.to_str().unwrap().to_string();
    let mut net = Net::tagged(true, 'm');
    for i in 1..=HOSTS {
        let tls = credentials(dir, i);
        let ctl = net.control(i).display().to_string();
        let args = [
            "serve",
            "--tls",
            tls.to_str().unwrap(),
            "--listen",
            &addr(i),
            "--seed",
            "10.77.0.1:7077",
            "--capacity",
            "32M",
            "--control",
            &ctl,
        ];
        net.spawn(i, common::NETRAM, &args, &dir.join(format!("serve{i}.log")));
    }
    for i in 1..=HOSTS {
        eventually("every host sees every other", 30, || {
            members_alive(&net, i).len() == HOSTS
        });
    }
    let ok = |out: Output, what: &str| -> String {
        assert!(
            out.status.success(),
            "{what}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    ok(net.netram(1, &["shm", "create", "hot", "16KiB"]), "create");

    // Five hosts at once, each its own process and its own random sequence.
    let words = 8;
    let runs: Vec<std::thread::JoinHandle<Output>> = (1..=HOSTS)
        .map(|i| {
            let ns = net.ns(i);
            let ctl = net.control(i);
            std::thread::spawn(move || {
                // Bounded: a process that hangs ends by itself (timeout), as every process a
                // test starts must.
                Command::new("ip")
                    .args(["netns", "exec", &ns, "timeout", "120", common::NETRAM])
                    .args(["shm", "check", "hot"])
                    .args(["--seed", &i.to_string(), "--ops", "1500", "--words", "8"])
                    .env("NETRAM_DAEMON", ctl)
                    .output()
                    .unwrap()
            })
        })
        .collect();
    let mut total = vec![0u64; words];
    for (i, r) in runs.into_iter().enumerate() {
        let out = ok(r.join().unwrap(), &format!("check on host {}", i + 1));
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        for (w, n) in v["added"].as_array().unwrap().iter().enumerate() {
            total[w] += n.as_u64().unwrap();
        }
    }
    for (w, &want) in total.iter().enumerate() {
        let offset = (w * 2048).to_string();
        let out = net.netram(3, &["shm", "cat", "hot", "--offset", &offset, "--len", "8"]);
        assert!(out.status.success());
        let got = u64::from_le_bytes(out.stdout[..8].try_into().unwrap());
        assert_eq!(got, want, "word {w}: every add from five hosts counted");
    }

    // The System V program: a coordinator and four workers on five hosts.
    let sysv = |i: usize, args: &[&str]| {
        let mut c = Command::new("ip");
        c.args([
            "netns",
            "exec",
            &net.ns(i),
            common::NETRAM,
            "shm",
            "run",
            "--",
        ])
        .args(args)
        .env("NETRAM_DAEMON", net.control(i))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        c.spawn().unwrap()
    };
    let coordinator = sysv(1, &[&matmul, "coordinator", "0x5108", "4", "96"]);
    let workers: Vec<Child> = (2..=HOSTS)
        .map(|i| {
            let index = (i - 2).to_string();
            sysv(i, &[&matmul, "worker", "0x5108", "4", "96", &index])
        })
        .collect();
    for w in workers {
        ok(w.wait_with_output().unwrap(), "a worker");
    }
    let out = ok(coordinator.wait_with_output().unwrap(), "the coordinator");
    assert!(out.starts_with("ok "), "{out}");
}
