//! A bundled workload program for tests and demos: an ordinary process that knows nothing of
//! netram. `touch SIZE SEED` fills SIZE bytes of its own memory page by page in a random order
//! with content derived from SEED and the page number, then reads every page back in another
//! random order and verifies it; exit status 0 only if every page is intact. Under a memory
//! cgroup smaller than SIZE, most of its pages go through the swap device and back.

use std::process::ExitCode;

const PAGE: usize = 4096;

fn fill(seed: u64, page: usize, out: &mut [u8]) {
    let mut x = seed ^ (page as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in out.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
}

fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    order
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(cmd), Some(size), Some(seed)) = (args.get(1), args.get(2), args.get(3)) else {
        eprintln!("usage: netram-workload touch SIZE_BYTES SEED");
        return ExitCode::from(2);
    };
    let (Ok(size), Ok(seed)) = (size.parse::<usize>(), seed.parse::<u64>()) else {
        eprintln!("SIZE_BYTES and SEED must be numbers");
        return ExitCode::from(2);
    };
    if cmd != "touch" {
        eprintln!("unknown command {cmd:?}");
        return ExitCode::from(2);
    }
    let pages = size / PAGE;
    let mut mem = vec![0u8; pages * PAGE];
    for &p in &shuffled(pages, seed) {
        fill(seed, p, &mut mem[p * PAGE..(p + 1) * PAGE]);
    }
    let mut want = vec![0u8; PAGE];
    let mut bad = 0usize;
    for &p in &shuffled(pages, seed ^ 0x5555) {
        fill(seed, p, &mut want);
        if mem[p * PAGE..(p + 1) * PAGE] != want[..] {
            bad += 1;
        }
    }
    if bad > 0 {
        eprintln!("{bad} of {pages} pages came back wrong");
        return ExitCode::from(1);
    }
    println!("{pages} pages written and verified");
    ExitCode::SUCCESS
}
