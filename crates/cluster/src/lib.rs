//! An embedded local cluster: page servers on loopback ports, in this process. Used by
//! `netram demo`, the benchmarks and the tests of the front ends (`netram-uffd`, `netram-capi`);
//! the multi-process tests start real `netram serve` processes instead. Not part of the daemon
//! nor of any client library: nothing but those links it.

use netram_server::{Server, ServerConfig, ServerError};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug)]
pub struct LocalCluster {
    servers: Vec<Server>,
}

impl LocalCluster {
    /// Starts `n` servers of `capacity_bytes` each on ephemeral loopback ports.
    pub fn start(n: usize, capacity_bytes: u64, low_latency: bool) -> Result<Self, ServerError> {
        let servers = (0..n)
            .map(|i| {
                let cfg = ServerConfig {
                    listen: "127.0.0.1:0".parse().expect("loopback address"),
                    capacity_bytes,
                    lease_period: Duration::from_secs(2),
                    low_latency,
                    node: i as u64 + 1,
                    ..Default::default()
                };
                Server::start(cfg, Arc::new(AtomicBool::new(false)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { servers })
    }

    pub fn addrs(&self) -> Vec<String> {
        self.servers.iter().map(|s| s.addr().to_string()).collect()
    }

    pub fn stat(&self, server: usize, name: &str) -> u64 {
        self.servers[server]
            .stats()
            .into_iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v)
            .unwrap_or(0)
    }

    /// Stops every server and waits for their threads.
    pub fn stop(self) {
        for s in self.servers {
            s.stop();
        }
    }
}
