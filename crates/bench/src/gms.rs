//! `netram bench gms`: global memory management (GMS, paper 000; issue 39). For now its
//! simulated half: GMS §5.5–5.6's experiments (Fig. 9–11: the speed-up of a node that needs
//! more memory than it has, the slowdown of the others, the traffic, as the idle memory is
//! spread more or less evenly) and Table 5 (what epochs cost), then the same algorithms on
//! 100 to 10,000 simulated nodes. Every run is the production state machines of
//! `netram_policy::gms` driven by `netram_sim::gms`, and ends with the simulator's checks
//! (capacity, one global copy per page, the directory agrees with every node's frames); a run
//! that fails them gives no figure and makes the command exit non-zero.
//!
//! The real half (`crate::gms_real`): `netram cache` between network-namespace hosts against
//! the source read directly and against random forwarding (N-chance as a client does it).
//! Where it cannot run (not root, tools missing) `gms.json` says why (`real: null`,
//! `real_status`) rather than give a figure.

use crate::machine::Machine;
use crate::uffd::{plot_panels, Panel};
use netram_sim::gms::experiments::{scale_config, skew_point, SkewPoint, SkewSize};
use netram_sim::gms::{run, Algorithm, Outcome};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct Options {
    pub quick: bool,
    /// Run the simulated half (otherwise keep its figures from the gms.json in `out`).
    pub sim: bool,
    /// Run the real half. Neither half: the report and plot are written again from the
    /// gms.json in `out`.
    pub real: bool,
    /// Node counts of the scale runs [default: 100, 1,000, 10,000; quick: 100, 1,000].
    pub nodes: Vec<usize>,
    pub out: PathBuf,
}

const SEED: u64 = 39;
const SKEWS: [f64; 3] = [25.0, 37.5, 50.0];
/// Fig. 9's bars: GMS with the idle memory 007 needs; N-chance with that and twice that; and
/// the hashed data cache with that.
const CASES: [(Algorithm, usize); 4] = [
    (Algorithm::Gms, 1),
    (Algorithm::NChance, 1),
    (Algorithm::NChance, 2),
    (Algorithm::Hashed, 1),
];

fn case_name(a: Algorithm, idle_factor: usize) -> String {
    let base = match a {
        Algorithm::Gms => "netram gms".to_string(),
        other => other.name().to_string(),
    };
    if idle_factor == 1 {
        base
    } else {
        format!("{base} {idle_factor}x idle")
    }
}

fn skew_json(p: &SkewPoint) -> Value {
    json!({
        "algorithm": p.algorithm.name(),
        "skew_pct": p.skew_pct,
        "idle_factor": p.idle_factor,
        "speedup": p.speedup,
        "slowdown": p.slowdown,
        "traffic_mb": p.traffic_bytes as f64 / 1e6,
        "hit_local": p.hit_local,
        "hit_remote": p.hit_remote,
        "source_reads": p.source_reads,
        "forwards": p.outcome.forwards,
        "refused": p.outcome.refused,
        "epochs": p.outcome.epochs.epochs,
        "drops": p.outcome.drops,
    })
}

