//! Helpers shared by the multi-process tests: child processes that are killed by their PID when
//! their guard drops, also when a test fails.
#![allow(dead_code)] // each test binary uses its own part

use std::io::BufRead;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant};

pub const NETRAM: &str = env!("CARGO_BIN_EXE_netram");

/// The tests' cluster, made by `netram cluster init` itself (once per test process, under
/// cargo's scratch directory for tests): its CA directory, where `netram keygen` and `netram
/// revoke` work.
pub fn ca_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir =
            Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cluster-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let out = Command::new(NETRAM)
            .args(["cluster", "init"])
            .arg(&dir)
            .output()
            .expect("run netram cluster init");
        assert!(
            out.status.success(),
            "netram cluster init: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    })
}

/// Node 1's credentials in the tests' cluster (`cluster init` puts them apart from the CA):
/// every server the tests start, every client and every tool authenticates with them, as a
/// real cluster's node does.
pub fn tls_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| ca_dir().join("node-1"))
}

/// `netram keygen` writes the cluster's list of issued certificates: one at a time.
pub static KEYGEN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Credentials of server node `node`, issued by the tests' cluster (once per test process):
/// daemons that are to be members of one cluster need node ids of their own.
pub fn node_dir(node: u64) -> PathBuf {
    let _one = KEYGEN.lock().unwrap_or_else(|e| e.into_inner());
    let out = tls_dir().with_file_name(format!("node-{node}-{}", std::process::id()));
    if !out.join("node.pem").exists() {
        let st = netram()
            .args(["keygen", "--cluster"])
            .arg(ca_dir())
            .args(["--node", &node.to_string(), "--server", "--out"])
            .arg(&out)
            .status()
            .unwrap();
        assert!(st.success());
    }
    out
}

/// `netram` with this test process's credentials (`NETRAM_TLS`), for it and what it starts.
pub fn netram() -> Command {
    let mut c = Command::new(NETRAM);
    c.env("NETRAM_TLS", tls_dir());
    c
}

/// `cmd` (which starts `netram`, e.g. under `timeout`) with the tests' credentials.
pub fn netram_env(mut cmd: Command) -> Command {
    cmd.env("NETRAM_TLS", tls_dir());
    cmd
}

/// A client of the tests' servers (a fresh identity).
pub fn client() -> netram_client::ClientConfig {
    netram_client::ClientConfig {
        security: security(),
        ..netram_client::ClientConfig::new()
    }
}

/// A client of the tests' servers that keeps node id `node` across restarts.
pub fn client_node(node: u64) -> netram_client::ClientConfig {
    netram_client::ClientConfig {
        security: security(),
        ..netram_client::ClientConfig::with_node(node)
    }
}

/// How the tests' own pagers reach the servers.
pub fn security() -> netram_client::Security {
    netram_client::security(Some(tls_dir()), false).expect("the tests' credentials")
}

/// The `netram` whose servers the tests start: this build, or the one `NETRAM_TEST_SERVER`
/// names, to check that a test fails against a build without its fix (the clients, `netram
/// stats` among them, stay this build's).
fn server_exe() -> String {
    std::env::var("NETRAM_TEST_SERVER").unwrap_or_else(|_| NETRAM.to_string())
}

/// Starts `netram ARGS` and reads the first line it prints, which must start with `prefix`;
/// returns the child and the rest of that line.
pub fn spawn_reporting(args: &[&str], prefix: &str) -> (Child, String) {
    try_spawn_reporting(args, prefix).unwrap_or_else(|e| panic!("{e}"))
}

/// [`spawn_reporting`], saying why it failed instead of panicking (the child is ended).
fn try_spawn_reporting(args: &[&str], prefix: &str) -> Result<(Child, String), String> {
    let mut cmd = Command::new(server_exe());
    // The tests' credentials, unless the process is told to run in clear.
    if !args.contains(&"--insecure") {
        cmd.env("NETRAM_TLS", tls_dir());
    }
    let mut child = cmd
        .args(args)
        .stdout(Stdio::piped())
        .stderr(if std::env::var_os("NETRAM_TEST_STDERR").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        })
        .spawn()
        .expect("start netram");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(l) => l,
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("netram {args:?} did not report its address"));
        }
    };
    match line.trim().strip_prefix(prefix) {
        Some(rest) => Ok((child, rest.to_string())),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            Err(format!("netram {args:?}: unexpected first line {line:?}"))
        }
    }
}

/// Whether both a TCP listener and a UDP socket can bind `addr` now.
fn port_is_free(addr: &str) -> bool {
    std::net::TcpListener::bind(addr).is_ok() && std::net::UdpSocket::bind(addr).is_ok()
}

/// A loopback port for a server that a test restarts at the same address. Ports that the
/// kernel hands out itself (`:0`, and the local end of every outgoing connection) come from
/// its ephemeral range (`ip_local_port_range`); a port from there, free when picked, may be the
/// local end of some other test's connection by the time a killed server restarts on it. So
/// this picks one below that range, free for TCP and UDP now, at random (parallel test
/// processes pick from the same range).
pub fn reserved_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (from, to) = (low.saturating_sub(12_000).max(1024), low);
    for _ in 0..1000 {
        let port = fastrand::u16(from..to);
        if port_is_free(&format!("127.0.0.1:{port}")) {
            return port;
        }
    }
    panic!("no free port in {from}..{to}");
}

/// A test's daemon has no control socket unless the test gives one: the default is in
/// /run/netram as root, shared by the machine, and a SIGKILLed daemon leaves its socket there.
fn no_control_unless_given(args: &mut Vec<&str>) {
    if !args.contains(&"--control") {
        args.extend(["--control", "off"]);
    }
}

