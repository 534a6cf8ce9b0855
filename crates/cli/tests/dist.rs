//! What `dist/` ships, checked against what netram does: every query of the Grafana dashboard
//! (`dist/grafana-netram.json`) names a metric that a daemon's `/metrics` really exports, so a
//! renamed or removed counter cannot leave an operator's panel silently empty.

use common::ServerProcess;
use std::collections::BTreeSet;
use std::path::Path;

mod common;

/// Every `expr` string anywhere in `v`.
fn exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x.as_str()) {
                    ("expr", Some(e)) => out.push(e.to_string()),
                    _ => exprs(x, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| exprs(x, out)),
        _ => {}
    }
}

/// The `netram_…` metric names a PromQL expression uses.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("netram_") {
        let name: String = rest[i..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        rest = &rest[i + name.len()..];
        names.push(name);
    }
    names
}

#[test]
fn every_dashboard_query_names_an_exported_metric() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../dist/grafana-netram.json");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut all = Vec::new();
    exprs(&dash, &mut all);
    assert!(all.len() >= 20, "the dashboard's queries: {all:?}");
    let used: BTreeSet<String> = all.iter().flat_map(|e| metric_names(e)).collect();
    for e in &all {
        assert!(
            !metric_names(e).is_empty(),
            "a query naming no netram metric: {e}"
        );
    }

    let metrics = format!("127.0.0.1:{}", common::reserved_port());
    let _d = ServerProcess::start(&["--capacity", "16M", "--metrics", &metrics]);
    let text = common::http_get(&metrics, "/metrics", None);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let exported: BTreeSet<String> = text
        .lines()
        .filter(|l| l.starts_with("netram_"))
        .filter_map(|l| l.split([' ', '{']).next().map(str::to_string))
        .collect();
    assert!(exported.len() > 50, "{exported:?}");
    let missing: Vec<&String> = used.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "dashboard queries name metrics /metrics does not export: {missing:?}"
    );
    // The check can fail: a name nobody exports is caught.
    assert!(!exported.contains("netram_no_such_metric_total"));
}
