//! Memory shared between machines (MIRAGE+; issue 40) through real daemons: three TLS
//! daemons on loopback, each a machine's agent, and `netram shm` processes attached through
//! each. What one machine's process stores, the others' processes load; turns taken by
//! processes on three machines on one word count exactly.

mod common;

use std::process::Output;

/// `netram` under `timeout`: every process a test starts ends by itself.
fn bounded() -> std::process::Command {
    let mut c = std::process::Command::new("timeout");
    c.args(["120", common::NETRAM]);
    c
}

fn shm(control: &str, args: &[&str], stdin: Option<&[u8]>) -> Output {
    use std::io::Write;
    let mut cmd = bounded();
    cmd.args(["shm", "--daemon", control]).args(args);
    cmd.stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .env("RUST_BACKTRACE", "0");
    let mut child = cmd.spawn().unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(data) = stdin {
        input.write_all(data).unwrap();
    }
    drop(input);
    child.wait_with_output().unwrap()
}

fn ok(out: Output) -> Vec<u8> {
    assert!(
        out.status.success(),
        "netram shm failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn refused(out: Output, why: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(why),
        "expected {why:?}: {err}"
    );
}

/// Waits until daemon `control` lists `n` members alive.
fn wait_members(control: &str, n: usize) {
    common::eventually("every daemon to know every other", 20, || {
        let out = common::netram()
            .args(["members", "--daemon", control, "--json"])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        v["members"]
            .as_array()
            .is_some_and(|m| m.iter().filter(|r| r["state"] == "alive").count() == n)
    });
}

#[test]
fn a_segment_is_shared_by_processes_on_three_machines() {
    let dir = tempfile::tempdir().unwrap();
    let (daemons, control) = common::daemons(dir.path(), 520, ["8M", "8M", "8M"]);
    for i in 1..=3 {
        wait_members(&control(i), 3);
    }
    let out = ok(shm(&control(1), &["create", "matrix", "64KiB"], None));
    assert!(String::from_utf8_lossy(&out).contains("65536 bytes"));

    // Written through machine 2, read through 3 and 1 (a page moves from 2's memory).
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
    ok(shm(
        &control(2),
        &["write", "matrix", "--offset", "5000"],
        Some(&data),
    ));
    for i in [3, 1] {
        let got = ok(shm(
            &control(i),
            &["cat", "matrix", "--offset", "5000", "--len", "10000"],
            None,
        ));
        assert_eq!(got, data, "read through daemon {i}");
    }
    // The rest is still zero; the segment outlived the processes that wrote it.
    let head = ok(shm(&control(3), &["cat", "matrix", "--len", "5000"], None));
    assert!(head.iter().all(|&b| b == 0));

    // Three processes on three machines take 200 turns each on one word.
    let turns: Vec<_> = (0..3u64)
        .map(|t| {
            let c = control(t + 1);
            std::thread::spawn(move || {
                let turn = t.to_string();
                let out = ok(shm(
                    &c,
                    &[
                        "turns",
                        "matrix",
                        "--parties",
                        "3",
                        "--turn",
                        &turn,
                        "--rounds",
                        "200",
                        "--slot",
                        "4096",
                    ],
                    None,
                ));
                String::from_utf8(out)
                    .unwrap()
                    .trim()
                    .parse::<u64>()
                    .unwrap()
            })
        })
        .collect();
    let ends: Vec<u64> = turns.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(ends.iter().max(), Some(&600), "{ends:?}");
    assert!(ends.iter().all(|&e| (598..=600).contains(&e)), "{ends:?}");
    let word = ok(shm(
        &control(2),
        &["cat", "matrix", "--offset", "32768", "--len", "8"],
        None,
    ));
    assert_eq!(u64::from_le_bytes(word.try_into().unwrap()), 600);

    // The messages went over the daemons' authenticated connections, none refused or lost.
    let sent: u64 = daemons.iter().map(|d| d.stat("dsm_frames_sent")).sum();
    let received: u64 = daemons.iter().map(|d| d.stat("dsm_frames_received")).sum();
    assert!(sent >= 600, "{sent} frames sent");
    assert_eq!(sent, received);
    for d in &daemons {
        assert_eq!(d.stat("dsm_frames_lost"), 0);
        assert_eq!(d.stat("dsm_frames_refused"), 0);
        assert_eq!(d.stat("dsm_links_refused"), 0);
    }
    // The links' connections were handed to the agents, which read them themselves.
    let adopted: u64 = daemons.iter().map(|d| d.stat("dsm_links_adopted")).sum();
    assert!(adopted >= 2, "{adopted} links read by the agents");
    // Pages of one counter each and zeros travel compressed (the daemons' default link speed,
    // 1 Gbit/s, makes that pay), and came back whole (the counts above).
    let compressed: u64 = daemons
        .iter()
        .map(|d| d.stat("dsm_agent_pages_compressed"))
        .sum();
    assert!(compressed > 0, "no page was sent compressed");
}

