//! Two builds of netram side by side (`netram bench ab`): each benchmark run with one build's
//! binary, then the other's, pair after pair, and every figure of their JSON results set next
//! to each other, each build's median and the ratio of the medians.
//!
//! Why a command of its own: a change is judged against the binary before it (issue 38 asks
//! for every benchmark before and after), and on these shared, noisy machines only runs that
//! alternate in the same hour compare (MACHINE-NOTES: a machine drifts by a quarter within an
//! hour). The order alternates within pairs too (old, new; new, old; …), so that a drift over
//! the run weighs on both builds alike. No figure is picked per benchmark: every number of
//! every result is flattened to its path (`fio.netram.randread_qd1.iops`), so that a figure a
//! benchmark gains later is compared without this file changing. A run that fails gives no
//! figure and is listed as failed.

use anyhow::Context;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The benchmarks `netram bench` has, in the order `ab` runs them by default (short ones first).
pub const BENCHES: [&str; 8] = [
    "core",
    "security",
    "uffd",
    "programs",
    "reliability",
    "adapt",
    "gms",
    "nbd",
];

/// Arrays longer than this (latency samples, curves) are not flattened figure by figure.
const LONGEST_ARRAY: usize = 16;

#[derive(Debug, Clone)]
pub struct Options {
    /// The earlier build's `netram` (its `libnetram_preload.so` beside it).
    pub old: PathBuf,
    /// The later build's.
    pub new: PathBuf,
    pub pairs: u32,
    /// Each benchmark's `--quick` run.
    pub quick: bool,
    pub benches: Vec<String>,
    /// Arguments given to one benchmark, by name (`nbd` → `["--fio-only"]`), both builds alike.
    pub extra: BTreeMap<String, Vec<String>>,
    pub out: PathBuf,
}

/// One figure of one benchmark: each build's values, run by run.
#[derive(Debug, Default, Serialize)]
pub struct Figure {
    pub old: Vec<f64>,
    pub new: Vec<f64>,
    pub old_median: Option<f64>,
    pub new_median: Option<f64>,
    /// new_median / old_median.
    pub ratio: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Results {
    machine: crate::machine::Machine,
    old: String,
    new: String,
    extra: BTreeMap<String, Vec<String>>,
    pairs: u32,
    quick: bool,
    /// Runs that failed: (benchmark, build, pair).
    failed: Vec<(String, String, u32)>,
    benches: BTreeMap<String, BTreeMap<String, Figure>>,
}

/// Runs the benchmarks, writes ab.json and ab.md into `opts.out`, returns the report and
/// whether every run succeeded.
pub fn run(opts: &Options) -> anyhow::Result<(String, bool)> {
    for exe in [&opts.old, &opts.new] {
        anyhow::ensure!(exe.is_file(), "{}: no such binary", exe.display());
    }
    if let Some(bad) = opts.benches.iter().find(|b| !BENCHES.contains(&b.as_str())) {
        anyhow::bail!("unknown benchmark {bad:?} (known: {BENCHES:?})");
    }
    if let Some(bad) = opts.extra.keys().find(|b| !BENCHES.contains(&b.as_str())) {
        anyhow::bail!("--with: unknown benchmark {bad:?} (known: {BENCHES:?})");
    }
    let benches: Vec<String> = if opts.benches.is_empty() {
        BENCHES.iter().map(|b| b.to_string()).collect()
    } else {
        opts.benches.clone()
    };
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("creating {}", opts.out.display()))?;
    let mut results = Results {
        machine: crate::machine::Machine::describe(),
        old: opts.old.display().to_string(),
        new: opts.new.display().to_string(),
        extra: opts.extra.clone(),
        pairs: opts.pairs,
        quick: opts.quick,
        failed: Vec::new(),
        benches: BTreeMap::new(),
    };
    for bench in &benches {
        let figures = results.benches.entry(bench.clone()).or_default();
        for pair in 1..=opts.pairs {
            let builds = [("old", &opts.old), ("new", &opts.new)];
            // Old first in odd pairs, new first in even ones.
            let order = if pair % 2 == 1 { [0, 1] } else { [1, 0] };
            for i in order {
                let (build, exe) = builds[i];
                let dir = opts.out.join(format!("{bench}-{build}-{pair}"));
                eprintln!(
                    "netram bench ab: {bench}, {build}, pair {pair} of {}",
                    opts.pairs
                );
                let extra = opts.extra.get(bench).map_or(&[][..], Vec::as_slice);
                match run_one(exe, bench, opts.quick, extra, &dir) {
                    Ok(json) => {
                        let mut flat = BTreeMap::new();
                        flatten("", &json, &mut flat);
                        for (key, v) in flat {
                            let f = figures.entry(key).or_default();
                            match build {
                                "old" => f.old.push(v),
                                _ => f.new.push(v),
                            }
                        }
                    }
                    Err(e) => {
                        eprintln!("netram bench ab: {bench} with the {build} build failed: {e:#}");
                        results.failed.push((bench.clone(), build.into(), pair));
                    }
                }
            }
        }
        for f in figures.values_mut() {
            f.old_median = median(&f.old);
            f.new_median = median(&f.new);
            f.ratio = match (f.old_median, f.new_median) {
                (Some(o), Some(n)) if o != 0.0 => Some(n / o),
                _ => None,
            };
        }
    }
    let report = report(&results);
    std::fs::write(
        opts.out.join("ab.json"),
        serde_json::to_string_pretty(&results)?,
    )?;
    std::fs::write(opts.out.join("ab.md"), &report)?;
    Ok((report, results.failed.is_empty()))
}