/// The scale runs' figures for one algorithm at one size; `none` is the same cluster without
/// global memory, for the speed-up.
fn scale_json(
    n: usize,
    a: Algorithm,
    max_weights: usize,
    o: &Outcome,
    none: Option<&Outcome>,
    wall_s: f64,
) -> Value {
    let active: Vec<_> = o.nodes.iter().filter(|s| s.finished_us.is_some()).collect();
    let accesses: u64 = active.iter().map(|s| s.accesses).sum();
    let time = |o: &Outcome| -> f64 {
        let t: Vec<u64> = o.nodes.iter().filter_map(|s| s.finished_us).collect();
        t.iter().sum::<u64>() as f64 / t.len().max(1) as f64
    };
    let e = &o.epochs;
    let epochs = e.epochs.max(1) as f64;
    let end_s = o.end_us as f64 / 1e6;
    json!({
        "nodes": n,
        "algorithm": a.name(),
        "max_weights": max_weights,
        "active_nodes": active.len(),
        "active_mean_s": time(o) / 1e6,
        "speedup_vs_none": none.map(|x| time(x) / time(o)),
        "source_read_ratio": active.iter().map(|s| s.source_reads).sum::<u64>() as f64 / accesses.max(1) as f64,
        "remote_hit_ratio": active.iter().map(|s| s.remote_hits).sum::<u64>() as f64 / accesses.max(1) as f64,
        "traffic_mb": o.traffic.bytes() as f64 / 1e6,
        "page_mb": o.traffic.page_bytes as f64 / 1e6,
        "directory_mb": o.traffic.directory_bytes as f64 / 1e6,
        "epoch_mb": o.traffic.epoch_bytes as f64 / 1e6,
        "virtual_s": end_s,
        "epochs": e.epochs,
        "epochs_ended_early": e.early,
        "initiator_cpu_us_per_epoch": e.initiator_ns as f64 / 1e3 / epochs,
        "summary_cpu_us": e.summary_ns as f64 / 1e3 / e.summaries.max(1) as f64,
        "summary_ns_per_page": e.summary_ns as f64 / (e.summaries.max(1) as f64 * 256.0),
        "initiator_kb_in_max": e.initiator_bytes_in_max as f64 / 1e3,
        "initiator_kb_out_max": e.initiator_bytes_out_max as f64 / 1e3,
        "epoch_bytes_per_node_per_s": o.traffic.epoch_bytes as f64 / n as f64 / end_s.max(1e-9),
        "wall_s": wall_s,
    })
}

/// The fields of gms.json that the simulated half writes.
const SIM_FIELDS: [&str; 6] = [
    "costs",
    "skew_size",
    "skew",
    "scale_accesses",
    "scale",
    "sim_nodes_max",
];

/// The simulated half: Fig. 9-11 and Table 5, then the scale runs.
fn simulate(opts: &Options, failed: &mut Vec<String>) -> serde_json::Map<String, Value> {
    let size = if opts.quick {
        SkewSize::QUICK
    } else {
        SkewSize::FULL
    };
    let nodes: Vec<usize> = if !opts.nodes.is_empty() {
        opts.nodes.clone()
    } else if opts.quick {
        vec![100, 1_000]
    } else {
        vec![100, 1_000, 10_000]
    };
    let accesses = if opts.quick { 1_000 } else { 3_000 };

    // Fig. 9-11.
    let mut skew = Vec::new();
    for s in SKEWS {
        for (a, f) in CASES {
            let t = Instant::now();
            match skew_point(SEED, a, size, s, f) {
                Ok(p) => {
                    eprintln!(
                        "skew {s} % {}: speed-up {:.2} ({:.1} s)",
                        case_name(a, f),
                        p.speedup,
                        t.elapsed().as_secs_f64()
                    );
                    skew.push(p);
                }
                Err(e) => failed.push(format!("skew {s} % {}: {e}", case_name(a, f))),
            }
        }
    }

    // Scale, and Table 5 from GMS's runs.
    let mut scale = Vec::new();
    let largest = nodes.iter().copied().max().unwrap_or(0);
    for &n in &nodes {
        let mut none = None;
        let mut runs: Vec<(Algorithm, usize)> = Algorithm::ALL.iter().map(|&a| (a, 32)).collect();
        if n == largest {
            // The measured choice of max_weights: 256 beside the default 32.
            runs.push((Algorithm::Gms, 256));
        }
        for (a, k) in runs {
            let mut cfg = scale_config(SEED, a, n, accesses);
            cfg.params.max_weights = k;
            let t = Instant::now();
            match run(&cfg) {
                Ok(o) => {
                    let wall = t.elapsed().as_secs_f64();
                    eprintln!("{n} nodes, {} (max weights {k}): {wall:.1} s", a.name());
                    scale.push(scale_json(n, a, k, &o, none.as_ref(), wall));
                    if a == Algorithm::None {
                        none = Some(o);
                    }
                }
                Err(e) => failed.push(format!("{n} nodes, {}: {e}", a.name())),
            }
        }
    }
    let sim_nodes_max = scale
        .iter()
        .filter_map(|v| v["nodes"].as_u64())
        .max()
        .unwrap_or(0);
    let mut m = serde_json::Map::new();
    m.insert("costs".into(), json!("paper (GMS Tables 1-3): getpage hit 1,440 µs, directory round trip 340 µs, putpage 65 µs, disk read 14,300 µs"));
    m.insert(
        "skew_size".into(),
        json!({ "capacity_pages": size.capacity, "accesses_007": size.accesses }),
    );
    m.insert(
        "skew".into(),
        json!(skew.iter().map(skew_json).collect::<Vec<_>>()),
    );
    m.insert("scale_accesses".into(), json!(accesses));
    m.insert("scale".into(), json!(scale));
    m.insert("sim_nodes_max".into(), json!(sim_nodes_max));
    m
}

