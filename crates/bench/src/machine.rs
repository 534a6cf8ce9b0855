//! Which machine a result was measured on.

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub hostname: String,
    pub kernel: String,
    pub cpu: String,
    pub cpus: usize,
    pub mem_total_kib: u64,
    pub date_utc: String,
    pub root: bool,
}

fn first_line_with(path: &str, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split(':').nth(1))
        .map(|v| v.trim().to_string())
}

impl Machine {
    pub fn describe() -> Self {
        let uname = rustix::system::uname();
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Self {
            hostname: uname.nodename().to_string_lossy().into_owned(),
            kernel: uname.release().to_string_lossy().into_owned(),
            cpu: first_line_with("/proc/cpuinfo", "model name").unwrap_or_else(|| "unknown".into()),
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            mem_total_kib: first_line_with("/proc/meminfo", "MemTotal")
                .and_then(|v| v.trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(0),
            date_utc: format!("{secs} (unix seconds)"),
            root: rustix::process::geteuid().is_root(),
        }
    }

    pub fn one_line(&self) -> String {
        format!(
            "{} · {} · {} × {} · {} MiB · kernel {}{}",
            self.hostname,
            self.date_utc,
            self.cpus,
            self.cpu,
            self.mem_total_kib / 1024,
            self.kernel,
            if self.root { " · root" } else { "" }
        )
    }
}
