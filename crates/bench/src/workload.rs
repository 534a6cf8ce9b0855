//! The workload programs that benchmarks, tests and the demo run as ordinary processes that know
//! nothing of netram: whatever memory they use, swap or netram supplies underneath.
//!
//! * `touch SIZE SEED`: fills SIZE bytes page by page in a random order, reads every page back
//!   in another random order and verifies it.
//! * `random SIZE SEED SECONDS [OPS]`: fills SIZE bytes, then does random 4 KiB
//!   read-modify-writes (add 1 to a random word of a random page) for SECONDS (or until OPS
//!   operations, rounded up to 1,024, are done), then verifies every page: a page's
//!   words must differ from their initial contents by exactly the number of increments it got.
//!   Nswap's and Markatos' random-access workloads, and MACHINE-NOTES' baseline.
//! * `qsort SIZE SEED`: quicksorts SIZE bytes of random 64-bit integers (Anemone's Table 1
//!   workload; Rust's unstable sort is a pattern-defeating quicksort) and checks the result is
//!   sorted and holds the same integers (sum and xor).
//!
//! Each prints one line of `key=value` figures and exits 0 only if its data verified.

use std::time::{Duration, Instant};

const PAGE: usize = 4096;
const WORDS: usize = PAGE / 8;

/// xorshift64: fast, deterministic, and needs no state but a word.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn fill(seed: u64, page: usize, out: &mut [u8]) {
    let mut x = seed ^ (page as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in out.chunks_exact_mut(8) {
        chunk.copy_from_slice(&next(&mut x).to_le_bytes());
    }
}

fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..n).rev() {
        order.swap(i, (next(&mut x) % (i as u64 + 1)) as usize);
    }
    order
}

fn touch(size: usize, seed: u64) -> Result<String, String> {
    let pages = size / PAGE;
    let mut mem = vec![0u8; pages * PAGE];
    for &p in &shuffled(pages, seed) {
        fill(seed, p, &mut mem[p * PAGE..(p + 1) * PAGE]);
    }
    let mut want = vec![0u8; PAGE];
    let bad = shuffled(pages, seed ^ 0x5555)
        .into_iter()
        .filter(|&p| {
            fill(seed, p, &mut want);
            mem[p * PAGE..(p + 1) * PAGE] != want[..]
        })
        .count();
    if bad > 0 {
        return Err(format!("{bad} of {pages} pages came back wrong"));
    }
    Ok(format!("{pages} pages written and verified"))
}

fn random(size: usize, seed: u64, run_for: Duration, max_ops: u64) -> Result<String, String> {
    let pages = size / PAGE;
    if pages == 0 {
        return Err("SIZE is below one page".into());
    }
    let started = Instant::now();
    let mut mem = vec![0u64; pages * WORDS];
    let mut init = vec![0u8; PAGE];
    for p in 0..pages {
        fill(seed, p, &mut init);
        for (w, chunk) in init.chunks_exact(8).enumerate() {
            mem[p * WORDS + w] = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        }
    }
    let fill_s = started.elapsed().as_secs_f64();
    // Increments per page: 4 bytes a page, a thousandth of the working set.
    let mut counts = vec![0u32; pages];
    let mut x = seed | 1;
    let mut ops: u64 = 0;
    let t0 = Instant::now();
    loop {
        // The clock is read once per 1,024 operations: each costs ~20 ns, an operation in
        // local memory ~60 ns.
        for _ in 0..1024 {
            let r = next(&mut x);
            let p = (r % pages as u64) as usize;
            let w = ((r >> 40) % WORDS as u64) as usize;
            mem[p * WORDS + w] = mem[p * WORDS + w].wrapping_add(1);
            counts[p] = counts[p].wrapping_add(1);
        }
        ops += 1024;
        if ops >= max_ops || t0.elapsed() >= run_for {
            break;
        }
    }
    let run_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut bad = 0usize;
    for p in 0..pages {
        fill(seed, p, &mut init);
        let mut diff: u64 = 0;
        for (w, chunk) in init.chunks_exact(8).enumerate() {
            let was = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
            diff = diff.wrapping_add(mem[p * WORDS + w].wrapping_sub(was));
        }
        if diff != u64::from(counts[p]) {
            bad += 1;
        }
    }
    if bad > 0 {
        return Err(format!("{bad} of {pages} pages came back wrong"));
    }
    Ok(format!(
        "random pages={pages} ops={ops} seconds={run_s:.3} us_per_op={:.4} fill_seconds={fill_s:.3} verify_seconds={:.3} total_seconds={:.3} verified=yes",
        run_s * 1e6 / ops as f64,
        t1.elapsed().as_secs_f64(),
        started.elapsed().as_secs_f64()
    ))
}

