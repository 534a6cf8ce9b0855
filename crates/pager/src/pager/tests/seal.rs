//! Pages sealed end to end (`seal.rs`): servers hold only ciphertext under every scheme, what
//! a scheme rebuilds authenticates, and a server that replays an old version or hands back
//! another page is caught.

use super::*;

/// A sealed pager under `scheme` on six servers, compressing by `compress`, with `plain`'s
/// pages written and flushed (no cache: every page is on the servers).
fn written_out(
    scheme: &str,
    compress: Option<netram_proto::compress::Rule>,
    plain: &[Vec<u8>],
) -> Pager<MemCluster, MemDisk> {
    let mut p = Pager::new(
        PagerConfig {
            pages: plain.len() as u64,
            cache_pages: 0,
            writeback_batch: 4,
            redundancy: scheme.parse().unwrap(),
            compress,
            ..sealed()
        },
        MemCluster::new(&[256; 6]),
        MemDisk::default(),
    );
    for (pg, d) in plain.iter().enumerate() {
        p.write(pg as u64, d).unwrap();
    }
    p.flush().unwrap();
    p
}

/// The pages' plaintext never reaches a server, under any scheme; everything reads back,
/// also after a server dies and its pages are rebuilt from the others (mirror, parity,
/// Reed-Solomon operate on ciphertext).
#[test]
fn servers_hold_only_ciphertext_and_rebuilt_pages_authenticate() {
    for scheme in ["none", "mirror:2", "parity:4", "rs:4+2"] {
        let plain: Vec<Vec<u8>> = (0..48).map(|pg| content(pg, 9)).collect();
        let mut p = written_out(scheme, None, &plain);
        let mut frames = 0;
        for s in &p.transport().servers {
            for key in s.store.session_keys(s.session) {
                let stored = s.store.peek(s.session, key).unwrap();
                frames += 1;
                for d in &plain {
                    assert!(
                        !stored.data.windows(64).any(|w| w == &d[..64]),
                        "{scheme}: a server holds plaintext under {key:?}"
                    );
                }
            }
        }
        assert!(frames >= 48, "{scheme}: {frames} frames stored");
        reads_back(&mut p, 48, 9);
        if scheme != "none" {
            p.transport_mut().servers[0].dead = true;
            p.probe_servers().unwrap();
            recover_all(&mut p);
            reads_back(&mut p, 48, 9);
        }
        assert_eq!(p.counters().page_auth_failures, 0, "{scheme}");
        p.check_invariants().unwrap();
    }
}

/// A server that answers with an old version of a page (relabelled as the current one), or
/// with another page's data under this page's key, passes its crc32c (it recomputes it) and
/// fails authentication: the read is refused, never returned.
#[test]
fn a_server_replaying_an_old_version_or_another_page_is_caught() {
    let mut p = pager(MemCluster::new(&[16]), 4, 0, Backing::Cluster);
    p.write(0, &content(0, 1)).unwrap();
    p.write(1, &content(1, 1)).unwrap();
    let key0 = PageKey::new(0, 0);
    let key1 = PageKey::new(0, 1);
    let old = {
        let s = &p.transport().servers[0];
        s.store.peek(s.session, key0).unwrap().data.to_vec()
    };
    p.write(0, &content(0, 2)).unwrap();
    let version = p.location(0).unwrap().version;
    let other = {
        let s = &p.transport().servers[0];
        s.store.peek(s.session, key1).unwrap().data.to_vec()
    };
    for (what, data) in [("an old version", &old), ("another page", &other)] {
        let s = &mut p.transport_mut().servers[0];
        let flags = netram_proto::PageFlags::default();
        let crc = netram_proto::page_checksum(key0, version, flags, data);
        let st = s.store.put(s.session, key0, version, crc, flags, data, 0);
        assert_eq!(st, Ok(netram_proto::PutStatus::Stored));
        let before = p.counters().page_auth_failures;
        assert!(
            matches!(read(&mut p, 0), Err(PagerError::Corrupt { page: 0, .. })),
            "{what} is refused"
        );
        assert_eq!(p.counters().page_auth_failures, before + 1, "{what}");
        assert_eq!(
            p.counters().checksum_failures,
            0,
            "{what}: its crc32c passed"
        );
    }
    assert_eq!(
        read(&mut p, 1).unwrap(),
        content(1, 1),
        "page 1 is untouched"
    );
}

/// A 100 Mbit/s link and a codec of 3 µs a page: a page must shrink by 38 bytes to be sent
/// compressed.
const SLOW_LINK: netram_proto::compress::Rule = netram_proto::compress::Rule {
    link_bytes_per_us: 12.5,
    codec_us: 3.0,
};

