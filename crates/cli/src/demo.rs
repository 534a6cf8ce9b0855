//! `netram demo`: a local cluster on loopback, and unmodified programs run side by side. First a
//! program nobody wrote for netram — GNU sort, with two threads, of a generated file larger
//! than its local memory — all in local memory, under `netram run` with a quarter of its peak
//! local, and (as root) under the kernel's swap to a local disk file in a memory cgroup as
//! large as netram's run peaked at, each output checked against the all-local one. Then the
//! bundled workloads (a random read-modify-write and Anemone's quicksort) the same ways and
//! under `netram run` with the local disk behind it. A table, a plot and a JSON file at the
//! end.

use indicatif::{ProgressBar, ProgressStyle};
use netram_bench::uffd::{plot_ways, run_way, workload_args, workloads_table, Ctx, Way};
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
    /// Where to write demo.json and demo.svg.
    #[arg(long, default_value = "demo-results")]
    out: PathBuf,
}

/// The ways the demo compares, in order.
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

/// GNU sort three ways (`netram bench programs`' sort, its small size): printed as it goes, its
/// figures returned (null if it could not run, which `skipped` says).
fn gnu_sort(ctx: &Ctx, skipped: &mut Vec<String>) -> Value {
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("  {spinner} {msg} {elapsed}").expect("valid template"),
    );
    pb.set_message(
        "GNU sort --parallel=2 of 1,000,000 lines (33 MB): local, netram run, kernel swap",
    );
    pb.enable_steady_tick(Duration::from_millis(100));
    let result = netram_bench::programs::run_one("sort", true, &ctx.exe, &ctx.servers);
    pb.finish_and_clear();
    let v = match result {
        Ok(v) => v,
        Err(e) => {
            println!("  GNU sort: FAILED: {e:#}");
            skipped.push(format!("gnu_sort.netram: failed: {e:#}"));
            return Value::Null;
        }
    };
    let mib = v["local_mem_bytes"].as_u64().unwrap_or(0) >> 20;
    let secs = |way: &str| v[way]["seconds"].as_f64();
    let output = |way: &str| match v[way]["output_ok"].as_bool() {
        Some(true) => "same output".to_string(),
        Some(false) => "WRONG OUTPUT".to_string(),
        None => format!("failed: {}", v[way]["error"].as_str().unwrap_or("?")),
    };
    println!(
        "  GNU sort --parallel=2, 1,000,000 lines (33 MB), checked against the all-local run:"
    );
    if let Some(s) = secs("local") {
        println!("    all in local memory              {s:>6.2} s");
    }
    match secs("netram") {
        Some(s) => println!(
            "    netram run, {mib:>3} MiB local        {s:>6.2} s, {}",
            output("netram")
        ),
        None => println!(
            "    netram run, {mib:>3} MiB local        {}",
            output("netram")
        ),
    }
    if v["netram"]["output_ok"].as_bool() != Some(true) {
        skipped.push(format!("gnu_sort.netram: failed: {}", output("netram")));
    }
    match (secs("swap_disk"), v.get("swap_disk")) {
        (Some(s), _) => println!(
            "    kernel swap to disk, same peak   {s:>6.2} s, {}",
            output("swap_disk")
        ),
        (None, Some(_)) => println!(
            "    kernel swap to disk, same peak   {}",
            output("swap_disk")
        ),
        (None, None) => {
            println!("    kernel swap to disk: skipped (needs root and a memory cgroup)");
            skipped.push("gnu_sort.swap_disk: needs root".into());
        }
    }
    v
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
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
    let cluster = match std::env::var_os("NETRAM_TLS") {
        Some(dir) if std::path::Path::new(&dir).join("ca.key").exists() => {
            LocalCluster::start_in(std::path::Path::new(&dir), n, capacity, qos.is_some())?
        }
        _ if std::env::var_os("NETRAM_INSECURE").is_some() => {
            LocalCluster::start_insecure(n, capacity, qos.is_some())?
        }
        _ => anyhow::bail!(
            "the demo makes its own cluster CA unless NETRAM_TLS names a cluster directory \
             (with ca.key) or NETRAM_INSECURE is set"
        ),
    };
    let dir = std::env::temp_dir().join(format!("netram-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let ctx = Ctx {
        exe,
        working_set: w,
        servers: cluster.addrs().join(","),
        low_latency: qos.is_some(),
        dir: dir.clone(),
    };
    println!(
        "netram demo: {n} page servers on loopback; a {} MiB working set, {} MiB of it local{}",
        w >> 20,
        (w / 4) >> 20,
        if qos.is_some() {
            " (low-latency mode)"
        } else {
            " (not root: no PM QoS, faults are slower)"
        }
    );
    let mut results: serde_json::Map<String, Value> = serde_json::Map::new();
    let mut skipped = Vec::new();
    let started = Instant::now();
    let sort = gnu_sort(&ctx, &mut skipped);
    for workload in ["random", "qsort"] {
        let wl_args = workload_args(workload, w, 7);
        let mut row = serde_json::Map::new();
        for way in WAYS {
            let what = format!("{workload:<6} {}", label(way, w / 4));
            if let Some(why) = way.unavailable() {
                println!("  {what}: skipped ({why})");
                skipped.push(format!("{workload}.{}: {why}", way.key()));
                continue;
            }
            let pb = ProgressBar::new_spinner();
            pb.set_style(
                ProgressStyle::with_template("  {spinner} {msg} {elapsed}")
                    .expect("valid template"),
            );
            pb.set_message(what.clone());
            pb.enable_steady_tick(Duration::from_millis(100));
            let result = run_way(&ctx, way, &wl_args);
            pb.finish_and_clear();
            match result {
                Ok(v) => {
                    println!(
                        "  {what}: {:.2} s, verified",
                        v["seconds"].as_f64().unwrap_or(f64::NAN)
                    );
                    row.insert(way.key().into(), v);
                }
                // The baseline, not netram: the cgroup-v1 controller OOM-kills a program whose
                // swap-ins it cannot charge while reclaim waits on writeback (three tries, in
                // `run_way`). That is the kernel's result in this much memory, said as such.
                Err(e) if way == Way::SwapDisk && format!("{e:#}").contains("SIGKILL") => {
                    println!(
                        "  {what}: OOM-killed by the memory cgroup in three tries (the kernel's \
                         own swap could not keep it within this memory)"
                    );
                    skipped.push(format!("{workload}.{}: OOM-killed", way.key()));
                }
                Err(e) => {
                    println!("  {what}: FAILED: {e:#}");
                    skipped.push(format!("{workload}.{}: failed: {e:#}", way.key()));
                }
            }
        }
        results.insert(workload.into(), Value::Object(row));
    }
    cluster.stop();
    drop(qos);
    let _ = std::fs::remove_dir_all(&dir);

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
        "gnu_sort": sort,
        "workloads": workloads,
        "skipped": skipped,
        "seconds": started.elapsed().as_secs_f64(),
    });
    let json_path = args.out.join("demo.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&doc)? + "\n")?;
    let svg = args.out.join("demo.svg");
    match plot_ways(&doc["workloads"], &svg) {
        Ok(()) => println!("\nwrote {} and {}", json_path.display(), svg.display()),
        Err(e) => println!("\nwrote {} (no plot: {e})", json_path.display()),
    }
    // netram's own runs must succeed; the kernel's swap in a small memory cgroup is sometimes
    // ended by the cgroup's OOM killer, which is reported above, not an error of the demo.
    let netram_failed: Vec<&String> = skipped
        .iter()
        .filter(|s| s.contains("failed") && s.contains(".netram"))
        .collect();
    anyhow::ensure!(
        netram_failed.is_empty(),
        "netram runs failed: {netram_failed:?}"
    );
    Ok(())
}