pub fn run_bench(opts: &Options) -> anyhow::Result<crate::Outcome> {
    let machine = Machine::describe();
    let mut failed = Vec::new();
    let old: Value = if opts.sim {
        Value::Null
    } else {
        serde_json::from_slice(&std::fs::read(opts.out.join("gms.json"))?)?
    };
    let sim = if opts.sim {
        simulate(opts, &mut failed)
    } else {
        // The simulated figures of the last full run, kept as they are.
        let mut m = serde_json::Map::new();
        for k in SIM_FIELDS {
            m.insert(k.to_string(), old[k].clone());
        }
        m
    };
    let (real, real_status) = if !opts.real && !opts.sim {
        // Neither half: the report and the plot written again from gms.json.
        let status = old["real_status"].as_str().unwrap_or("").to_string();
        for f in old["failed"].as_array().into_iter().flatten() {
            failed.push(f.as_str().unwrap_or("?").to_string());
        }
        (old["real"].clone(), status)
    } else if !opts.real {
        (Value::Null, "not run (--no-real)".to_string())
    } else {
        match crate::gms_real::run_real(opts.quick) {
            Ok(r) => {
                for f in r["failed"].as_array().into_iter().flatten() {
                    failed.push(format!("real: {}", f.as_str().unwrap_or("?")));
                }
                (r, "ran".to_string())
            }
            Err(why) => {
                eprintln!("real run skipped: {why}");
                (Value::Null, format!("skipped: {why}"))
            }
        }
    };
    let mut result = json!({
        "machine_line": machine.one_line(),
        "machine": machine,
        "quick": opts.quick,
        "seed": SEED,
        "real": real,
        "real_status": real_status,
        // The headline: idle memory skewed, the source behind a 1 Gbit/s link (the other
        // conditions are in `real`).
        "speedup_vs_source": real["speedup_vs_source_1gbit_skewed"].clone(),
        "speedup_vs_nchance": real["speedup_vs_nchance_1gbit_skewed"].clone(),
        "speedup_vs_juicefs": real["speedup_vs_juicefs_1gbit_skewed"].clone(),
        "failed": failed,
    });
    for (k, v) in sim {
        result[k] = v;
    }
    crate::write_json(&opts.out, "gms.json", &result)?;
    let mut skipped = Vec::new();
    if let Err(e) = plot(&result, &opts.out.join("gms.svg")) {
        skipped.push(format!("plot: {e}"));
    }
    let md = markdown(&result, &skipped, &failed);
    std::fs::write(opts.out.join("gms.md"), &md)?;
    Ok(crate::Outcome { report: md, failed })
}

