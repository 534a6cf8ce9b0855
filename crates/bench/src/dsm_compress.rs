//! `netram bench dsm`'s compression part (MIRAGE+ §5.3, Fig. 4; issue 40): what a remote read
//! fault costs when the page it fetches was written in MIRAGE+'s three patterns, with pages
//! compressed when the rule says it pays (`netram_proto::compress`) and never, side by side.
//!
//! Two hosts, network namespaces of this machine, the writer's link shaped by tbf (pages flow
//! from it); on each host two daemons of two clusters, one told the link's speed
//! (`--shm-link-mbps`: it compresses when that pays) and one told 0 (it never does). For each
//! pattern a fresh zero page of a segment whose library is host 1 is written there (random
//! non-zero bytes: EachN every Nth byte, UptoN the first N, RandN N random places), then read
//! on host 2: the read fault is timed, and the whole page checked against what was written.
//! The two clusters take turns page by page, so that the machine's drift falls on both alike.
//!
//! Then the same for the pager's PUTs (compression "offered to the pager's PUTs too"): two
//! pagers on host 1 write back to host 2 over the shaped link, one compressing before it
//! seals and one never, `pager_puts`.

use crate::dsm::daemons;
use crate::netns::{sh, Net};
use crate::Summary;
use netram_proto::PAGE_SIZE;
use netram_shm::Segment;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

const SUBNET: u8 = 82;

/// A page's pattern.
#[derive(Debug, Clone, Copy)]
enum Pattern {
    EachN(usize),
    UptoN(usize),
    RandN(usize),
}

impl Pattern {
    fn name(self) -> (&'static str, usize) {
        match self {
            Pattern::EachN(n) => ("EachN", n),
            Pattern::UptoN(n) => ("UptoN", n),
            Pattern::RandN(n) => ("RandN", n),
        }
    }

    /// A zero page written in this pattern with random non-zero bytes.
    fn page(self, rng: &mut fastrand::Rng) -> Vec<u8> {
        let mut p = vec![0u8; PAGE_SIZE];
        let mut put = |i: usize, rng: &mut fastrand::Rng| p[i] = rng.u8(1..);
        match self {
            Pattern::EachN(n) => (0..PAGE_SIZE).step_by(n).for_each(|i| put(i, rng)),
            Pattern::UptoN(n) => (0..n).for_each(|i| put(i, rng)),
            Pattern::RandN(n) => (0..n).for_each(|_| {
                let i = rng.usize(..PAGE_SIZE);
                put(i, rng)
            }),
        }
        p
    }
}

fn patterns() -> Vec<Pattern> {
    let mut v: Vec<Pattern> = [1, 2, 4, 8, 16, 32, 64]
        .into_iter()
        .map(Pattern::EachN)
        .collect();
    v.extend([128, 512, 1024, 2048, 3072, 4096].map(Pattern::UptoN));
    v.extend([64, 256, 650, 1024, 2048].map(Pattern::RandN));
    v
}

/// A daemon's counter from its metrics (`netram_NAME_total` or `netram_NAME`).
pub(crate) fn metric(control: &Path, name: &str) -> anyhow::Result<u64> {
    let text =
        netram_client::discover::metrics(control.to_str().expect("UTF-8"), Duration::from_secs(5))?;
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (n, v) = l.split_once(' ')?;
            let n = n.strip_prefix("netram_").unwrap_or(n);
            let n = n.strip_suffix("_total").unwrap_or(n);
            (n == name).then(|| v.trim().parse::<f64>().ok().map(|v| v as u64))?
        })
        .ok_or_else(|| anyhow::anyhow!("no metric {name}"))
}

