//! `netram demo`: a local cluster on loopback, and unmodified programs run side by side
//! (Anemone §4 and Nswap §V measure the same way: real applications against the local disk).
//!
//! First real programs nobody wrote for netram (`netram bench programs`' quick sizes: sqlite3
//! where it is installed, Python, GNU sort with two threads), each all in local memory, under
//! `netram run` with a quarter of its peak local, and (as root) under the kernel's swap to a
//! local disk file in a memory cgroup as large as netram's run peaked at; every output checked
//! against the all-local one, and the best and the worst of them said plainly. Then the bundled
//! workloads (a random read-modify-write and Anemone's quicksort) the same ways and under
//! `netram run` with the local disk behind it. A table, a plot of everything and a JSON file at
//! the end; the servers' log in a file beside them.
//!
//! Honest by construction: a run that fails or whose output differs makes the demo exit
//! non-zero naming it, and no figure is printed or drawn for it. The kernel's run ended by its
//! OOM killer is the kernel's result at that size (tried again with more memory, each size
//! reported); any other failure of it is a failure of the demo.

use indicatif::{ProgressBar, ProgressStyle};
use netram_bench::uffd::{
    plot_panels, run_way, workload_args, workloads_table, Ctx, OomKilled, Panel, Way,
};
use netram_client::latency::PmQos;
use netram_cluster::LocalCluster;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// The workload's working set; a quarter of it is local under netram.
    #[arg(long, default_value = "32M")]
    size: String,
    /// Page servers to start on loopback.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=64))]
    servers: u16,
    /// Where to write demo.json, demo.svg and demo.log (the servers' log).
    #[arg(long, default_value = "demo-results")]
    out: PathBuf,
}

/// The demo's log file (`OUT/demo.log`, started afresh), made before anything logs.
pub fn open_log(args: &DemoArgs) -> anyhow::Result<std::fs::File> {
    std::fs::create_dir_all(&args.out)?;
    let path = args.out.join("demo.log");
    std::fs::File::create(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// The real programs the demo runs, in order (`netram bench programs`' names).
const PROGRAMS: [&str; 3] = ["sqlite3", "python", "sort"];

/// The ways the demo compares the workloads, in order.
const WAYS: [Way; 4] = [Way::Local, Way::Netram, Way::NetramDisk, Way::SwapDisk];

fn label(way: Way, local: u64) -> String {
    let mib = local >> 20;
    match way {
        Way::Local => "all in local memory".into(),
        Way::Netram => format!("netram run, {mib} MiB local"),
        Way::NetramDisk => format!("netram run --backing disk, {mib} MiB"),
        Way::SwapDisk => format!("kernel swap to disk, {mib} MiB for data"),
        other => other.key().into(),
    }
}

fn spinner(msg: String) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("  {spinner} {msg} {elapsed}").expect("valid template"),
    );
    pb.set_message(msg);
    pb.enable_steady_tick(Duration::from_millis(100));
    pb
}

