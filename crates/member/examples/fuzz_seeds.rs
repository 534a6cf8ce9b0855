//! Writes starting inputs for the `membership` fuzz target (`fuzz/seeds/membership/`): real
//! SWIM messages of a small cluster's first seconds, joined the way the target splits them
//! (0xfe between messages), and whole envelopes, so that libFuzzer starts from packets that
//! decode instead of finding postcard's shapes by chance.
//!
//! `cargo run -p netram-member --example fuzz_seeds -- fuzz/seeds/membership`

use netram_member::envelope::{encode_body, encode_cert, encode_gms_body, encode_signature};
use netram_member::{Announce, MemberConfig, Membership, Node};
use std::net::SocketAddr;

fn main() -> std::io::Result<()> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "fuzz/seeds/membership".into());
    std::fs::create_dir_all(&dir)?;
    let addr = |i: u8| SocketAddr::from(([127, 0, 0, 1], 7077 + u16::from(i)));
    let mut nodes: Vec<Membership> = (0..3u8)
        .map(|i| {
            let me = Node {
                id: u64::from(i) + 2,
                addr: addr(i + 1),
                boot: 1,
            };
            let mut m = Membership::new(me, u64::from(i), MemberConfig::default(), 0);
            m.join(&[addr(0), addr(1)]);
            m
        })
        .collect();
    let mut seen: Vec<Vec<u8>> = Vec::new();
    for step in 0..60u64 {
        let now = step * 100;
        let mut flight = Vec::new();
        for (i, m) in nodes.iter_mut().enumerate() {
            m.on_tick(now);
            for (to, bytes) in m.take_sends() {
                flight.push((i, to, bytes));
            }
        }
        for (from, to, bytes) in flight {
            if let Some(j) = (0..nodes.len()).find(|&j| addr(j as u8 + 1) == to) {
                let sender = nodes[from].me().id;
                let _ = nodes[j].on_packet(now, Some(sender), Announce::default(), &bytes);
            }
            seen.push(bytes);
        }
    }
    // Messages one by one, and runs of them as the target splits its input.
    let mut n = 0;
    for (i, chunk) in seen.chunks(4).enumerate().take(24) {
        std::fs::write(format!("{dir}/swim-{i:02}"), &chunk[0])?;
        std::fs::write(format!("{dir}/run-{i:02}"), chunk.join(&0xfe_u8))?;
        n += 2;
    }
    // Whole envelopes, clear and signed-shaped.
    for (i, swim) in seen.iter().take(4).enumerate() {
        let a = Announce {
            seq: 3,
            offered_pages: 1 << 16,
            free_pages: 1 << 15,
            requests_per_s: 10,
        };
        let mut p = Vec::new();
        encode_body(&mut p, 1_700_000_000_000, &a, swim, i % 2 == 1);
        if i % 2 == 1 {
            encode_cert(&mut p, &[0x30; 64]);
            encode_signature(&mut p, 0x0403, &[7; 70]);
        }
        std::fs::write(format!("{dir}/envelope-{i}"), &p)?;
        n += 1;
    }
    // An envelope carrying a GMS epoch message's bytes (flag GMS, a sender) instead of SWIM.
    let mut p = Vec::new();
    let frame = [
        0x0e, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    encode_gms_body(
        &mut p,
        1_700_000_000_000,
        &Announce::default(),
        2,
        &frame,
        false,
    );
    std::fs::write(format!("{dir}/envelope-gms"), &p)?;
    n += 1;
    println!("wrote {n} seeds to {dir}");
    Ok(())
}
