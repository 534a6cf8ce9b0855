//! The C ABI from C: `tests/region.c` is compiled against `include/netram.h`, linked with
//! `libnetram.so` and run against a local cluster.

use netram_cluster::LocalCluster;
use std::path::PathBuf;
use std::process::Command;

/// The directory holding `libnetram.so` (cargo builds it next to the test's `deps/`).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    // The newest of the two: `cargo build` copies the library up a directory, `cargo test`
    // only builds it in deps, so the copy there may be an old build's.
    let dir = [deps.parent().unwrap().to_path_buf(), deps]
        .into_iter()
        .filter(|d| d.join("libnetram.so").exists())
        .max_by_key(|d| {
            d.join("libnetram.so")
                .metadata()
                .unwrap()
                .modified()
                .unwrap()
        });
    dir.expect("libnetram.so is built with the tests")
}

#[test]
fn a_c_program_uses_netram_h() {
    if !netram_testkit::have_tools(&[("cc", "gcc")]) {
        return;
    }
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = std::env::temp_dir().join(format!("netram-capi-test-{}", std::process::id()));
    let lib = lib_dir();
    let built = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg("-I")
        .arg(here.join("include"))
        .arg(here.join("tests/region.c"))
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
    let cluster = LocalCluster::start(2, 64 << 20, false).unwrap();
    let run = Command::new("timeout")
        .arg("120")
        .arg(&out)
        .arg(cluster.addrs().join(","))
        .env("LD_LIBRARY_PATH", &lib)
        .env("NETRAM_TLS", cluster.tls_dir().expect("a TLS cluster"))
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&out);
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