/// One benchmark run with `exe`, its output in `dir`; its JSON result.
fn run_one(
    exe: &Path,
    bench: &str,
    quick: bool,
    extra: &[String],
    dir: &Path,
) -> anyhow::Result<Value> {
    std::fs::create_dir_all(dir)?;
    let log = std::fs::File::create(dir.join("run.log"))?;
    let mut cmd = Command::new(exe);
    cmd.args(["bench", bench]);
    if quick {
        cmd.arg("--quick");
    }
    cmd.args(extra)
        .arg("--out")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    let status = cmd
        .status()
        .with_context(|| format!("starting {}", exe.display()))?;
    anyhow::ensure!(
        status.success(),
        "{status}; its output is in {}",
        dir.join("run.log").display()
    );
    let path = dir.join(format!("{bench}.json"));
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Every number in `v` under its path; the machine's description and long arrays left out.
fn flatten(path: &str, v: &Value, out: &mut BTreeMap<String, f64>) {
    match v {
        Value::Number(n) => {
            if let Some(x) = n.as_f64() {
                out.insert(path.to_string(), x);
            }
        }
        Value::Object(m) => {
            for (k, v) in m {
                if path.is_empty() && k == "machine" {
                    continue;
                }
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                flatten(&p, v, out);
            }
        }
        Value::Array(a) if a.len() <= LONGEST_ARRAY => {
            for (i, v) in a.iter().enumerate() {
                // An element that names itself (the targets: `{"name": …, "ratio": …}`) is
                // found by its name, which stays when the list changes order or grows.
                let at = match v.get("name").and_then(Value::as_str) {
                    Some(name) => format!("{path}[{name}]"),
                    None => format!("{path}[{i}]"),
                };
                flatten(&at, v, out);
            }
        }
        _ => {}
    }
}

fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    Some(if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    })
}