/// Page `pg` of round `r`: odd pages random (LZ4 cannot shrink them), even pages MIRAGE+'s
/// UptoN 512 (512 random bytes, then zeros), every fourth of those all zeros.
fn mixed(pg: u64, r: u8) -> Vec<u8> {
    let mut x = (pg + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(r) | 1;
    let mut d = vec![0u8; PAGE_SIZE];
    let n = match pg % 4 {
        0 => 0,
        2 => 512,
        _ => PAGE_SIZE,
    };
    for b in &mut d[..n] {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    d
}

/// Compressed before it is sealed: under every scheme, a page LZ4 shrinks reaches its server
/// as the ciphertext of its block (the frame's data, trimmed of zeros, is that short), one it
/// cannot shrink goes whole, no plaintext reaches a server, and everything reads back, also
/// after a server dies and its pages are rebuilt from ciphertext slots.
#[test]
fn compressed_pages_travel_short_under_every_scheme_and_come_back_whole() {
    for scheme in ["none", "mirror:2", "parity:4", "rs:4+2"] {
        let plain: Vec<Vec<u8>> = (0..48).map(|pg| mixed(pg, 3)).collect();
        let mut p = written_out(scheme, Some(SLOW_LINK), &plain);
        let c = p.counters().clone();
        assert_eq!(
            (c.pages_compressed, c.pages_compress_aborted),
            (24, 24),
            "{scheme}: even pages compressed, odd ones not"
        );
        assert!(c.bytes_saved_compressing > 24 * 3000, "{scheme}: {c:?}");
        for s in &p.transport().servers {
            for key in s.store.session_keys(s.session) {
                let stored = s.store.peek(s.session, key).unwrap();
                for d in plain.iter().filter(|d| d[0] != 0) {
                    assert!(
                        !stored.data.windows(64).any(|w| w == &d[..64]),
                        "{scheme}: a server holds plaintext under {key:?}"
                    );
                }
                // Under `none` and `mirror:2` a page's key holds that page.
                if matches!(scheme, "none" | "mirror:2") {
                    let len = stored.data.len();
                    match key.page % 4 {
                        0 => assert!(len < 64, "{scheme}: zero page {key:?}: {len} bytes"),
                        2 => assert!((512..600).contains(&len), "{scheme}: {key:?}: {len}"),
                        _ => assert!(len > PAGE_SIZE - 64, "{scheme}: {key:?}: {len}"),
                    }
                }
            }
        }
        for pg in 0..48 {
            assert_eq!(
                read(&mut p, pg).unwrap(),
                plain[pg as usize],
                "{scheme}: {pg}"
            );
        }
        if scheme != "none" {
            p.transport_mut().servers[0].dead = true;
            p.probe_servers().unwrap();
            recover_all(&mut p);
            for pg in 0..48 {
                assert_eq!(
                    read(&mut p, pg).unwrap(),
                    plain[pg as usize],
                    "{scheme}: {pg}"
                );
            }
        }
        assert_eq!(p.counters().page_auth_failures, 0, "{scheme}");
        p.check_invariants().unwrap();
    }
}

/// A server that changes a compressed page is caught as for a whole one: its block cut
/// short, a byte of it flipped, or the block of another version put in its place all fail
/// authentication (the block's length is the pager's, and in the associated data). Bytes a
/// server adds after the block change nothing that is read: the page that comes back is the
/// one that was sealed.
#[test]
fn a_server_that_changes_a_compressed_page_is_caught() {
    let mut p = Pager::new(
        PagerConfig {
            pages: 4,
            cache_pages: 0,
            compress: Some(SLOW_LINK),
            ..sealed()
        },
        MemCluster::new(&[16]),
        MemDisk::default(),
    );
    let key = PageKey::new(0, 2);
    p.write(2, &mixed(2, 1)).unwrap();
    let old = {
        let s = &p.transport().servers[0];
        s.store.peek(s.session, key).unwrap().data.to_vec()
    };
    p.write(2, &mixed(2, 2)).unwrap();
    let version = p.location(2).unwrap().version;
    let good = {
        let s = &p.transport().servers[0];
        s.store.peek(s.session, key).unwrap().data.to_vec()
    };
    assert!(good.len() < 600);
    let mut flipped = good.clone();
    flipped[100] ^= 1;
    let mut padded = good.clone();
    padded.extend_from_slice(&[0xaa; 64]);
    let cases: [(&str, &[u8], bool); 4] = [
        ("cut short", &good[..good.len() - 1], false),
        ("a flipped byte", &flipped, false),
        ("an old version's block", &old, false),
        ("bytes after the block", &padded, true),
    ];
    for (what, data, reads) in cases {
        let s = &mut p.transport_mut().servers[0];
        let flags = netram_proto::PageFlags::default();
        let crc = netram_proto::page_checksum(key, version, flags, data);
        let st = s.store.put(s.session, key, version, crc, flags, data, 0);
        assert_eq!(st, Ok(netram_proto::PutStatus::Stored));
        let before = p.counters().page_auth_failures;
        if reads {
            assert_eq!(read(&mut p, 2).unwrap(), mixed(2, 2), "{what}");
            assert_eq!(p.counters().page_auth_failures, before, "{what}");
        } else {
            assert!(
                matches!(read(&mut p, 2), Err(PagerError::Corrupt { page: 2, .. })),
                "{what} is refused"
            );
            assert_eq!(p.counters().page_auth_failures, before + 1, "{what}");
        }
    }
}

/// The compression rule is set before the first write-back or not at all: a page may be
/// sealed again at the same version, under the same nonce, and must then be the same
/// plaintext.
#[test]
fn the_compression_rule_is_fixed_once_a_page_was_sealed() {
    let mut p = pager(MemCluster::new(&[16]), 4, 0, Backing::Cluster);
    assert!(p.set_compression(Some(SLOW_LINK)));
    assert!(p.set_compression(None), "nothing sealed yet");
    assert!(p.set_compression(Some(SLOW_LINK)));
    p.write(2, &mixed(2, 1)).unwrap();
    assert_eq!(p.counters().pages_compressed, 1);
    assert!(!p.set_compression(None));
    assert_eq!(p.config().compress, Some(SLOW_LINK));
    p.write(2, &mixed(2, 2)).unwrap();
    assert_eq!(p.counters().pages_compressed, 2);
    assert_eq!(read(&mut p, 2).unwrap(), mixed(2, 2));
    let mut clear = unsealed(pager(MemCluster::new(&[16]), 4, 0, Backing::Cluster));
    assert!(
        !clear.set_compression(Some(SLOW_LINK)),
        "nothing is sealed: nothing to compress"
    );
}
