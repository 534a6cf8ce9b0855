//! Pages sealed end to end (`seal.rs`): servers hold only ciphertext under every scheme, what
//! a scheme rebuilds authenticates, and a server that replays an old version or hands back
//! another page is caught.

use super::*;

/// The pages' plaintext never reaches a server, under any scheme; everything reads back,
/// also after a server dies and its pages are rebuilt from the others (mirror, parity,
/// Reed-Solomon operate on ciphertext).
#[test]
fn servers_hold_only_ciphertext_and_rebuilt_pages_authenticate() {
    for scheme in ["none", "mirror:2", "parity:4", "rs:4+2"] {
        let mut p = Pager::new(
            PagerConfig {
                pages: 48,
                cache_pages: 0,
                writeback_batch: 4,
                redundancy: scheme.parse().unwrap(),
                ..sealed()
            },
            MemCluster::new(&[256; 6]),
            MemDisk::default(),
        );
        let plain: Vec<Vec<u8>> = (0..48).map(|pg| content(pg, 9)).collect();
        for (pg, d) in plain.iter().enumerate() {
            p.write(pg as u64, d).unwrap();
        }
        p.flush().unwrap();
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
