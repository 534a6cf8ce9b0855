//! The `NETRAM_*` environment as one typed configuration. `netram run` writes it for the program
//! it starts ([`RunEnv::to_vars`]); the preload library and the C ABI read it
//! ([`RunEnv::from_env`]); so the three agree on every name, unit and default, and a bad value is
//! refused with the variable named.

use netram_pager::{Backing, Scheme};
use std::ffi::OsString;
use std::path::PathBuf;

/// Every variable, with what it means. `netram run --help` says the same in its options.
pub mod var {
    /// Local memory for the program's heap (a size: `256M`); without it the preload library
    /// stays out of the way.
    pub const LOCAL_MEM: &str = "NETRAM_LOCAL_MEM";
    /// Page servers, comma-separated; unset: those the local daemon knows (`DAEMON`).
    pub const SERVERS: &str = "NETRAM_SERVERS";
    /// This machine's daemon's control socket, where it answers `/members` [default:
    /// `discover::default_control(7077)`].
    pub const DAEMON: &str = "NETRAM_DAEMON";
    /// `cluster`, `disk` or `cluster+disk`.
    pub const BACKING: &str = "NETRAM_BACKING";
    /// `none`, `mirror:N`, `parity:N` or `rs:K+M`.
    pub const REDUNDANCY: &str = "NETRAM_REDUNDANCY";
    /// The region's size: the most the program keeps on netram at once.
    pub const MAX_MEM: &str = "NETRAM_MAX_MEM";
    /// Local memory for each forked child (a size), or `unlimited`; unset: as `LOCAL_MEM`.
    pub const CHILD_MEM: &str = "NETRAM_CHILD_MEM";
    /// Allocations of at least this size go to the region.
    pub const THRESHOLD: &str = "NETRAM_THRESHOLD";
    /// Anything but `0`: the low-latency mode (PM QoS, polling).
    pub const LOW_LATENCY: &str = "NETRAM_LOW_LATENCY";
    /// Directory of the spill file.
    pub const SPILL_DIR: &str = "NETRAM_SPILL_DIR";
    /// Pages sampled per victim (CLOCK); 0 for first in, first out.
    pub const SAMPLES: &str = "NETRAM_SAMPLES";
    /// A directory where each process writes its counters at exit.
    pub const REPORT: &str = "NETRAM_REPORT";
    /// Set: exit with status 70 rather than run without netram.
    pub const REQUIRED: &str = "NETRAM_REQUIRED";
    /// The preload library's log filter (`tracing`'s syntax: `debug`, `netram_uffd=trace`).
    pub const LOG: &str = "NETRAM_LOG";
    /// The node's credentials directory (`netram cluster init`, `netram keygen`).
    pub const TLS: &str = "NETRAM_TLS";
    /// Set (not `0`): clear TCP to loopback servers, no credentials (development only).
    pub const INSECURE: &str = "NETRAM_INSECURE";
    /// The link's speed in Mbit/s by which pages are compressed before they are sealed when
    /// that pays; unset or 0: never (`crate::open::compression`).
    pub const COMPRESS_LINK_MBPS: &str = "NETRAM_COMPRESS_LINK_MBPS";
}

/// `child_mem` when forked children keep every page they touch (`NETRAM_CHILD_MEM=unlimited`).
pub const CHILD_MEM_UNLIMITED: u64 = u64::MAX;

/// A variable that is set but does not parse.
#[derive(Debug, thiserror::Error)]
#[error("{name}={value}: {why}")]
pub struct EnvError {
    pub name: &'static str,
    pub value: String,
    pub why: String,
}

/// What the `NETRAM_*` variables say. A field is `None` (or false, or empty) when its variable
/// is unset; the front end picks its own default then.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunEnv {
    pub local_mem: Option<u64>,
    pub servers: Vec<String>,
    pub backing: Option<Backing>,
    pub redundancy: Option<Scheme>,
    pub max_mem: Option<u64>,
    /// [`CHILD_MEM_UNLIMITED`] for `unlimited`.
    pub child_mem: Option<u64>,
    pub threshold: Option<u64>,
    pub low_latency: bool,
    pub spill_dir: Option<PathBuf>,
    pub samples: Option<usize>,
    pub report: Option<PathBuf>,
    pub required: bool,
    pub tls: Option<PathBuf>,
    pub insecure: bool,
    /// 0 when unset: never compress.
    pub compress_link_mbps: u32,
}