fn qsort(size: usize, seed: u64) -> Result<String, String> {
    let n = size / 8;
    let started = Instant::now();
    let mut x = seed | 1;
    let mut v: Vec<u64> = (0..n).map(|_| next(&mut x)).collect();
    let (sum, xor) = v
        .iter()
        .fold((0u64, 0u64), |(s, x), &e| (s.wrapping_add(e), x ^ e));
    let fill_s = started.elapsed().as_secs_f64();
    let t0 = Instant::now();
    v.sort_unstable();
    let sort_s = t0.elapsed().as_secs_f64();
    let sorted = v.windows(2).all(|w| w[0] <= w[1]);
    let (s2, x2) = v
        .iter()
        .fold((0u64, 0u64), |(s, x), &e| (s.wrapping_add(e), x ^ e));
    if !sorted || (s2, x2) != (sum, xor) {
        return Err(format!(
            "the sort came back wrong (sorted: {sorted}, same integers: {})",
            (s2, x2) == (sum, xor)
        ));
    }
    Ok(format!(
        "qsort integers={n} seconds={sort_s:.3} fill_seconds={fill_s:.3} total_seconds={:.3} verified=yes",
        started.elapsed().as_secs_f64()
    ))
}

const USAGE: &str = "usage: netram-workload touch SIZE_BYTES SEED\n       \
                     netram-workload random SIZE_BYTES SEED SECONDS [OPS]\n       \
                     netram-workload qsort SIZE_BYTES SEED";

/// Runs the workload the arguments (without the program name) name; the line to print, or why
/// it failed. Usage errors start with "usage".
pub fn run(args: &[String]) -> Result<String, String> {
    let num = |i: usize, what: &str| -> Result<u64, String> {
        args.get(i)
            .ok_or_else(|| USAGE.to_string())?
            .parse::<u64>()
            .map_err(|_| format!("usage: {what} must be a number\n{USAGE}"))
    };
    match args.first().map(String::as_str) {
        Some("touch") => touch(num(1, "SIZE_BYTES")? as usize, num(2, "SEED")?),
        Some("random") => random(
            num(1, "SIZE_BYTES")? as usize,
            num(2, "SEED")?,
            Duration::from_secs(num(3, "SECONDS")?),
            if args.len() > 4 {
                num(4, "OPS")?
            } else {
                u64::MAX
            },
        ),
        Some("qsort") => qsort(num(1, "SIZE_BYTES")? as usize, num(2, "SEED")?),
        _ => Err(USAGE.to_string()),
    }
}

/// `key=value` figures of a workload's output line.
pub fn figure(line: &str, key: &str) -> Option<f64> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn workloads_verify_their_data() {
        assert!(run(&args("touch 1048576 7")).unwrap().contains("256 pages"));
        let line = run(&args("random 1048576 7 0")).unwrap();
        assert!(figure(&line, "ops").unwrap() >= 1024.0, "{line}");
        assert!(figure(&line, "us_per_op").unwrap() > 0.0, "{line}");
        let line = run(&args("qsort 1048576 7")).unwrap();
        assert_eq!(figure(&line, "integers"), Some(131072.0));
        assert!(run(&args("random 10 7 1")).is_err());
        let line = run(&args("random 1048576 7 60 3000")).unwrap();
        assert_eq!(figure(&line, "ops"), Some(3072.0), "{line}");
        assert!(run(&args("qsort x 7")).unwrap_err().starts_with("usage"));
        assert!(run(&args("dance")).unwrap_err().starts_with("usage"));
    }
}
