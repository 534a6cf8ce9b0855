//! `netram cache`'s counters for Prometheus: written, in its text format, to a file that
//! node_exporter's textfile collector serves on its `/metrics` (`--metrics-file`), every
//! second and when the cache stops.
//!
//! A file rather than a port of its own: a cache is one process per mount, started and stopped
//! by users, and a listening port per mount would be one more thing to secure and to find;
//! node_exporter already runs on the machines that are scraped and serves such files. The
//! file is replaced whole (written beside it, then renamed), so a scrape never reads half of
//! it.

use std::fmt::Write as _;
use std::path::Path;

/// Counters that are levels, not counts.
const GAUGES: &[&str] = &["cluster_epoch"];

/// The counters in Prometheus' text format 0.0.4, each named `netram_cache_NAME`. Written
/// here, not by prometheus-client (the daemon's encoder): that writes OpenMetrics, whose
/// counters' samples carry a `_total` suffix that the textfile collector's parser (the 0.0.4
/// format) reads as another, untyped family.
pub fn encode(counters: &[(String, u64)]) -> String {
    let mut text = String::new();
    for (name, value) in counters {
        let kind = if GAUGES.contains(&name.as_str()) {
            "gauge"
        } else {
            "counter"
        };
        let _ = write!(
            text,
            "# HELP netram_cache_{name} netram cache: {name}\n\
             # TYPE netram_cache_{name} {kind}\n\
             netram_cache_{name} {value}\n"
        );
    }
    text
}

/// Replaces `path` with the counters (written beside it, then renamed over it).
pub fn write(path: &Path, counters: &[(String, u64)]) -> std::io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("not a file name"))?;
    let tmp = path.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    std::fs::write(&tmp, encode(counters))?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_gauges_in_the_text_format() {
        let text = encode(&[("hits".into(), 7), ("cluster_epoch".into(), 3)]);
        assert_eq!(
            text,
            "# HELP netram_cache_hits netram cache: hits\n\
             # TYPE netram_cache_hits counter\n\
             netram_cache_hits 7\n\
             # HELP netram_cache_cluster_epoch netram cache: cluster_epoch\n\
             # TYPE netram_cache_cluster_epoch gauge\n\
             netram_cache_cluster_epoch 3\n"
        );
        let dir = std::env::temp_dir().join(format!("netram-metrics-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("cache.prom");
        write(&f, &[("hits".into(), 1)]).unwrap();
        write(&f, &[("hits".into(), 2)]).unwrap();
        assert!(std::fs::read_to_string(&f)
            .unwrap()
            .contains("netram_cache_hits 2"));
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "no temporary file left"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