/// The figures at a link of `mbit` Mbit/s, `reps` pages a pattern and cluster.
pub(crate) fn run(exe: &Path, mbit: u32, reps: usize) -> anyhow::Result<Value> {
    let mut net = Net::new("nc", 2, SUBNET).map_err(anyhow::Error::msg)?;
    crate::dsm::credentials(&net, exe, 2)?;
    let ns = net.ns(1);
    sh(&[
        "ip",
        "netns",
        "exec",
        &ns,
        "tc",
        "qdisc",
        "add",
        "dev",
        "eth0",
        "root",
        "tbf",
        "rate",
        &format!("{mbit}mbit"),
        // One packet's worth: a page's packets wait for the link as on a wire of that
        // speed (a burst of a page or more would let it through at the veth's speed).
        "burst",
        "1600",
        "latency",
        "50ms",
    ])
    .map_err(anyhow::Error::msg)?;
    let mbps = mbit.to_string();
    daemons(&mut net, exe, 2, 7077, "on", &["--shm-link-mbps", &mbps])?;
    daemons(&mut net, exe, 2, 7078, "off", &["--shm-link-mbps", "0"])?;
    let sock = |c: &str, i: usize| netram_shm::local::socket_of(&net.path(&format!("{c}{i}.sock")));
    let pats = patterns();
    let pages = pats.len() * reps;
    let mut maps = Vec::new();
    for c in ["on", "off"] {
        let w = Segment::create(
            &sock(c, 1),
            "patterns",
            (pages * PAGE_SIZE) as u64,
            0,
            0o600,
            None,
        )?;
        let r = Segment::attach(&sock(c, 2), "patterns")?;
        maps.push((w, r));
    }
    let compressed0 = metric(&net.path("on1.sock"), "dsm_agent_pages_compressed")?;
    let mut rng = fastrand::Rng::with_seed(0x4d49_5241_4745);
    let mut rows = Vec::new();
    let mut page = 0;
    for &pat in &pats {
        let mut ns = [Vec::new(), Vec::new()];
        let before = metric(&net.path("on1.sock"), "dsm_agent_pages_compressed")?;
        for _ in 0..reps {
            let want = pat.page(&mut rng);
            for (k, (w, r)) in maps.iter().enumerate() {
                // SAFETY: page `page` of each live mapping (the segment holds `pages` pages);
                // plain shared memory, written here and read below through another host's
                // mapping of the same segment.
                unsafe {
                    let at = w.as_ptr().add(page * PAGE_SIZE);
                    std::ptr::copy_nonoverlapping(want.as_ptr(), at, PAGE_SIZE);
                }
                std::thread::sleep(Duration::from_micros(3 * netram_shm::agent::MIN_HOLD_US));
                // SAFETY: as above.
                let got = unsafe {
                    let at = r.as_ptr().add(page * PAGE_SIZE);
                    let t = Instant::now();
                    let first = at.read_volatile();
                    ns[k].push(t.elapsed().as_nanos() as u64);
                    let mut got = vec![first; PAGE_SIZE];
                    std::ptr::copy_nonoverlapping(at, got.as_mut_ptr(), PAGE_SIZE);
                    got
                };
                let (name, n) = pat.name();
                anyhow::ensure!(
                    got == want,
                    "{name}({n}), page {page}: host 2 read other contents than host 1 wrote"
                );
            }
            page += 1;
        }
        let compressed = metric(&net.path("on1.sock"), "dsm_agent_pages_compressed")? - before;
        let (name, n) = pat.name();
        let on = Summary::of_ns(&mut ns[0]);
        let off = Summary::of_ns(&mut ns[1]);
        rows.push(json!({
            "pattern": name, "n": n,
            "compressed_p50_us": on.p50_us, "plain_p50_us": off.p50_us,
            "compressed_vs_plain": on.p50_us / off.p50_us,
            "pages_compressed": compressed, "pages": reps,
        }));
    }
    let total = metric(&net.path("on1.sock"), "dsm_agent_pages_compressed")? - compressed0;
    let aborted = metric(&net.path("on1.sock"), "dsm_agent_pages_raw_aborted")?;
    let off_compressed = metric(&net.path("off1.sock"), "dsm_agent_pages_compressed")?;
    anyhow::ensure!(
        off_compressed == 0,
        "the cluster told never to compress compressed {off_compressed} pages"
    );
    drop(maps);
    let pager = pager_puts(&net, mbit, reps)?;
    Ok(json!({
        "link_mbit": mbit,
        "reps": reps,
        "pages_compressed": total,
        "pages_aborted": aborted,
        "rows": rows,
        "pager": pager,
    }))
}

/// The patterns the pager's write-backs are timed in: compressible to incompressible.
fn pager_patterns() -> Vec<Pattern> {
    vec![
        Pattern::UptoN(512),
        Pattern::RandN(256),
        Pattern::EachN(8),
        Pattern::UptoN(2048),
        Pattern::UptoN(4096),
    ]
}

