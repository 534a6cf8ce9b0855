//! The sealed records after a TLS handshake (`netram_net::record`): whatever bytes a peer
//! sends, opening them returns a frame or an error, never panics, and a record opens only if
//! it is exactly what the other end sealed — any change to any byte of it (its length, its
//! body, its tag) is refused, and a record that opens yields exactly the frame sealed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use netram_net::record::{record_len, reserve_tags, RecordKey, KEY_LEN};
use netram_proto::frame_len;

const KEY: [u8; KEY_LEN] = [7; KEY_LEN];

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode & 1 == 0 {
        // Hostile bytes as a stream of records.
        let mut buf = rest.to_vec();
        let mut key = RecordKey::new(&KEY);
        let mut at = 0;
        while let Ok(Some(n)) = record_len(&buf[at..]) {
            if at + n > buf.len() {
                break;
            }
            match key.open(&mut buf[at..at + n]) {
                Ok((f, tail)) => {
                    assert!(f <= n && tail < f);
                    let _ = netram_proto::decode_reply(&buf[at..at + f]);
                }
                Err(_) => break,
            }
            at += n;
        }
        return;
    }
    // A frame sealed here, one byte of the record changed (or none): it opens if and only if
    // nothing changed, and then to exactly the frame.
    let [a, b, flip, ref frame @ ..] = *rest else {
        return;
    };
    let Ok(Some(len)) = frame_len(frame) else {
        return;
    };
    let frame = &frame[..len.min(frame.len())];
    if frame.len() != len {
        return;
    }
    let mut rec = frame.to_vec();
    reserve_tags(&mut rec, 0);
    RecordKey::new(&KEY).seal_all(&mut rec);
    let at = usize::from(u16::from_le_bytes([a, b])) % rec.len();
    rec[at] ^= flip;
    let opened = RecordKey::new(&KEY).open(&mut rec);
    if flip == 0 {
        let (n, tail) = opened.expect("an untouched record opens");
        assert_eq!(tail, 0);
        assert_eq!(&rec[..n], frame, "to the very frame sealed");
    } else {
        assert!(opened.is_err(), "a changed byte ({at}) must not open");
    }
});