fn plot(r: &Value, path: &std::path::Path) -> anyhow::Result<()> {
    let mut panels: Vec<Panel> = Vec::new();
    let figs = [
        (
            "speedup",
            "Fig. 9: 007's speed-up",
            "speed-up over no cluster",
        ),
        ("slowdown", "Fig. 10: the others' slowdown", "slowdown"),
        ("traffic_mb", "Fig. 11: network traffic", "MB"),
    ];
    for (key, caption, unit) in figs {
        for s in SKEWS {
            let bars = r["skew"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["skew_pct"].as_f64() == Some(s))
                .filter_map(|p| {
                    let a: Algorithm = p["algorithm"].as_str()?.parse().ok()?;
                    let f = p["idle_factor"].as_u64()? as usize;
                    Some((case_name(a, f), p[key].as_f64()?))
                })
                .collect();
            panels.push((format!("{caption}, skew {s} %"), unit.to_string(), bars));
        }
    }
    for key in ["speedup_vs_none", "initiator_kb_out_max"] {
        for n in r["scale"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v["nodes"].as_u64())
            .collect::<std::collections::BTreeSet<_>>()
        {
            let bars = r["scale"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|v| v["nodes"].as_u64() == Some(n))
                .filter_map(|v| {
                    let a: Algorithm = v["algorithm"].as_str()?.parse().ok()?;
                    let k = v["max_weights"].as_u64()?;
                    let name = if k == 32 {
                        case_name(a, 1)
                    } else {
                        format!("{} K={k}", case_name(a, 1))
                    };
                    Some((name, v[key].as_f64()?))
                })
                .collect();
            let (caption, unit) = if key == "speedup_vs_none" {
                (
                    format!("{n} nodes: active nodes' speed-up"),
                    "speed-up over no cluster",
                )
            } else {
                (
                    format!("{n} nodes: KB out of the initiator per epoch"),
                    "KB",
                )
            };
            panels.push((caption, unit.to_string(), bars));
        }
    }
    // The real run: mean total time of each reader, per condition.
    let cases = r["real"]["cases"].as_array().cloned().unwrap_or_default();
    for (caption, skewed, shaped) in [
        ("real: idle memory even", false, false),
        ("real: idle memory skewed", true, false),
        ("real: skewed, source at 1 Gbit/s", true, true),
    ] {
        let mut bars = Vec::new();
        for (reader, name) in [
            ("netram cache, gms", "netram GMS"),
            ("netram cache, random", "random forwarding"),
            ("source", "source"),
            ("juicefs", "JuiceFS"),
        ] {
            let t: Vec<f64> = cases
                .iter()
                .filter(|c| {
                    c["reader"] == reader
                        && c["source_1gbit"] == shaped
                        && (!reader.starts_with("netram") || c["skewed"] == skewed)
                })
                .filter_map(|c| c["total_s"].as_f64())
                .collect();
            if !t.is_empty() {
                bars.push((name.to_string(), t.iter().sum::<f64>() / t.len() as f64));
            }
        }
        if !bars.is_empty() {
            panels.push((caption.to_string(), "s (lower is better)".to_string(), bars));
        }
    }
    plot_panels(
        "bench gms: GMS §5.5-5.6 and the same algorithms at scale, simulated; the real run (netram's GMS in blue)",
        &panels,
        path,
    )
}

fn f(v: &Value, digits: usize) -> String {
    v.as_f64()
        .map_or("—".to_string(), |x| format!("{x:.digits$}"))
}

