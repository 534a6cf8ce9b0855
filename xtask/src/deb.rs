//! `cargo xtask deb`: a Debian package of netram, laid out as an operator installs it
//! (docs/deployment.md) and built with `dpkg-deb`, the distribution's own tool (cargo-deb would
//! do the same from metadata, at the price of a three-minute build on every CI machine).
//!
//! What it holds: `/usr/bin/netram`; `/usr/lib/netram/libnetram_preload.so`, where `netram run`
//! looks (BIN/../lib/netram); the C ABI (`/usr/lib/libnetram.so`, built as `libnetram_capi.so`:
//! the crate named `netram` is the command; `/usr/include/netram.h`); the
//! systemd unit (installed, not enabled: the daemon needs credentials and an edited
//! configuration first); `/etc/netram/netram.toml` as a configuration file dpkg keeps across
//! upgrades; and a udev rule that lets the group `netram` (made by the package) open
//! `/dev/userfaultfd`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{cargo, run, target_dir};

pub(crate) const USAGE: &str = "\
usage: cargo xtask deb [--no-build] [--out DIR]

  deb           a Debian package of netram (target/deb/netram_VERSION_ARCH.deb)
  --no-build    package what target/release already holds
  --out DIR     where the .deb goes";

/// Builds the package; returns its path.
pub(crate) fn deb(args: &[String]) -> Result<PathBuf, String> {
    let mut build = true;
    let mut out = target_dir().join("deb");
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--no-build" => build = false,
            "--out" => out = PathBuf::from(it.next().ok_or("--out needs a directory")?),
            other => return Err(format!("unknown option {other}\n{USAGE}")),
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf();
    if build {
        run(cargo().current_dir(&root).args([
            "build",
            "--release",
            "-p",
            "netram-cli",
            "-p",
            "netram-preload",
            "-p",
            "netram-capi",
        ]))?;
    }
    let release = target_dir().join("release");
    let version = env!("CARGO_PKG_VERSION");
    let arch = output(Command::new("dpkg").arg("--print-architecture"))
        .map_err(|e| format!("dpkg-deb is needed to build a Debian package: {e}"))?;
    let name = format!("netram_{version}_{arch}");
    let stage = target_dir().join("deb-stage").join(&name);
    let _ = std::fs::remove_dir_all(&stage);
    let dist = root.join("dist");
    let files: [(PathBuf, &str, u32); 9] = [
        (built(&release, "netram")?, "usr/bin/netram", 0o755),
        (
            built(&release, "libnetram_preload.so")?,
            "usr/lib/netram/libnetram_preload.so",
            0o644,
        ),
        (
            built(&release, "libnetram_capi.so")?,
            "usr/lib/libnetram.so",
            0o644,
        ),
        (
            root.join("crates/capi/include/netram.h"),
            "usr/include/netram.h",
            0o644,
        ),
        (
            dist.join("netram.service"),
            "lib/systemd/system/netram.service",
            0o644,
        ),
        (dist.join("netram.toml"), "etc/netram/netram.toml", 0o644),
        (
            dist.join("70-netram-userfaultfd.rules"),
            "lib/udev/rules.d/70-netram-userfaultfd.rules",
            0o644,
        ),
        (
            root.join("README.md"),
            "usr/share/doc/netram/README.md",
            0o644,
        ),
        (
            root.join("docs/deployment.md"),
            "usr/share/doc/netram/deployment.md",
            0o644,
        ),
    ];
    for (from, to, mode) in &files {
        let dest = stage.join(to);
        std::fs::create_dir_all(dest.parent().expect("a file in a directory"))
            .map_err(|e| format!("creating {}: {e}", dest.display()))?;
        std::fs::copy(from, &dest)
            .map_err(|e| format!("copying {} to {}: {e}", from.display(), dest.display()))?;
        set_mode(&dest, *mode)?;
    }
    // The release profile keeps debug information (backtraces name lines); a package need
    // not ship it (a 62 MiB binary, 12 MiB stripped). Without binutils the files stay as built.
    if has("strip") {
        for bin in [
            "usr/bin/netram",
            "usr/lib/netram/libnetram_preload.so",
            "usr/lib/libnetram.so",
        ] {
            run(Command::new("strip")
                .arg("--strip-debug")
                .arg(stage.join(bin)))?;
        }
    }
    let debian = stage.join("DEBIAN");
    std::fs::create_dir_all(&debian).map_err(|e| e.to_string())?;
    let size_kib = du_kib(&stage);
    write(
        &debian.join("control"),
        &format!(
            "Package: netram\n\
             Version: {version}\n\
             Architecture: {arch}\n\
             Maintainer: netram developers <netram@example.invalid>\n\
             Installed-Size: {size_kib}\n\
             Depends: libc6 (>= 2.34)\n\
             Recommends: systemd, udev\n\
             Section: admin\n\
             Priority: optional\n\
             Homepage: https://example.invalid/netram\n\
             Description: network RAM: programs page to other machines' idle memory\n \
             A daemon on every machine offers its idle memory to the cluster and takes it\n \
             back when local programs need it; `netram run` puts an unmodified program's\n \
             heap on the cluster's memory, `netram nbd` serves a block device for swap,\n \
             and libnetram.so gives C programs regions of cluster memory. Pages travel\n \
             over mutual TLS and survive a server's crash.\n"
        ),
        0o644,
    )?;
    write(
        &debian.join("conffiles"),
        "/etc/netram/netram.toml\n",
        0o644,
    )?;
    write(&debian.join("postinst"), POSTINST, 0o755)?;
    write(&debian.join("prerm"), PRERM, 0o755)?;
    write(&debian.join("postrm"), POSTRM, 0o755)?;
    std::fs::create_dir_all(&out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    let deb = out.join(format!("{name}.deb"));
    run(Command::new("dpkg-deb")
        .args(["--root-owner-group", "-Zxz", "--build"])
        .arg(&stage)
        .arg(&deb))?;
    Ok(deb)
}

/// Makes the group whose members may open /dev/userfaultfd, applies the udev rule to the
/// device if it exists, and tells systemd of the unit. The daemon is not started: it needs
/// credentials and an edited configuration first (docs/deployment.md).
const POSTINST: &str = r#"#!/bin/sh
set -e
if [ "$1" = configure ]; then
    if ! getent group netram >/dev/null; then
        groupadd --system netram
    fi
    if [ -d /run/udev ] && command -v udevadm >/dev/null; then
        udevadm control --reload || true
        [ -e /dev/userfaultfd ] && udevadm trigger --name-match=userfaultfd || true
    fi
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload || true
    fi
fi
exit 0
"#;

const PRERM: &str = r#"#!/bin/sh
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
    systemctl stop netram.service 2>/dev/null || true
    systemctl disable netram.service 2>/dev/null || true
fi
exit 0
"#;

/// The group stays after a purge, as Debian's policy has it for system groups (files may
/// still belong to it).
const POSTRM: &str = r#"#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload || true
fi
exit 0
"#;

/// `name` as the release build left it: `target/release/NAME`, or the newer copy under
/// `deps/` (where a workspace `cargo test` leaves libraries).
fn built(release: &Path, name: &str) -> Result<PathBuf, String> {
    [release.join(name), release.join("deps").join(name)]
        .into_iter()
        .filter(|p| p.exists())
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
        .ok_or_else(|| {
            format!(
                "{name} is not in {} (build first: cargo build --release -p netram-cli -p \
                 netram-preload -p netram-capi)",
                release.display()
            )
        })
}

fn set_mode(path: &Path, mode: u32) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("chmod {}: {e}", path.display()))
}

fn write(path: &Path, text: &str, mode: u32) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    set_mode(path, mode)
}

fn output(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?}: {}", out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn has(tool: &str) -> bool {
    crate::has(tool)
}

/// The staged tree's size in KiB, for `Installed-Size`.
fn du_kib(dir: &Path) -> u64 {
    fn walk(p: &Path) -> u64 {
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.is_dir() => std::fs::read_dir(p)
                .map(|d| d.flatten().map(|e| walk(&e.path())).sum())
                .unwrap_or(0),
            Ok(m) => m.len(),
            Err(_) => 0,
        }
    }
    walk(dir).div_ceil(1024)
}
