//! `netram demo`: a local cluster on loopback, a working set several times larger than the
//! pager's cache paged through it, then the same through the local disk, and the comparison.

use indicatif::{ProgressBar, ProgressStyle};
use netram_bench::cluster::LocalCluster;
use netram_bench::{page_content, Summary};
use netram_node::client::{ClientConfig, TcpTransport};
use netram_node::disk::FileDisk;
use netram_pager::{Backing, Pager, PagerConfig};
use netram_proto::PAGE_SIZE;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// The working set paged through the cluster, e.g. 128M, 1G.
    #[arg(long, default_value = "128M")]
    size: String,
    /// The pager's local cache; the rest of the working set lives on the servers.
    #[arg(long, default_value = "16M")]
    cache: String,
    /// Page servers to start on loopback.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=64))]
    servers: u16,
    /// Run servers and pager in the low-latency mode (PM QoS when root, brief polling).
    #[arg(long)]
    low_latency: bool,
    /// Directory of the spill file used by the disk run [default: the system temp dir].
    #[arg(long)]
    spill_dir: Option<PathBuf>,
}

struct Run {
    backing: Backing,
    write_pages_per_s: f64,
    read_pages_per_s: f64,
    read: Summary,
    verified: u64,
}

fn bar(len: u64, msg: String) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:<28} [{bar:32}] {pos}/{len} pages {per_sec}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(msg);
    pb
}

fn run_one(
    backing: Backing,
    pages: u64,
    cache_pages: usize,
    cluster: &LocalCluster,
    args: &DemoArgs,
) -> anyhow::Result<Run> {
    let dir = args.spill_dir.clone().unwrap_or_else(std::env::temp_dir);
    let disk = FileDisk::create_in(&dir)?;
    let client = ClientConfig {
        low_latency: args.low_latency,
        ..ClientConfig::new()
    };
    let addrs = if backing == Backing::Disk {
        Vec::new()
    } else {
        cluster.addrs()
    };
    let transport = TcpTransport::connect(&addrs, &client);
    let cfg = PagerConfig {
        pages,
        cache_pages,
        backing,
        ..Default::default()
    };
    let mut pager = Pager::new(cfg, transport, disk);
    let mut buf = vec![0u8; PAGE_SIZE];

    let pb = bar(pages, format!("{backing}: writing"));
    let start = Instant::now();
    for p in 0..pages {
        page_content(42, p, &mut buf);
        pager.write(p, &buf)?;
        if p % 256 == 0 {
            pb.set_position(p);
        }
    }
    pager.flush()?;
    let write_pages_per_s = pages as f64 / start.elapsed().as_secs_f64();
    pb.finish_and_clear();

    let mut order: Vec<u64> = (0..pages).collect();
    fastrand::Rng::with_seed(7).shuffle(&mut order);
    let pb = bar(pages, format!("{backing}: reading, verifying"));
    let mut want = vec![0u8; PAGE_SIZE];
    let mut lat = Vec::with_capacity(pages as usize);
    let mut verified = 0;
    let start = Instant::now();
    for (i, &p) in order.iter().enumerate() {
        let t = Instant::now();
        pager.read(p, &mut buf)?;
        lat.push(t.elapsed().as_nanos() as u64);
        page_content(42, p, &mut want);
        anyhow::ensure!(
            buf == want,
            "page {p} read back wrong with {backing} backing"
        );
        verified += 1;
        if i % 256 == 0 {
            pb.set_position(i as u64);
        }
    }
    let read_pages_per_s = pages as f64 / start.elapsed().as_secs_f64();
    pb.finish_and_clear();
    let c = pager.counters().clone();
    tracing::info!(?c, "{backing} run");
    pager.into_transport().close();
    Ok(Run {
        backing,
        write_pages_per_s,
        read_pages_per_s,
        read: Summary::of_ns(&mut lat),
        verified,
    })
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let bytes = crate::size("size", &args.size)?;
    let cache = crate::size("cache", &args.cache)?;
    let pages = bytes / PAGE_SIZE as u64;
    let cache_pages = (cache / PAGE_SIZE as u64) as usize;
    anyhow::ensure!(pages > 0, "size must be at least one page");
    anyhow::ensure!(
        (cache_pages as u64) < pages,
        "the cache ({}) must be smaller than the working set ({})",
        args.cache,
        args.size
    );
    let n = usize::from(args.servers);
    // Room for the whole working set on any two servers, so the demo never spills.
    let per_server = (bytes / n.min(2) as u64).max(PAGE_SIZE as u64) + (1 << 20);
    println!(
        "netram demo: {n} page servers on loopback, a {} working set through a {} local cache{}",
        args.size,
        args.cache,
        if args.low_latency {
            ", low-latency mode"
        } else {
            ""
        }
    );
    let cluster = LocalCluster::start(n, per_server, args.low_latency)?;
    let runs = [
        run_one(Backing::Cluster, pages, cache_pages, &cluster, &args)?,
        run_one(Backing::Disk, pages, cache_pages, &cluster, &args)?,
    ];
    let spread: Vec<String> = (0..n)
        .map(|i| cluster.stat(i, "pages_stored").to_string())
        .collect();
    cluster.stop();

    println!(
        "\n{:<10} {:>14} {:>14} {:>12} {:>12} {:>10}",
        "backing", "write pages/s", "read pages/s", "read p50", "read p99", "verified"
    );
    for r in &runs {
        println!(
            "{:<10} {:>14.0} {:>14.0} {:>10.1}µs {:>10.1}µs {:>10}",
            r.backing.to_string(),
            r.write_pages_per_s,
            r.read_pages_per_s,
            r.read.p50_us,
            r.read.p99_us,
            r.verified
        );
    }
    let (c, d) = (&runs[0], &runs[1]);
    println!(
        "\ncluster memory vs local disk: reads {:.2}× the pages/s, p50 latency {:.2}× ({} pages checked, all correct)",
        c.read_pages_per_s / d.read_pages_per_s,
        c.read.p50_us / d.read.p50_us,
        c.verified + d.verified
    );
    println!(
        "pages stored per server during the cluster run: {}",
        spread.join(", ")
    );
    println!(
        "(disk run: an O_DIRECT spill file in {}; every server stopped, the spill files are gone)",
        args.spill_dir
            .clone()
            .unwrap_or_else(std::env::temp_dir)
            .display()
    );
    Ok(())
}
