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

#[test]
fn a_c_program_uses_netram_h() {
    if !netram_testkit::have_tools(&[("cc", "gcc")]) {
        return;
    }
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let scratch = tempfile::tempdir().unwrap();
    let out = scratch.path().join("region");
    // Under the name a C program links with once installed.
    let lib = scratch.path().to_path_buf();
    std::fs::copy(built_lib(), lib.join("libnetram.so")).unwrap();
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