/// The sizes the kernel's run was OOM-killed at, as "12, 18 MiB" (empty if none).
fn killed_at(v: &Value) -> String {
    let sizes: Vec<String> = v["oom_killed_at_bytes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|b| Some((b.as_u64()? >> 20).to_string()))
        .collect();
    if sizes.is_empty() {
        String::new()
    } else {
        format!("{} MiB", sizes.join(", "))
    }
}

/// One real program three ways, printed as it goes: its figures (null if it could not run:
/// not installed goes into `skipped`, anything else into `failed`).
fn program(name: &str, ctx: &Ctx, skipped: &mut Vec<String>, failed: &mut Vec<String>) -> Value {
    let (what, missing) = netram_bench::programs::describe(name).expect("a known program");
    if !missing.is_empty() {
        println!("  {what}: not installed here ({})", missing.join(", "));
        skipped.push(format!("{name}: not installed: {}", missing.join(", ")));
        return Value::Null;
    }
    let pb = spinner(format!("{what}: all local, netram run, kernel swap"));
    let result = netram_bench::programs::run_one(name, true, &ctx.exe, &ctx.servers);
    pb.finish_and_clear();
    let v = match result {
        Ok(v) => v,
        Err(e) => {
            println!("  {what}: FAILED: {e:#}");
            failed.push(format!("{name}: {e:#}"));
            return Value::Null;
        }
    };
    for why in v["failed"].as_array().into_iter().flatten() {
        failed.push(format!("{name}: {}", why.as_str().unwrap_or_default()));
    }
    let local_mib = v["local_mem_bytes"].as_u64().unwrap_or(0) >> 20;
    let peak_mib = v["local"]["peak_rss_kib"].as_u64().unwrap_or(0) >> 10;
    println!("  {what} (peak {peak_mib} MiB):");
    if let Some(s) = v["local"]["seconds"].as_f64() {
        println!("    all in local memory                   {s:>7.2} s");
    }
    let way = |w: &str, title: &str| {
        let r = &v[w];
        let head = format!("    {title:<37}");
        if let Some(e) = r["error"].as_str() {
            println!("{head} FAILED: {}", e.lines().next().unwrap_or(""));
        } else if r["output_ok"].as_bool() == Some(true) {
            let s = r["seconds"].as_f64().unwrap_or(f64::NAN);
            let more = match killed_at(r) {
                k if k.is_empty() => String::new(),
                k => format!(" (OOM-killed with less: at {k})"),
            };
            println!("{head} {s:>7.2} s, same output{more}");
        } else if r["seconds"].is_number() {
            println!("{head} WRONG OUTPUT (no figure)");
        } else if !killed_at(r).is_empty() {
            println!(
                "{head} OOM-killed at {} (the kernel's own swap could not run it)",
                killed_at(r)
            );
        }
    };
    way("netram", &format!("netram run, {local_mib} MiB local"));
    if v.get("swap_disk").is_some() {
        let mib = v["swap_disk"]["cgroup_limit_bytes"].as_u64().unwrap_or(0) >> 20;
        let title = if mib > 0 {
            format!("kernel swap to disk, {mib} MiB")
        } else {
            "kernel swap to disk".to_string()
        };
        way("swap_disk", &title);
    } else {
        println!("    kernel swap to disk: not run (needs root and a memory cgroup)");
        skipped.push(format!("{name}.swap_disk: needs root and a memory cgroup"));
    }
    let ratio = |k: &str| v[k].as_f64();
    match (ratio("netram_over_local"), ratio("netram_over_swap_disk")) {
        (Some(l), Some(k)) => println!(
            "    netram: {l:.1}× its all-local time, {k:.2}× the kernel's swap{}",
            if killed_at(&v["swap_disk"]).is_empty() {
                ""
            } else {
                " (which had more memory)"
            }
        ),
        (Some(l), None) => println!("    netram: {l:.1}× its all-local time"),
        _ => {}
    }
    v
}

/// The best and the worst of the programs for netram (by its time over the all-local time),
/// said plainly.
fn verdict(programs: &serde_json::Map<String, Value>) -> Option<String> {
    let mut ranked: Vec<(&String, f64)> = programs
        .iter()
        .filter_map(|(n, v)| Some((n, v["netram_over_local"].as_f64()?)))
        .collect();
    ranked.sort_by(|a, b| a.1.total_cmp(&b.1));
    let (best, worst) = (ranked.first()?, ranked.last()?);
    let vs_kernel = |n: &str| match programs[n]["netram_over_swap_disk"].as_f64() {
        Some(k) if k <= 1.0 => format!(", {:.1}× faster than the kernel's swap", 1.0 / k),
        Some(k) => format!(", {k:.1}× slower than the kernel's swap"),
        None => String::new(),
    };
    let mut s = format!(
        "netram serves {} best here: {:.1}× its all-local time{}",
        best.0,
        best.1,
        vs_kernel(best.0)
    );
    if worst.0 != best.0 {
        s += &format!(
            "; {} worst: {:.1}× its all-local time{} (each page it faults on is a round trip; \
             a program that touches all its memory in a quarter of the room pays that on \
             nearly every access)",
            worst.0,
            worst.1,
            vs_kernel(worst.0)
        );
    }
    Some(s + ".")
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    // SIGINT and SIGTERM stop the demo through its guards (swap files, cgroups, the programs'
    // process groups), not in the middle of them.
    netram_bench::process::catch_interrupts()?;
    let stop_if_asked = || {
        anyhow::ensure!(
            !netram_bench::process::interrupted(),
            "interrupted: stopped, everything it set up taken down"
        );
        Ok(())
    };
    let w = crate::size("--size", &args.size)?;
    anyhow::ensure!(w >= 1 << 20, "--size must be at least 1M");
    let n = usize::from(args.servers);
    // Faults are served several times faster when idle CPUs do not sleep deeply (PM QoS,
    // root only); everything below runs in the same mode.
    let qos = PmQos::hold();
    let exe = std::env::current_exe()?;
    crate::run::preload_library()?;
    // Authenticated like a real cluster: the run's cluster directory (`main`'s
    // `install_credentials`, `NETRAM_TLS`) issues the servers' certificates, and the programs
    // `netram run` starts reach them with its node credentials.
    let capacity = w / n.min(2) as u64 + (16 << 20);
    // The servers do not poll (as `bench programs`' do not): on a small machine their polling
    // takes the CPUs the programs run on. Measured on the 2-vCPU VM, one run each way: sqlite3
    // 1.46 -> 1.13 s, Python 16.3 -> 14.6 s, GNU sort 27.2 -> 18.7 s, the random workload
    // 1.4 -> 1.0 s, the quicksort 1.2 -> 0.98 s.
    let servers_poll = false;
    let cluster = match std::env::var_os("NETRAM_TLS") {
        Some(dir) if std::path::Path::new(&dir).join("ca.key").exists() => {
            LocalCluster::start_in(std::path::Path::new(&dir), n, capacity, servers_poll)?
        }
        _ if std::env::var_os("NETRAM_INSECURE").is_some() => {
            LocalCluster::start_insecure(n, capacity, servers_poll)?
        }
        _ => anyhow::bail!(
            "the demo makes its own cluster CA unless NETRAM_TLS names a cluster directory \
             (with ca.key) or NETRAM_INSECURE is set"
        ),
    };
    // Removed when dropped, also when the demo is stopped on the way.
    let scratch = tempfile::Builder::new().prefix("netram-demo-").tempdir()?;
    let dir = scratch.path().to_path_buf();
    let ctx = Ctx {
        exe,
        working_set: w,
        servers: cluster.addrs().join(","),
        low_latency: qos.is_some(),
        dir: dir.clone(),
    };
    println!(
        "netram demo: {n} page servers on loopback, mutual TLS{}; their log is in {}",
        if qos.is_some() {
            ", low-latency mode"
        } else {
            " (not root: no PM QoS, faults are slower)"
        },
        args.out.join("demo.log").display()
    );
    println!(
        "\nReal programs, each all in local memory, under `netram run` with a quarter of its \
         peak memory local,\nand under the kernel's swap to disk in a memory cgroup as large \
         as netram's run peaked at;\nevery output checked against the all-local run's:\n"
    );
    let (mut skipped, mut failed) = (Vec::new(), Vec::new());
    let started = Instant::now();
    let mut programs = serde_json::Map::new();
    for name in PROGRAMS {
        stop_if_asked()?;
        let v = program(name, &ctx, &mut skipped, &mut failed);
        if !v.is_null() {
            programs.insert(name.into(), v);
        }
    }
    if let Some(v) = verdict(&programs) {
        println!("\n  {v}");
    }
    println!(
        "\nThe bundled workloads over a {} MiB working set, {} MiB of it local:\n",
        w >> 20,
        (w / 4) >> 20
    );
    let mut results: serde_json::Map<String, Value> = serde_json::Map::new();
    for workload in ["random", "qsort"] {
        let wl_args = workload_args(workload, w, 7);
        let mut row = serde_json::Map::new();
        for way in WAYS {
            let what = format!("{workload:<6} {}", label(way, w / 4));
            if let Some(why) = way.unavailable() {
                println!("  {what}: not run ({why})");
                skipped.push(format!("{workload}.{}: {why}", way.key()));
                continue;
            }
            stop_if_asked()?;
            let pb = spinner(what.clone());
            let result = run_way(&ctx, way, &wl_args);
            pb.finish_and_clear();
            match result {
                Ok(v) => {
                    let more = match killed_at(&v) {
                        k if k.is_empty() => String::new(),
                        k => format!(
                            " (in {} MiB: OOM-killed at {k})",
                            v["cgroup_limit_bytes"].as_u64().unwrap_or(0) >> 20
                        ),
                    };
                    println!(
                        "  {what}: {:.2} s, verified{more}",
                        v["seconds"].as_f64().unwrap_or(f64::NAN)
                    );
                    row.insert(way.key().into(), v);
                }
                // The baseline, not netram: OOM-killed at every size `run_way` tried. That is
                // the kernel's result in this much memory, said as such.
                Err(e) if e.downcast_ref::<OomKilled>().is_some() => {
                    println!(
                        "  {what}: OOM-killed by the memory cgroup at every size tried (the \
                         kernel's own swap could not run it)"
                    );
                    row.insert(way.key().into(), json!({ "oom_killed": format!("{e:#}") }));
                }
                Err(e) => {
                    println!("  {what}: FAILED: {e:#}");
                    failed.push(format!("{workload}.{}: {e:#}", way.key()));
                }
            }
        }
        results.insert(workload.into(), Value::Object(row));
    }
    cluster.stop();
    drop(qos);
    drop(scratch);

    let workloads = Value::Object(results);
    println!("\n{}", workloads_table(&workloads));
    for wl in ["random", "qsort"] {
        let s = |way: &str| workloads[wl][way]["seconds"].as_f64();
        if let (Some(n), Some(d)) = (s("netram"), s("netram_disk")) {
            print!("{wl}: netram is {:.1}× faster than its disk backing", d / n);
            match s("swap_disk") {
                Some(k) => println!(", {:.1}× the kernel's swap to disk", k / n),
                None => println!(),
            }
        }
    }
    std::fs::create_dir_all(&args.out)?;
    let doc = json!({
        "machine": netram_bench::machine::Machine::describe(),
        "working_set_bytes": w,
        "local_memory_bytes": w / 4,
        "servers": n,
        "low_latency": ctx.low_latency,
        "programs": programs,
        "workloads": workloads,
        "skipped": skipped,
        "failed": failed,
        "seconds": started.elapsed().as_secs_f64(),
    });
    let json_path = args.out.join("demo.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&doc)? + "\n")?;
    let svg = args.out.join("demo.svg");
    let title = "netram demo: seconds per run, outputs checked (lower is better; netram in blue)";
    match plot_panels(title, &panels(&doc), &svg) {
        Ok(()) => println!("\nwrote {} and {}", json_path.display(), svg.display()),
        Err(e) => println!("\nwrote {} (no plot: {e})", json_path.display()),
    }
    crate::bench_verdict(&failed)
}

/// One panel per program and per workload: seconds of every run that verified.
fn panels(doc: &Value) -> Vec<Panel> {
    let mut panels = Vec::new();
    let empty = serde_json::Map::new();
    for (name, v) in doc["programs"].as_object().unwrap_or(&empty) {
        panels.push(netram_bench::programs::panel(name, v));
    }
    for wl in ["random", "qsort"] {
        let bars = WAYS
            .iter()
            .filter_map(|w| {
                let v = doc["workloads"][wl][w.key()]["seconds"].as_f64()?;
                let label = match w {
                    Way::Local => "all local",
                    Way::Netram => "netram run",
                    Way::NetramDisk => "netram, disk",
                    Way::SwapDisk => "kernel swap",
                    other => other.key(),
                };
                Some((label.to_string(), v))
            })
            .collect();
        panels.push((
            format!("workload {wl}"),
            "seconds (log scale)".to_string(),
            bars,
        ));
    }
    panels
}