fn markdown(r: &Value, skipped: &[String], failed: &[String]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# netram bench gms\n");
    let _ = writeln!(
        s,
        "{} · simulated (`netram_sim::gms`, the production state machines) · seed {}{}\n",
        r["machine_line"].as_str().unwrap_or(""),
        r["seed"],
        if r["quick"].as_bool() == Some(true) {
            " · quick run"
        } else {
            ""
        }
    );
    let _ = writeln!(
        s,
        "Costs: {}. The real run between namespace hosts: {}.\n",
        r["costs"].as_str().unwrap_or(""),
        r["real_status"].as_str().unwrap_or("")
    );
    let _ = writeln!(
        s,
        "## GMS §5.5–5.6 (Fig. 9–11): one node needs twice its memory ({} pages of {}), eight \
         others hold the idle memory, X % of them (100 − X) % of it, and run Fig. 10's program\n",
        r["skew_size"]["capacity_pages"].as_u64().unwrap_or(0) * 2,
        r["skew_size"]["capacity_pages"]
    );
    let _ = writeln!(
        s,
        "| skew | algorithm | idle memory | 007 speed-up (Fig. 9) | others' slowdown (Fig. 10) | traffic MB (Fig. 11) | 007 from memory / cluster / source | forwards |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for p in r["skew"].as_array().into_iter().flatten() {
        let _ = writeln!(
            s,
            "| {} % | {} | {}× needed | {} | {} | {} | {} / {} / {} | {} |",
            p["skew_pct"],
            p["algorithm"].as_str().unwrap_or(""),
            p["idle_factor"],
            f(&p["speedup"], 2),
            f(&p["slowdown"], 3),
            f(&p["traffic_mb"], 1),
            f(&p["hit_local"], 2),
            f(&p["hit_remote"], 2),
            p["source_reads"],
            p["forwards"]
        );
    }
    let _ = writeln!(
        s,
        "\n## At scale: 1 % of the nodes need twice their 256 pages, 40 % idle, the rest run Fig. 10's program ({} accesses each active node)\n",
        r["scale_accesses"]
    );
    let _ = writeln!(
        s,
        "| nodes | algorithm | max weights | speed-up vs none | from source | from cluster | traffic MB | epochs (early) | initiator CPU µs/epoch | summary µs (ns/page) | KB in / out of the initiator per epoch | epoch bytes per node per s | wall s |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for v in r["scale"].as_array().into_iter().flatten() {
        let gms = v["algorithm"] == "gms";
        let dash = || "—".to_string();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            v["nodes"],
            v["algorithm"].as_str().unwrap_or(""),
            if gms {
                v["max_weights"].to_string()
            } else {
                dash()
            },
            f(&v["speedup_vs_none"], 2),
            f(&v["source_read_ratio"], 3),
            f(&v["remote_hit_ratio"], 3),
            f(&v["traffic_mb"], 1),
            if gms {
                format!("{} ({})", v["epochs"], v["epochs_ended_early"])
            } else {
                dash()
            },
            if gms {
                f(&v["initiator_cpu_us_per_epoch"], 0)
            } else {
                dash()
            },
            if gms {
                format!(
                    "{} ({})",
                    f(&v["summary_cpu_us"], 1),
                    f(&v["summary_ns_per_page"], 0)
                )
            } else {
                dash()
            },
            if gms {
                format!(
                    "{} / {}",
                    f(&v["initiator_kb_in_max"], 0),
                    f(&v["initiator_kb_out_max"], 0)
                )
            } else {
                dash()
            },
            if gms {
                f(&v["epoch_bytes_per_node_per_s"], 0)
            } else {
                dash()
            },
            f(&v["wall_s"], 1)
        );
    }
    let _ = writeln!(
        s,
        "\nGMS Table 5, for comparison (2-second epochs, 8,192 local and 2,000 global pages a \
         node): the initiator's CPU 78·n µs to request and 45·n µs to distribute, a node's \
         summary 3,512 µs (0.29 µs a local page, 0.54 a global one); traffic 25·n, 154·n and \
         (108 + 2n)·n bytes/s — the weights go to every node, so the last grows with n². Here a \
         plan carries at most `max weights` weights."
    );
    real_markdown(&mut s, &r["real"]);
    if !skipped.is_empty() {
        let _ = writeln!(s, "\nSkipped: {}", skipped.join("; "));
    }
    s += &crate::failed_section(failed);
    s
}