/// A `netram serve` child process, SIGKILLed by PID on drop.
pub struct ServerProcess {
    pub child: Child,
    pub addr: String,
    /// Started `--insecure`: in clear TCP.
    pub insecure: bool,
}

impl ServerProcess {
    pub fn start(args: &[&str]) -> Self {
        let mut all = vec!["serve", "--listen", "127.0.0.1:0"];
        all.extend_from_slice(args);
        no_control_unless_given(&mut all);
        let (child, addr) = spawn_reporting(&all, "netram serve: listening on ");
        Self {
            child,
            addr,
            insecure: args.contains(&"--insecure"),
        }
    }

    /// Starts a server on a port of its own below the kernel's ephemeral range, so that it can
    /// be restarted there after it is killed (see [`reserved_port`]).
    /// Parallel test processes pick from one range: a port free when picked may be taken
    /// before the server binds it (CI saw it once), so a server that does not start is
    /// started again on another port.
    pub fn start_restartable(args: &[&str]) -> Self {
        let mut tries = 0;
        loop {
            let mut all = vec!["serve", "--listen"];
            let addr = format!("127.0.0.1:{}", reserved_port());
            all.push(&addr);
            all.extend_from_slice(args);
            no_control_unless_given(&mut all);
            match try_spawn_reporting(&all, "netram serve: listening on ") {
                Ok((child, addr)) => {
                    return Self {
                        child,
                        addr,
                        insecure: args.contains(&"--insecure"),
                    }
                }
                Err(e) if tries >= 4 => panic!("{e}"),
                Err(_) => tries += 1,
            }
        }
    }

    /// Starts a server on a given address (a restart on the address of one that died). Waits
    /// (10 s at most) until the address is free for both TCP and the membership's UDP: a
    /// killed server's sockets may take a moment to go.
    pub fn start_at(addr: &str, args: &[&str]) -> Self {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !port_is_free(addr) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut all = vec!["serve", "--listen", addr];
        all.extend_from_slice(args);
        no_control_unless_given(&mut all);
        let (child, addr) = spawn_reporting(&all, "netram serve: listening on ");
        Self {
            child,
            addr,
            insecure: args.contains(&"--insecure"),
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on the PID of a child this guard owns and has not yet reaped.
        let rc = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(rc, 0, "kill({}, {sig})", self.pid());
    }

    /// Waits until every thread of the process is stopped (state `T`): `kill(SIGSTOP)`
    /// returns before the threads have actually stopped, and one may still answer meanwhile.
    pub fn wait_stopped(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let tasks = std::fs::read_dir(format!("/proc/{}/task", self.pid())).unwrap();
            let all_stopped = tasks.flatten().all(|t| {
                let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                // The state follows the command name, which is in parentheses.
                stat.rsplit_once(')')
                    .map(|(_, rest)| rest.trim_start().starts_with('T'))
                    .unwrap_or(true)
            });
            if all_stopped {
                return;
            }
            assert!(Instant::now() < deadline, "the server did not stop");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn stat(&self, name: &str) -> u64 {
        let mut cmd = if self.insecure {
            let mut c = Command::new(NETRAM);
            c.args(["stats", "--insecure"]);
            c
        } else {
            let mut c = netram();
            c.arg("stats");
            c
        };
        let out = cmd
            .args([&self.addr, "--json"])
            .output()
            .expect("run netram stats");
        assert!(
            out.status.success(),
            "netram stats: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stats JSON");
        v[name]
            .as_u64()
            .unwrap_or_else(|| panic!("no counter {name} in {v}"))
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The resident memory of process `pid`, bytes.
pub fn vm_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

/// Waits until `f` holds, for at most `secs` seconds.
pub fn eventually(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The whole answer (status line, headers, body) to `GET path` at `addr` over plain HTTP/1.1,
/// with a bearer token if `token`; read for at most 5 s.
pub fn http_get(addr: &str, path: &str, token: Option<&str>) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// TLS daemons (nodes `first_node + 1..`, each after the first seeded with the first), one
/// per capacity, each with a control socket in `dir`; and the control socket of daemon `i`
/// (from 1).
pub fn daemons<const N: usize>(
    dir: &Path,
    first_node: u64,
    capacities: [&str; N],
) -> (Vec<ServerProcess>, impl Fn(u64) -> String) {
    let dir = dir.to_path_buf();
    let control = move |i: u64| dir.join(format!("d{i}.sock")).to_str().unwrap().to_string();
    let mut out: Vec<ServerProcess> = Vec::new();
    for (i, capacity) in (1..=N as u64).zip(capacities) {
        let tls = node_dir(first_node + i);
        let sock = control(i);
        let mut args = vec![
            "--tls",
            tls.to_str().unwrap(),
            "--capacity",
            capacity,
            "--control",
            &sock,
        ];
        let seed = out.first().map(|d| d.addr.clone());
        if let Some(s) = &seed {
            args.extend(["--seed", s]);
        }
        out.push(ServerProcess::start(&args));
    }
    (out, control)
}

/// `tests/c/NAME.c` compiled into `dir` (with `libs`), or `None` (the test skipped, said so)
/// without a C compiler.
pub fn compile_c(dir: &Path, name: &str, libs: &[&str]) -> Option<PathBuf> {
    if !netram_testkit::have_tools(&[("cc", "gcc")]) {
        return None;
    }
    let exe = dir.join(name);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let out = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-o"])
        .arg(&exe)
        .arg(&src)
        .args(libs)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cc {name}.c: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(exe)
}
