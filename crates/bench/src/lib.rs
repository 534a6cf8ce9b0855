//! netram's benchmarks, and the pieces the demo shares with them: an embedded local cluster
//! ([`cluster`]), latency summaries ([`Summary`]) and a description of the machine a result came
//! from ([`machine`]).
//!
//! Benchmarks report ratios to baselines measured side by side in the same run (the raw loopback
//! round trip, first of all), because these machines are shared and noisy: an absolute figure
//! from one run says little, a ratio from one run says what netram costs.

pub mod cluster;
pub mod core;
pub mod machine;
pub mod raw;

use serde::Serialize;

/// Percentiles of a set of latency samples, in microseconds.
#[derive(Debug, Clone, Copy, Serialize, Default)]
pub struct Summary {
    pub samples: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
}

impl Summary {
    pub fn of_ns(samples: &mut [u64]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_unstable();
        let at =
            |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0;
        let mean = samples.iter().sum::<u64>() as f64 / samples.len() as f64 / 1000.0;
        Self {
            samples: samples.len(),
            p50_us: at(0.50),
            p99_us: at(0.99),
            mean_us: mean,
        }
    }
}

/// Deterministic page contents, so a reader can verify a page without keeping a copy.
pub fn page_content(seed: u64, page: u64, out: &mut [u8]) {
    let mut rng = fastrand::Rng::with_seed(seed ^ page.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    for chunk in out.chunks_exact_mut(8) {
        chunk.copy_from_slice(&rng.u64(..).to_le_bytes());
    }
}