/// Compression offered to the pager's PUTs (issue 40; `crates/pager/src/pager/seal.rs`):
/// two pagers on host 1, in one thread in its namespace, write back to host 2's daemon over
/// the shaped link — one compressing before it seals by the rule for this link, one never —
/// `PAGES` pages a pattern, taking turns `reps` times; each round's pages are read back and
/// checked. Figures: pages a second written back (written, then flushed: every PUT
/// acknowledged), and the bytes the compressing pager saved.
fn pager_puts(net: &Net, mbit: u32, reps: usize) -> anyhow::Result<Value> {
    const PAGES: usize = 256;
    let ns1 = net.ns(1);
    let server = format!("{}:7077", net.ip(2));
    let tls = net.path("tls").join("client");
    std::thread::spawn(move || -> anyhow::Result<Value> {
        crate::dsm::enter(&ns1)?;
        let rule = netram_proto::compress::Rule {
            link_bytes_per_us: f64::from(mbit) / 8.0,
            codec_us: netram_proto::compress::calibrate(),
        };
        let open = |compress: bool| -> anyhow::Result<netram_client::ClientPager> {
            let mut p = netram_client::open_pager(&netram_client::OpenOptions {
                servers: vec![server.clone()],
                backing: netram_pager::Backing::Cluster,
                pages: PAGES as u64,
                cache_pages: 32,
                spill_dir: None,
                low_latency: false,
                redundancy: "none".parse().map_err(|e| anyhow::anyhow!("{e:?}"))?,
                security: netram_client::security(Some(&tls), false)?,
            })?;
            anyhow::ensure!(
                p.set_compression(compress.then_some(rule)),
                "the pager does not seal its pages"
            );
            Ok(p)
        };
        let mut pagers = [open(true)?, open(false)?];
        let mut rng = fastrand::Rng::with_seed(0x5055_5453);
        let mut rows = Vec::new();
        for pat in pager_patterns() {
            let mut secs = [0f64; 2];
            let before: Vec<_> = pagers.iter().map(|p| p.counters().clone()).collect();
            for _ in 0..reps {
                let pages: Vec<Vec<u8>> = (0..PAGES).map(|_| pat.page(&mut rng)).collect();
                for (k, p) in pagers.iter_mut().enumerate() {
                    let t = Instant::now();
                    for (i, d) in pages.iter().enumerate() {
                        p.write(i as u64, d)?;
                    }
                    p.flush()?;
                    secs[k] += t.elapsed().as_secs_f64();
                    let mut got = vec![0u8; PAGE_SIZE];
                    for (i, d) in pages.iter().enumerate() {
                        p.read(i as u64, &mut got)?;
                        let (name, n) = pat.name();
                        anyhow::ensure!(
                            &got == d,
                            "pager {k}, {name}({n}), page {i}: read back other contents"
                        );
                    }
                }
            }
            let (name, n) = pat.name();
            let c = pagers[0].counters();
            let d = |f: fn(&netram_pager::PagerCounters) -> u64| f(c) - f(&before[0]);
            let written = (reps * PAGES) as f64;
            rows.push(json!({
                "pattern": name, "n": n,
                "compressed_pages_per_s": written / secs[0],
                "plain_pages_per_s": written / secs[1],
                "compressed_vs_plain": secs[1] / secs[0],
                "pages_compressed": d(|c| c.pages_compressed),
                "pages_aborted": d(|c| c.pages_compress_aborted),
                "bytes_saved": d(|c| c.bytes_saved_compressing),
                "pages_written_back": d(|c| c.puts),
            }));
        }
        let plain = pagers[1].counters();
        anyhow::ensure!(
            plain.pages_compressed == 0,
            "the pager told never to compress compressed {} pages",
            plain.pages_compressed
        );
        Ok(json!({
            "pages": PAGES, "codec_us": rule.codec_us, "min_saving": rule.min_saving(),
            "rows": rows,
        }))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the pagers' thread panicked"))?
}

/// The report's section for one link speed.
pub(crate) fn markdown(v: &Value) -> String {
    let mut s = format!(
        "\n## Compression (MIRAGE+ Fig. 4), a {} Mbit/s link\n\nA read fault on host 2 of a \
         page host 1 wrote in the pattern (random non-zero bytes on a zero page), p50 µs of {} \
         pages each; compressed when the rule says it pays (the daemon told the link's \
         speed) and never, side by side; {} pages compressed, {} given up by the codec.\n\n\
         | pattern | N | compressed | never | ratio | pages compressed |\n|---|---|---|---|---|---|\n",
        v["link_mbit"], v["reps"], v["pages_compressed"], v["pages_aborted"]
    );
    for r in v["rows"].as_array().into_iter().flatten() {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        s.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} | {:.2} | {} of {} |\n",
            r["pattern"].as_str().unwrap_or("?"),
            r["n"],
            f("compressed_p50_us"),
            f("plain_p50_us"),
            f("compressed_vs_plain"),
            r["pages_compressed"],
            r["pages"],
        ));
    }
    let p = &v["pager"];
    s.push_str(&format!(
        "\nThe pager's write-backs over the same link (host 1 to host 2's daemon, sealed as \
         always): pages a second written and flushed, {} pages a pattern and round, {} rounds, \
         compressing before sealing by the rule for this link (LZ4 {:.2} µs a page here: a \
         page must shrink by {} bytes) and never, taking turns; every page read back and \
         checked.\n\n\
         | pattern | N | compressing | never | speed-up | compressed / aborted | bytes saved |\n\
         |---|---|---|---|---|---|---|\n",
        p["pages"],
        v["reps"],
        p["codec_us"].as_f64().unwrap_or(f64::NAN),
        p["min_saving"],
    ));
    for r in p["rows"].as_array().into_iter().flatten() {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        s.push_str(&format!(
            "| {} | {} | {:.0} | {:.0} | {:.2}× | {} / {} | {} |\n",
            r["pattern"].as_str().unwrap_or("?"),
            r["n"],
            f("compressed_pages_per_s"),
            f("plain_pages_per_s"),
            f("compressed_vs_plain"),
            r["pages_compressed"],
            r["pages_aborted"],
            r["bytes_saved"],
        ));
    }
    s
}

