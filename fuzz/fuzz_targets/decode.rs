//! Every decoder of untrusted bytes (GMS's and DSM's too, and the page decompressor): it must return a value or an error, never
//! panic, and a request it accepts must encode back to exactly the same bytes (the encoding is
//! canonical, so nothing a peer sends is silently reinterpreted).
#![no_main]

use libfuzzer_sys::fuzz_target;
use netram_proto::{decode_reply, decode_request, frame_len, Hello, Welcome};

fuzz_target!(|data: &[u8]| {
    let _ = Hello::decode(data);
    let _ = Welcome::decode(data);
    let _ = decode_reply(data);
    if let Ok(Some(len)) = frame_len(data) {
        assert!(len >= netram_proto::FRAME_HEADER_LEN && len <= netram_proto::MAX_FRAME_LEN);
    }
    let _ = netram_proto::gms::decode_reply(data);
    if let Ok((id, req)) = netram_proto::gms::decode_request(data) {
        let mut again = Vec::new();
        req.encode(id, &mut again);
        assert_eq!(
            again, data,
            "a decoded GMS request re-encodes to the same bytes"
        );
    }
    // A compressed page from a peer: a page or an error.
    let mut page = vec![0u8; netram_proto::PAGE_SIZE];
    let _ = netram_proto::compress::unpack(data, &mut page);
    if let Ok(m) = netram_proto::dsm::decode(data) {
        let mut again = Vec::new();
        m.encode(&mut again);
        assert_eq!(
            again, data,
            "a decoded DSM message re-encodes to the same bytes"
        );
    }
    if let Ok((id, req)) = decode_request(data) {
        let mut again = Vec::new();
        req.encode(id, &mut again);
        assert_eq!(
            again, data,
            "a decoded request re-encodes to the same bytes"
        );
    }
});