/// The real run's table (`crate::gms_real`).
fn real_markdown(s: &mut String, r: &Value) {
    if r.is_null() {
        return;
    }
    let _ = writeln!(
        s,
        "\n## Real: `netram cache` between {} network-namespace hosts\n\n\
         Host 1 reads {} MiB ({} files, one fio process each) with {} MiB of memory for it; \
         hosts 2–5 offer {} MiB between them (even, or skewed: one holds 5/8); the source is {}. \
         Per case: two sequential passes (128 KiB reads), then {} random 4 KiB reads a process; \
         then every file is read through the mount and its sha256 compared with the source's. \
         Time is wall time of the three fio runs; the cases alternate, {} round(s), and the \
         speed-ups are of the mean times.\n",
        r["hosts"],
        r["data_mib"],
        r["files"],
        r["local_mib"],
        r["idle_mib_total"],
        r["source"].as_str().unwrap_or(""),
        r["random_reads_per_process"],
        r["rounds"],
    );
    let _ = writeln!(
        s,
        "| source link | reader | idle memory (MiB) | pass 1 MB/s | pass 2 MB/s | random IOPS | random p50 / p99 µs | total s | from the cluster / the source (pages) | forwarded / refused |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    for c in r["cases"].as_array().into_iter().flatten() {
        let k = &c["counters"];
        let counts = |a: &str, b: &str| {
            if k.is_null() {
                "—".to_string()
            } else {
                format!("{} / {}", k[a], k[b])
            }
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} / {} | {} | {} | {} |",
            if c["source_1gbit"].as_bool() == Some(true) {
                "1 Gbit/s"
            } else {
                "unshaped"
            },
            c["reader"].as_str().unwrap_or(""),
            if c["idle_mib"].is_null() {
                "—".to_string()
            } else {
                c["idle_mib"].to_string()
            },
            f(&c["seq1_mb_s"], 0),
            f(&c["seq2_mb_s"], 0),
            f(&c["rand_iops"], 0),
            f(&c["rand_p50_us"], 0),
            f(&c["rand_p99_us"], 0),
            f(&c["total_s"], 1),
            counts("cluster_hits", "source_reads"),
            counts("cluster_forwarded", "cluster_forward_refused"),
        );
    }
    let _ = writeln!(
        s,
        "\nSpeed-up (total time) of GMS over the source: {} even, {} skewed, {} skewed with \
         the source at 1 Gbit/s; over random forwarding (N-chance): {} even, {} skewed, {} \
         skewed at 1 Gbit/s.",
        f(&r["speedup_vs_source_even"], 2),
        f(&r["speedup_vs_source_skewed"], 2),
        f(&r["speedup_vs_source_1gbit_skewed"], 2),
        f(&r["speedup_vs_nchance_even"], 2),
        f(&r["speedup_vs_nchance_skewed"], 2),
        f(&r["speedup_vs_nchance_1gbit_skewed"], 2),
    );
    let j = &r["juicefs"];
    if let Some(why) = j["skipped"].as_str() {
        let _ = writeln!(s, "\nJuiceFS was **not compared** in this run: {why}.");
    } else if !j.is_null() {
        let _ = writeln!(
            s,
            "\nOver JuiceFS ({}; {}): {} even, {} skewed, {} skewed at 1 Gbit/s. JuiceFS's \
             community edition has no cache shared between machines: it reads with host 1's \
             memory only, which is what a user of it gets on these hosts.",
            j["version"].as_str().unwrap_or(""),
            j["setup"].as_str().unwrap_or(""),
            f(&r["speedup_vs_juicefs_even"], 2),
            f(&r["speedup_vs_juicefs_skewed"], 2),
            f(&r["speedup_vs_juicefs_1gbit_skewed"], 2),
        );
    }
}
