//! Membership packets (`netram_member`): whatever bytes arrive on a daemon's UDP port, the
//! envelope decodes to an error or to parts that lie inside the packet, and a SWIM message
//! from an authenticated sender, whatever it says, never panics the membership, never removes
//! this node from its own view nor changes its id or address (a newer boot is SWIM's way of
//! refuting its own death), and never makes it send more than a bounded number of packets in
//! reply.
#![no_main]

use libfuzzer_sys::fuzz_target;
use netram_member::{envelope, Announce, MemberConfig, Membership, Node};
use std::net::SocketAddr;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = envelope::decode(data) {
        assert!(p.swim.len() <= data.len());
        // A GMS epoch message's bytes go to its own decoder, which is fuzzed with the others
        // (`decode.rs`); here only that they lie inside the packet.
        if let Some(s) = &p.signature {
            assert!(s.signed.len() <= data.len() && s.cert.len() <= data.len());
        }
    }
    let me = Node {
        id: 1,
        addr: SocketAddr::from(([127, 0, 0, 1], 7077)),
        boot: 1,
    };
    let mut m = Membership::new(me, 7, MemberConfig::default(), 0);
    m.join(&[SocketAddr::from(([127, 0, 0, 1], 7078))]);
    // The bytes as a run of SWIM messages, each from sender 2 (as the signature proved).
    let mut now = 0;
    for chunk in data.split(|&b| b == 0xfe) {
        now += 250;
        let _ = m.on_packet(now, Some(2), Announce::default(), chunk);
        m.on_tick(now);
        assert!(m.take_sends().len() <= 64);
    }
    m.on_tick(now + 60_000);
    // This node is still itself: a sender that says it is down makes it rejoin under a newer
    // boot (SWIM's refutation by renewal), never under another id or address.
    let now_me = m.members()[0].node;
    assert_eq!((now_me.id, now_me.addr), (me.id, me.addr));
    assert!(now_me.boot >= me.boot);
    let _ = m.take_events();
});