/// MIRAGE+ Fig. 4's shape: per pattern (a column) and link speed (a row), the read fault's
/// p50 against N, compressed (blue) and never (grey).
pub(crate) fn plot(links: &[Value], path: &Path) -> anyhow::Result<()> {
    use plotters::prelude::*;
    anyhow::ensure!(!links.is_empty(), "no compression figures to plot");
    let names = ["EachN", "UptoN", "RandN"];
    let root = SVGBackend::new(path, (1200, 340 * links.len() as u32 + 60)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        "bench dsm: a remote read fault of a page written in a pattern (MIRAGE+ Fig. 4), \
         compressed when it pays (blue) and never (grey)",
        ("sans-serif", 16),
    )?;
    let areas = root.split_evenly((links.len(), names.len()));
    let mut areas = areas.iter();
    for link in links {
        for name in names {
            let area = areas.next().expect("one area a panel");
            let rows: Vec<(f64, f64, f64)> = link["rows"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|r| r["pattern"] == name)
                .filter_map(|r| {
                    Some((
                        r["n"].as_f64()?,
                        r["compressed_p50_us"].as_f64()?,
                        r["plain_p50_us"].as_f64()?,
                    ))
                })
                .collect();
            if rows.is_empty() {
                continue;
            }
            // EachN's N doubles (1 to 64): on a log₂ axis; the others' on a linear one.
            let each = name == "EachN";
            let x = |n: f64| if each { n.log2() } else { n };
            let x_hi = rows.iter().map(|r| x(r.0)).fold(0.0, f64::max);
            let x_range = if each {
                -0.3..x_hi + 0.3
            } else {
                0.0..x_hi * 1.05
            };
            let y_hi = rows.iter().map(|r| r.1.max(r.2)).fold(0.0, f64::max) * 1.15;
            let mut chart = ChartBuilder::on(area)
                .caption(
                    format!("{name}, {} Mbit/s", link["link_mbit"]),
                    ("sans-serif", 14),
                )
                .margin(10)
                .x_label_area_size(35)
                .y_label_area_size(55)
                .build_cartesian_2d(x_range, 0f64..y_hi)?;
            chart
                .configure_mesh()
                .light_line_style(WHITE)
                .x_labels(if each { rows.len() } else { 6 })
                .x_desc("N")
                .y_desc("read fault p50 (µs)")
                .x_label_formatter(&|&v| {
                    if each {
                        format!("{:.0}", v.exp2())
                    } else {
                        format!("{v:.0}")
                    }
                })
                .axis_desc_style(("sans-serif", 12))
                .draw()?;
            let grey = RGBColor(150, 150, 150);
            for (color, pick) in [
                (
                    BLUE,
                    (|r: &(f64, f64, f64)| r.1) as fn(&(f64, f64, f64)) -> f64,
                ),
                (grey, |r| r.2),
            ] {
                let pts: Vec<(f64, f64)> = rows.iter().map(|r| (x(r.0), pick(r))).collect();
                chart.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?;
                chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
            }
        }
    }
    root.present()?;
    Ok(())
}