impl RunEnv {
    /// Reads this process's environment.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_vars(|name| std::env::var_os(name))
    }

    /// Reads the variables through `get` (the environment, or a map in tests).
    pub fn from_vars(get: impl Fn(&str) -> Option<OsString>) -> Result<Self, EnvError> {
        let text = |name: &'static str| -> Result<Option<String>, EnvError> {
            match get(name) {
                None => Ok(None),
                Some(v) => v.into_string().map(Some).map_err(|v| EnvError {
                    name,
                    value: v.to_string_lossy().into_owned(),
                    why: "not UTF-8".into(),
                }),
            }
        };
        let size = |name| parsed(name, text(name)?, parse_size);
        Ok(Self {
            local_mem: size(var::LOCAL_MEM)?,
            servers: text(var::SERVERS)?
                .map(|s| {
                    s.split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
            backing: parsed(var::BACKING, text(var::BACKING)?, str::parse::<Backing>)?,
            redundancy: parsed(
                var::REDUNDANCY,
                text(var::REDUNDANCY)?,
                str::parse::<Scheme>,
            )?,
            max_mem: size(var::MAX_MEM)?,
            child_mem: parsed(var::CHILD_MEM, text(var::CHILD_MEM)?, |v| {
                if v.trim() == "unlimited" {
                    Ok(CHILD_MEM_UNLIMITED)
                } else {
                    parse_size(v)
                }
            })?,
            threshold: size(var::THRESHOLD)?,
            low_latency: get(var::LOW_LATENCY).is_some_and(|v| v != "0"),
            spill_dir: get(var::SPILL_DIR).map(Into::into),
            samples: parsed(var::SAMPLES, text(var::SAMPLES)?, |v| {
                v.parse::<usize>().map_err(|_| "not a number")
            })?,
            report: get(var::REPORT).map(Into::into),
            required: get(var::REQUIRED).is_some(),
            tls: get(var::TLS).map(Into::into),
            insecure: get(var::INSECURE).is_some_and(|v| v != "0"),
            compress_link_mbps: parsed(
                var::COMPRESS_LINK_MBPS,
                text(var::COMPRESS_LINK_MBPS)?,
                |v| v.parse::<u32>().map_err(|_| "not a number of Mbit/s"),
            )?
            .unwrap_or(0),
        })
    }

    /// The variables that say this, for a program `netram run` starts.
    pub fn to_vars(&self) -> Vec<(&'static str, OsString)> {
        let mut vars: Vec<(&'static str, OsString)> = Vec::new();
        let mut set = |name, v: OsString| vars.push((name, v));
        if let Some(m) = self.local_mem {
            set(var::LOCAL_MEM, m.to_string().into());
        }
        if !self.servers.is_empty() {
            set(var::SERVERS, self.servers.join(",").into());
        }
        if let Some(b) = self.backing {
            set(var::BACKING, b.to_string().into());
        }
        if let Some(r) = self.redundancy {
            set(var::REDUNDANCY, r.to_string().into());
        }
        if let Some(m) = self.max_mem {
            set(var::MAX_MEM, m.to_string().into());
        }
        if let Some(m) = self.child_mem {
            let v = if m == CHILD_MEM_UNLIMITED {
                "unlimited".to_string()
            } else {
                m.to_string()
            };
            set(var::CHILD_MEM, v.into());
        }
        if let Some(t) = self.threshold {
            set(var::THRESHOLD, t.to_string().into());
        }
        if self.low_latency {
            set(var::LOW_LATENCY, "1".into());
        }
        if let Some(d) = &self.spill_dir {
            set(var::SPILL_DIR, d.clone().into());
        }
        if let Some(s) = self.samples {
            set(var::SAMPLES, s.to_string().into());
        }
        if let Some(d) = &self.report {
            set(var::REPORT, d.clone().into());
        }
        if self.required {
            set(var::REQUIRED, "1".into());
        }
        if let Some(d) = &self.tls {
            set(var::TLS, d.clone().into());
        }
        if self.insecure {
            set(var::INSECURE, "1".into());
        }
        if self.compress_link_mbps > 0 {
            set(
                var::COMPRESS_LINK_MBPS,
                self.compress_link_mbps.to_string().into(),
            );
        }
        vars
    }
}

/// A set variable's value through `f`; a refusal names the variable and says why.
fn parsed<T, E: std::fmt::Display>(
    name: &'static str,
    v: Option<String>,
    f: impl Fn(&str) -> Result<T, E>,
) -> Result<Option<T>, EnvError> {
    v.map(|v| {
        f(v.trim()).map_err(|why| EnvError {
            name,
            why: why.to_string(),
            value: v,
        })
    })
    .transpose()
}

/// A size as users write it: `4096`, `64K`, `256M`, `1G` (binary multiples).
pub fn parse_size(s: &str) -> Result<u64, String> {
    parse_size::Config::new()
        .with_binary()
        .parse_size(s.trim())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(vars: &[(&str, &str)]) -> Result<RunEnv, EnvError> {
        let map: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        RunEnv::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn what_run_writes_the_library_reads_back() {
        let env = RunEnv {
            local_mem: Some(64 << 20),
            servers: vec!["127.0.0.1:7000".into(), "127.0.0.1:7001".into()],
            backing: Some(Backing::ClusterDisk),
            redundancy: Some(Scheme::ReedSolomon { data: 2, parity: 1 }),
            max_mem: Some(1 << 30),
            child_mem: Some(32 << 20),
            threshold: Some(128 << 10),
            low_latency: true,
            spill_dir: Some("/var/tmp".into()),
            samples: Some(4),
            report: Some("/tmp/reports".into()),
            required: true,
            tls: Some("/etc/netram".into()),
            insecure: true,
            compress_link_mbps: 100,
        };
        let map: HashMap<&str, OsString> = env.to_vars().into_iter().collect();
        assert_eq!(map.len(), 15, "every field has its variable");
        assert_eq!(RunEnv::from_vars(|k| map.get(k).cloned()).unwrap(), env);
        let unlimited = RunEnv {
            child_mem: Some(CHILD_MEM_UNLIMITED),
            ..RunEnv::default()
        };
        let map: HashMap<&str, OsString> = unlimited.to_vars().into_iter().collect();
        assert_eq!(map[var::CHILD_MEM], "unlimited");
        assert_eq!(
            RunEnv::from_vars(|k| map.get(k).cloned()).unwrap(),
            unlimited
        );
        assert_eq!(RunEnv::from_vars(|_| None).unwrap(), RunEnv::default());
    }

    #[test]
    fn sizes_lists_and_switches_as_users_write_them() {
        let env = read(&[
            (var::LOCAL_MEM, " 256M "),
            (var::SERVERS, "a:1, b:2,,"),
            (var::LOW_LATENCY, "0"),
            (var::THRESHOLD, "128K"),
        ])
        .unwrap();
        assert_eq!(env.local_mem, Some(256 << 20));
        assert_eq!(env.threshold, Some(128 << 10));
        assert_eq!(env.servers, ["a:1", "b:2"]);
        assert!(!env.low_latency, "0 turns the mode off");
    }

    #[test]
    fn a_bad_value_names_its_variable() {
        for (name, value) in [
            (var::LOCAL_MEM, "lots"),
            (var::BACKING, "tape"),
            (var::REDUNDANCY, "mirror:0"),
            (var::SAMPLES, "some"),
        ] {
            let e = read(&[(name, value)]).unwrap_err();
            assert_eq!((e.name, e.value.as_str()), (name, value));
            assert!(
                e.to_string().starts_with(&format!("{name}={value}: ")),
                "{e}"
            );
        }
    }
}
