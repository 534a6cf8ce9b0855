//! The C ABI from C: `tests/region.c` is compiled against `include/netram.h`, linked with
//! `-lnetram` against the built library under its installed name (`libnetram.so`, as
//! `cargo xtask deb` installs `libnetram_capi.so`) and run against a local cluster.

use netram_cluster::LocalCluster;
use std::path::PathBuf;
use std::process::Command;

/// The built library, `libnetram_capi.so` (cargo builds it next to the test's `deps/`).
fn built_lib() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    // The newest of the two: `cargo build` copies the library up a directory, `cargo test`
    // only builds it in deps, so the copy there may be an old build's.
    let dir = [deps.parent().unwrap().to_path_buf(), deps]
        .into_iter()
        .map(|d| d.join("libnetram_capi.so"))
        .filter(|f| f.exists())
        .max_by_key(|f| f.metadata().unwrap().modified().unwrap());
    dir.expect("libnetram_capi.so is built with the tests")
}

/// `tests/NAME.c` compiled against netram.h and linked with `-lnetram` in `dir` (where the
/// library is copied under its installed name); the program and the library's directory.
/// `None` (the test skipped, said so) without a C compiler.
fn compile(dir: &std::path::Path, name: &str) -> Option<(PathBuf, PathBuf)> {
    if !netram_testkit::have_tools(&[("cc", "gcc")]) {
        return None;
    }
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = dir.join(name);
    // Under the name a C program links with once installed.
    let lib = dir.to_path_buf();
    std::fs::copy(built_lib(), lib.join("libnetram.so")).unwrap();
    let built = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg("-I")
        .arg(here.join("include"))
        .arg(here.join(format!("tests/{name}.c")))
        .arg("-o")
        .arg(&out)
        .arg("-L")
        .arg(&lib)
        .arg("-lnetram")
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "cc: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    Some((out, lib))
}

#[test]
fn a_c_program_uses_netram_h() {
    let scratch = tempfile::tempdir().unwrap();
    let Some((out, lib)) = compile(scratch.path(), "region") else {
        return;
    };
    let cluster = LocalCluster::start(2, 64 << 20, false).unwrap();
    let run = Command::new("timeout")
        .arg("120")
        .arg(&out)
        .arg(cluster.addrs().join(","))
        .env("LD_LIBRARY_PATH", &lib)
        .env("NETRAM_TLS", cluster.tls_dir().expect("a TLS cluster"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.contains("all checks passed"),
        "{}\n{stdout}{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    // The destroyed region's pages left the servers.
    let stored: u64 = (0..2).map(|s| cluster.stat(s, "stored_pages")).sum();
    assert_eq!(stored, 0);
}

/// netram.h's shared segments: a C program (and a child it forks) through a daemon's
/// shared-memory socket.
#[test]
fn a_c_program_shares_a_segment_through_netram_h() {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    let scratch = tempfile::tempdir().unwrap();
    let Some((out, lib)) = compile(scratch.path(), "shm") else {
        return;
    };
    let control = scratch.path().join("daemon.sock");
    let cfg = netram_server::ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        capacity_bytes: 16 << 20,
        control: Some(control.clone()),
        shm_socket: Some(netram_shm::local::socket_of(&control)),
        ..Default::default()
    };
    let server = netram_server::Server::start(cfg, Arc::new(AtomicBool::new(false))).unwrap();
    let run = Command::new("timeout")
        .arg("120")
        .arg(&out)
        .env("LD_LIBRARY_PATH", &lib)
        .env("NETRAM_DAEMON", &control)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.trim() == "ok",
        "{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    server.stop();
}