#[test]
fn names_nodes_and_sizes_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let (daemons, control) = common::daemons(dir.path(), 530, ["8M", "8M"]);
    for i in 1..=2 {
        wait_members(&control(i), 2);
    }
    let node1 = (530 + 1).to_string();
    ok(shm(
        &control(1),
        &["create", "mine", "4096", "--nodes", &node1],
        None,
    ));
    ok(shm(&control(1), &["create", "open", "4096"], None));
    // A second segment of the same name, created here or on another machine.
    refused(
        shm(&control(1), &["create", "open", "4096"], None),
        "exists",
    );
    refused(
        shm(&control(2), &["create", "open", "4096"], None),
        "exists",
    );
    // Node 2 is not admitted to "mine": to it the segment does not exist.
    refused(
        shm(&control(2), &["cat", "mine"], None),
        "no segment called mine",
    );
    ok(shm(&control(1), &["cat", "mine", "--len", "8"], None));
    refused(
        shm(&control(2), &["cat", "nothing"], None),
        "no segment called nothing",
    );
    // Out of the segment's range, a bad name, a size beyond the limit.
    refused(
        shm(
            &control(2),
            &["cat", "open", "--offset", "4000", "--len", "200"],
            None,
        ),
        "past the segment's end",
    );
    refused(
        shm(&control(1), &["create", "a\tb", "4096"], None),
        "bad segment name",
    );
    refused(
        shm(&control(1), &["create", "huge", "1TiB"], None),
        "a segment is 1 byte to",
    );
    drop(daemons);
}

/// Three daemons that know each other, for the System V tests.
fn three(
    dir: &std::path::Path,
    first: u64,
) -> (Vec<common::ServerProcess>, impl Fn(u64) -> String) {
    let (daemons, control) = common::daemons(dir, first, ["8M", "8M", "8M"]);
    for i in 1..=3 {
        wait_members(&control(i), 3);
    }
    (daemons, control)
}