fn report(r: &Results) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# netram bench ab\n");
    let _ = writeln!(s, "Machine: {}\n", r.machine.one_line());
    let _ = writeln!(
        s,
        "old: `{}` · new: `{}` · {} pair(s), alternating (old first in odd pairs){}.\n",
        r.old,
        r.new,
        r.pairs,
        if r.quick { " · quick runs" } else { "" }
    );
    for (bench, args) in &r.extra {
        let _ = writeln!(s, "`{bench}` run with `{}`.\n", args.join(" "));
    }
    let _ = writeln!(
        s,
        "Every figure of each benchmark's JSON: each build's runs, their medians, and new / old. \
         Whether higher is better depends on the figure (IOPS, pages/s: higher; µs, s: lower). \
         Figures that were the same in every run (sizes, settings) are left out.\n"
    );
    if !r.failed.is_empty() {
        let _ = writeln!(s, "**Failed runs** (no figures from them):");
        for (b, build, pair) in &r.failed {
            let _ = writeln!(s, "- {b}, {build} build, pair {pair}");
        }
        let _ = writeln!(s);
    }
    for (bench, figures) in &r.benches {
        let _ = writeln!(s, "## {bench}\n");
        let _ = writeln!(
            s,
            "| figure | old | new | old median | new median | new / old |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|");
        for (key, f) in figures {
            let all: Vec<f64> = f.old.iter().chain(&f.new).copied().collect();
            if all.windows(2).all(|w| w[0] == w[1]) {
                continue;
            }
            let list = |v: &[f64]| v.iter().map(|x| num(*x)).collect::<Vec<_>>().join(", ");
            let opt = |x: Option<f64>| x.map_or("–".to_string(), num);
            let _ = writeln!(
                s,
                "| {key} | {} | {} | {} | {} | {} |",
                list(&f.old),
                list(&f.new),
                opt(f.old_median),
                opt(f.new_median),
                f.ratio.map_or("–".to_string(), |x| format!("{x:.2}"))
            );
        }
        let _ = writeln!(s);
    }
    s
}

/// A figure to three significant digits or so, without exponents.
fn num(x: f64) -> String {
    let a = x.abs();
    if a >= 100.0 || x == x.trunc() {
        format!("{x:.0}")
    } else if a >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_are_flattened_by_path_without_the_machine_or_long_arrays() {
        let v: Value = serde_json::json!({
            "machine": {"cpus": 2},
            "fio": {"netram": {"randread_qd1": {"iops": 24000.5, "p50_us": 42}}},
            "short": [1, 2],
            "targets": [{"name": "a / b", "ratio": 0.5, "met": true}],
            "samples": (0..100).collect::<Vec<_>>(),
            "name": "x",
            "ok": true
        });
        let mut flat = BTreeMap::new();
        flatten("", &v, &mut flat);
        let keys: Vec<&str> = flat.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "fio.netram.randread_qd1.iops",
                "fio.netram.randread_qd1.p50_us",
                "short[0]",
                "short[1]",
                "targets[a / b].ratio"
            ]
        );
        assert_eq!(flat["fio.netram.randread_qd1.iops"], 24000.5);
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }

    #[test]
    fn a_figure_the_same_in_every_run_is_left_out_of_the_report() {
        let mut figures = BTreeMap::new();
        figures.insert(
            "size".to_string(),
            Figure {
                old: vec![8.0, 8.0],
                new: vec![8.0, 8.0],
                ..Default::default()
            },
        );
        figures.insert(
            "iops".to_string(),
            Figure {
                old: vec![10.0, 12.0],
                new: vec![15.0, 13.0],
                old_median: Some(11.0),
                new_median: Some(14.0),
                ratio: Some(14.0 / 11.0),
            },
        );
        let r = Results {
            machine: crate::machine::Machine::describe(),
            old: "a".into(),
            new: "b".into(),
            extra: BTreeMap::new(),
            pairs: 2,
            quick: true,
            failed: vec![("nbd".into(), "old".into(), 1)],
            benches: BTreeMap::from([("core".to_string(), figures)]),
        };
        let text = report(&r);
        assert!(
            text.contains("| iops | 10, 12 | 15, 13 | 11 | 14 | 1.27 |"),
            "{text}"
        );
        assert!(!text.contains("| size |"), "{text}");
        assert!(text.contains("- nbd, old build, pair 1"), "{text}");
    }
}