/// `netram shm run` of `program` through daemon `control`, as a child.
fn sysv(control: &str, program: &[&str]) -> std::process::Child {
    bounded()
        .args(["shm", "--daemon", control, "run", "--"])
        .args(program)
        .env("RUST_BACKTRACE", "0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

fn output(child: std::process::Child, what: &str) -> String {
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// A C program written against System V shared memory and semaphores (it knows nothing of
/// netram) multiplies matrices with its coordinator on one machine and two workers on two
/// others; the coordinator checks every entry against its own product.
#[test]
fn an_unmodified_system_v_program_runs_on_three_machines() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = common::compile_c(dir.path(), "sysv_matmul", &[]) else {
        return;
    };
    let exe = exe.to_str().unwrap().to_string();
    let (_daemons, control) = three(dir.path(), 540);
    let n = "96";
    let coordinator = sysv(&control(1), &[&exe, "coordinator", "0x5107", "2", n]);
    let workers: Vec<_> = (0..2)
        .map(|w| {
            let index = w.to_string();
            sysv(&control(w + 2), &[&exe, "worker", "0x5107", "2", n, &index])
        })
        .collect();
    for (w, child) in workers.into_iter().enumerate() {
        let out = output(child, "a worker");
        assert!(out.contains(&format!("worker {w} done")), "{out}");
    }
    let out = output(coordinator, "the coordinator");
    assert!(out.starts_with("ok "), "{out}");
    // Its segments were removed (IPC_RMID): the key is free again.
    refused(
        shm(&control(3), &["cat", "sysv:00005107"], None),
        "no segment",
    );
}

/// `SHM_RDONLY`, as Linux has it: a segment written on one machine, attached read-only on
/// another by a C program that knows nothing of netram; the contents are there, a store
/// through the read-only attachment is a SIGSEGV, and one through a read-write attachment of
/// the same segment is seen through it.
#[test]
fn a_read_only_attachment_reads_and_refuses_stores() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = common::compile_c(dir.path(), "sysv_rdonly", &[]) else {
        return;
    };
    let exe = exe.to_str().unwrap().to_string();
    let (_daemons, control) = three(dir.path(), 600);
    let out = output(sysv(&control(1), &[&exe, "write", "0x5201"]), "the writer");
    assert_eq!(out.trim(), "written");
    let out = output(sysv(&control(2), &[&exe, "read", "0x5201"]), "the reader");
    assert_eq!(out.trim(), "ok");
    refused(
        shm(&control(3), &["cat", "sysv:00005201"], None),
        "no segment",
    );
}

/// Python's sysv_ipc (Debian's python3-sysv-ipc, not ours): a segment and a semaphore made
/// on one machine; another machine writes into it; back on the first, a forked child reads
/// that write (a page the other machine holds: the child's inherited attachment must fault for
/// it, not read its machine's hole as zeros) and writes; a third machine reads both and
/// removes them.
#[test]
fn python_sysv_ipc_shares_memory_between_machines_and_with_a_child() {
    let python = "/usr/bin/python3";
    let has_module = std::process::Command::new(python)
        .args(["-c", "import sysv_ipc"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_module {
        netram_testkit::skip(
            "Python's sysv_ipc module is missing",
            Some("python3-sysv-ipc"),
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("ipc.py");
    std::fs::write(
        &script,
        r#"
import os, sys, sysv_ipc
key = 0x7171
if sys.argv[1] == "make":
    m = sysv_ipc.SharedMemory(key, sysv_ipc.IPC_CREX, mode=0o600, size=3 * 4096)
    sysv_ipc.Semaphore(key, sysv_ipc.IPC_CREX, initial_value=0)
    m.write(b"from the parent", 5000)
elif sys.argv[1] == "fork":
    m = sysv_ipc.SharedMemory(key)
    s = sysv_ipc.Semaphore(key)
    pid = os.fork()
    if pid == 0:
        seen = m.read(16, 7000)
        m.write(b"child read: " + seen, 9000)
        s.release()
        os._exit(0)
    s.acquire(timeout=20)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    print(m.read(28, 9000).decode())
else:
    m = sysv_ipc.SharedMemory(key)
    print(m.read(15, 5000).decode(), "|", m.read(28, 9000).decode())
    m.detach()
    m.remove()
    sysv_ipc.Semaphore(key).remove()
"#,
    )
    .unwrap();
    let script = script.to_str().unwrap();
    let (_daemons, control) = three(dir.path(), 550);
    output(sysv(&control(1), &[python, script, "make"]), "the maker");
    ok(shm(
        &control(2),
        &["write", "sysv:00007171", "--offset", "7000"],
        Some(b"machine 2 wrote!"),
    ));
    let out = output(sysv(&control(1), &[python, script, "fork"]), "the forker");
    assert_eq!(out.trim(), "child read: machine 2 wrote!");
    let out = output(sysv(&control(3), &[python, script, "read"]), "the reader");
    assert_eq!(out.trim(), "from the parent | child read: machine 2 wrote!");
    refused(
        shm(&control(2), &["cat", "sysv:00007171"], None),
        "no segment",
    );
}

/// stress-ng's System V shared-memory stressor (Debian's): segments made, attached (also at
/// addresses it picks, where something is mapped), touched, checked and removed by several
/// processes; it checks its own data.
#[test]
fn stress_ng_shm_sysv_passes() {
    if !netram_testkit::have_tools(&[("stress-ng", "stress-ng")]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (daemons, control) = common::daemons(dir.path(), 560, ["8M"]);
    let child = sysv(
        &control(1),
        &[
            "stress-ng",
            "--shm-sysv",
            "2",
            "--shm-sysv-bytes",
            "1M",
            "-t",
            "4",
            "--metrics-brief",
        ],
    );
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.contains("successful run completed"),
        "stress-ng: {err}"
    );
    drop(daemons);
}

/// A machine that held a page's only copy crashes (SIGKILL): a process on another machine that
/// then reads the page is told — killed by SIGBUS, the daemon's log naming the segment and
/// page — never given zeros; a page that still has a live copy is read as it was.
#[test]
fn a_page_lost_with_a_crashed_writer_is_reported_not_zeroed() {
    let dir = tempfile::tempdir().unwrap();
    let (mut daemons, control) = three(dir.path(), 570);
    ok(shm(&control(1), &["create", "fragile", "8KiB"], None));
    // Page 0 written on machine 2 (its only copy), page 1 on machine 1.
    ok(shm(
        &control(2),
        &["write", "fragile"],
        Some(b"only on machine 2"),
    ));
    ok(shm(
        &control(1),
        &["write", "fragile", "--offset", "4096"],
        Some(b"kept by the library"),
    ));
    daemons[1].signal(libc::SIGKILL);
    daemons[1].child.wait().unwrap();
    let out = shm(&control(3), &["cat", "fragile", "--len", "17"], None);
    use std::os::unix::process::ExitStatusExt;
    let by_sigbus =
        out.status.signal() == Some(libc::SIGBUS) || out.status.code() == Some(128 + libc::SIGBUS);
    assert!(
        by_sigbus,
        "reading a lost page: {:?}, {:?}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    let kept = ok(shm(
        &control(3),
        &["cat", "fragile", "--offset", "4096", "--len", "19"],
        None,
    ));
    assert_eq!(kept, b"kept by the library");
}

/// The library's machine crashes: the two others report what they hold, the lower of them
/// rebuilds the segment's library, and the segment goes on — pages they hold read back as
/// they were, a page only the library's machine held is reported lost (SIGBUS, never
/// zeros), and writes and reads work again through the new library.
#[test]
fn a_segment_outlives_its_library_s_machine() {
    let dir = tempfile::tempdir().unwrap();
    let (mut daemons, control) = three(dir.path(), 580);
    ok(shm(&control(1), &["create", "sturdy", "16KiB"], None));
    ok(shm(
        &control(2),
        &["write", "sturdy"],
        Some(b"written on machine 2"),
    ));
    ok(shm(
        &control(2),
        &["write", "sturdy", "--offset", "4096"],
        Some(b"read on two machines"),
    ));
    let read = ok(shm(
        &control(3),
        &["cat", "sturdy", "--offset", "4096", "--len", "20"],
        None,
    ));
    assert_eq!(read, b"read on two machines");
    ok(shm(
        &control(1),
        &["write", "sturdy", "--offset", "8192"],
        Some(b"only on the library"),
    ));
    daemons[0].signal(libc::SIGKILL);
    daemons[0].child.wait().unwrap();

    // Machine 2's write copy, read on machine 3 (the fault waits for the takeover).
    let kept = ok(shm(&control(3), &["cat", "sturdy", "--len", "20"], None));
    assert_eq!(kept, b"written on machine 2");
    let out = shm(
        &control(3),
        &["cat", "sturdy", "--offset", "8192", "--len", "19"],
        None,
    );
    use std::os::unix::process::ExitStatusExt;
    let by_sigbus =
        out.status.signal() == Some(libc::SIGBUS) || out.status.code() == Some(128 + libc::SIGBUS);
    assert!(
        by_sigbus,
        "reading a page lost with the library: {:?}, {:?}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    // The read copies: written again on machine 2 (machine 3's copy invalidated), read on 3.
    ok(shm(
        &control(2),
        &["write", "sturdy", "--offset", "4096"],
        Some(b"written after a crash"),
    ));
    let again = ok(shm(
        &control(3),
        &["cat", "sturdy", "--offset", "4096", "--len", "21"],
        None,
    ));
    assert_eq!(again, b"written after a crash");
    for d in &daemons[1..] {
        assert_eq!(d.stat("dsm_agent_takeovers"), 1);
    }
    // Machine 3 was told the page is lost, by the new library (machine 2's).
    assert_eq!(daemons[2].stat("dsm_agent_pages_lost"), 1);
}

/// `/dev/userfaultfd` opened to one group for a test, its owner and mode put back however
/// the test ends.
struct DeviceGrant {
    path: &'static str,
    uid: u32,
    gid: u32,
    mode: u32,
}

impl DeviceGrant {
    fn to_group(path: &'static str, gid: u32) -> DeviceGrant {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let m = std::fs::metadata(path).unwrap();
        let g = DeviceGrant {
            path,
            uid: m.uid(),
            gid: m.gid(),
            mode: m.mode() & 0o7777,
        };
        std::os::unix::fs::chown(path, None, Some(gid)).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(g.mode | 0o060)).unwrap();
        g
    }
}

impl Drop for DeviceGrant {
    fn drop(&mut self) {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::os::unix::fs::chown(self.path, Some(self.uid), Some(self.gid));
        let _ = std::fs::set_permissions(self.path, std::fs::Permissions::from_mode(self.mode));
    }
}

/// PostgreSQL (Debian's) with its shared buffers in System V shared memory, run unmodified on
/// netram's (`netram shm run`, its postmaster and every backend it forks attaching the
/// segment), as its own user: pgbench's TPC-B-like transactions from 4 clients, then the
/// ledger checked — every account's, teller's and branch's balances add up to the history's
/// deltas — and checked again after a restart (what the checkpoint wrote from netram's
/// memory). PostgreSQL reads files into its buffers with read(2): the kernel's own accesses
/// must be served, which an ordinary user's userfaultfd does only through /dev/userfaultfd
/// (granted to the postgres group for the test, as an administrator would).
#[test]
fn postgresql_runs_on_netram_shared_memory() {
    use std::os::unix::process::CommandExt;
    if !netram_testkit::have_root("running PostgreSQL as its own user") {
        return;
    }
    let Some(bin) = std::fs::read_dir("/usr/lib/postgresql")
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .find(|b| b.join("postgres").exists() && b.join("pgbench").exists())
    else {
        netram_testkit::skip("not installed: PostgreSQL", Some("postgresql"));
        return;
    };
    if !std::path::Path::new("/dev/userfaultfd").exists() {
        netram_testkit::skip("no /dev/userfaultfd (Linux 6.1)", None);
        return;
    }
    let id = |flag: &str| -> Option<u32> {
        let out = std::process::Command::new("id")
            .args([flag, "postgres"])
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    };
    let (Some(uid), Some(gid)) = (id("-u"), id("-g")) else {
        netram_testkit::skip("no postgres user", Some("postgresql"));
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        // The postgres user reaches the daemon's socket and its own directories in here.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let (daemons, control) = common::daemons(dir.path(), 590, ["8M"]);
    let data = dir.path().join("pgdata");
    let sockets = dir.path().join("pgsock");
    for d in [&data, &sockets] {
        std::fs::create_dir(d).unwrap();
        std::os::unix::fs::chown(d, Some(uid), Some(gid)).unwrap();
    }
    let _grant = DeviceGrant::to_group("/dev/userfaultfd", gid);
    let as_postgres = |program: &str| {
        let mut c = std::process::Command::new("timeout");
        c.args(["-k", "10", "120"])
            .arg(bin.join(program))
            .uid(uid)
            .gid(gid)
            .current_dir(dir.path())
            .env("PGHOST", &sockets)
            .env("PGPORT", "5491");
        c
    };
    let run = |c: &mut std::process::Command| {
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "{c:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    run(as_postgres("initdb").args(["-A", "trust", "-D"]).arg(&data));
    let start = || {
        let mut c = std::process::Command::new("timeout");
        c.args(["-k", "10", "120", common::NETRAM, "shm", "--daemon"])
            .arg(control(1))
            .args(["run", "--"])
            .arg(bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .args(["-c", "shared_memory_type=sysv", "-c", "shared_buffers=16MB"])
            .args(["-c", "listen_addresses=", "-p", "5491", "-k"])
            .arg(&sockets)
            .uid(uid)
            .gid(gid)
            .current_dir(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        let child = c.spawn().unwrap();
        common::eventually("PostgreSQL accepts connections", 60, || {
            as_postgres("pg_isready")
                .output()
                .is_ok_and(|o| o.status.success())
        });
        child
    };
    // A fast shutdown (timeout passes SIGINT on to the postmaster), waited for.
    // Its log's errors, but for the refusals pg_isready gets while it starts.
    let stop = |child: std::process::Child| {
        // SAFETY: kill(2) on the PID of a child this test spawned and has not reaped.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let out = child.wait_with_output().unwrap();
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter(|l| {
                (l.contains("PANIC") || l.contains("FATAL") || l.contains("ERROR"))
                    && !l.contains("the database system is starting up")
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let ledger = "select (select sum(abalance) from pgbench_accounts), \
                  (select sum(delta) from pgbench_history), \
                  (select sum(tbalance) from pgbench_tellers), \
                  (select sum(bbalance) from pgbench_branches), \
                  (select count(*) from pgbench_history)";
    let check = |when: &str| {
        let row = run(as_postgres("psql").args(["-tA", "-c", ledger, "postgres"]));
        let f: Vec<&str> = row.trim().split('|').collect();
        assert_eq!(f.len(), 5, "{when}: {row}");
        assert!(
            f[0] == f[1] && f[1] == f[2] && f[2] == f[3],
            "{when}: the balances do not add up to the history: {row}"
        );
        let n: u64 = f[4].parse().unwrap();
        assert!(n >= 500, "{when}: {n} transactions");
        row
    };
    let pg = start();
    run(as_postgres("pgbench").args(["-i", "-s", "2", "postgres"]));
    let report = run(as_postgres("pgbench").args(["-c", "4", "-j", "2", "-t", "150", "postgres"]));
    assert!(
        report.contains("number of failed transactions: 0"),
        "{report}"
    );
    let before = check("after pgbench");
    // Its memory was netram's: the agent served the first touch of its pages and more.
    let faults = daemons[0].stat("dsm_agent_faults");
    assert!(faults > 1_000, "{faults} faults served");
    let errors = stop(pg);
    assert!(errors.is_empty(), "{errors}");
    let pg = start();
    assert_eq!(check("after a restart"), before);
    let errors = stop(pg);
    assert!(errors.is_empty(), "{errors}");
    drop(daemons);
}
