//! Migration (`migrate.rs`, Nswap §III): a server that shrinks its offer below the pages it
//! holds gets them moved away by their owner, under every scheme, and the pages read back;
//! with no room left in the cluster they go to the owner's disk. Under `none` and `mirror:N`
//! they go server to server (`handover.rs`), and the races of a move are played out by hand.

use super::*;

/// Ticks the pager (probing every millisecond, so that the leaving server is asked) until
/// nothing is leaving and nothing is in flight, then flushes.
fn tick_until_moved(p: &mut Pager<MemCluster, MemDisk>) {
    ticks_until_moved(p);
    p.flush().unwrap();
}

/// Ticks (the maintenance schedule alone, no flush) until no migration is due and nothing is
/// degraded.
fn ticks_until_moved(p: &mut Pager<MemCluster, MemDisk>) {
    p.set_schedule(ScheduleConfig {
        probe_every_us: 1_000,
        reconnect_every_us: 1_000_000,
        recover_batch: 8,
        migrate_batch: 8,
        ..ScheduleConfig::default()
    });
    let mut now = 0;
    loop {
        now += 1_000;
        let waits = p.counters().waits;
        p.on_tick(now).unwrap();
        // A tick queues what finds no credit or slot: its replies are taken by later ticks.
        assert_eq!(p.counters().waits, waits, "a tick waited for replies");
        p.check_invariants().unwrap();
        if now > 3_000 && !p.migration_due() && p.degraded_pages() == 0 {
            break;
        }
        assert!(
            now < 2_000_000,
            "migration does not end: {:?}",
            p.counters()
        );
    }
}

/// Pages 0..60 written and flushed, then server 0's offer falls to 4 frames: how many frames
/// it held.
fn fill_then_shrink_server_0(p: &mut Pager<MemCluster, MemDisk>) -> u64 {
    for page in 0..60 {
        p.write(page, &content(page, 1)).unwrap();
    }
    p.flush().unwrap();
    let held = p.transport.servers[0].store.stored_pages();
    let store = &mut p.transport.servers[0].store;
    store.set_offer(4);
    store.compact(usize::MAX);
    held
}

fn assert_every_page_reads_back(p: &mut Pager<MemCluster, MemDisk>, scheme: &str) {
    for page in 0..60 {
        assert_eq!(
            read(p, page).unwrap(),
            content(page, 1),
            "{scheme} page {page}"
        );
    }
}

#[test]
fn pages_above_a_shrunk_offer_move_away_under_every_scheme() {
    for scheme in ["none", "mirror:2", "parity:2", "rs:2+1"] {
        let mut p = Pager::new(
            PagerConfig {
                pages: 60,
                cache_pages: 0,
                writeback_batch: 4,
                redundancy: scheme.parse().unwrap(),
                ..sealed()
            },
            MemCluster::new(&[100, 100, 100, 100]),
            MemDisk::default(),
        );
        // Server 0's machine wants its memory: its offer falls to 4 frames.
        let held = fill_then_shrink_server_0(&mut p);
        assert!(held > 8, "{scheme}: server 0 holds {held} frames");
        let store = &mut p.transport.servers[0].store;
        assert_eq!(store.pages_beyond_offer(), held - 4);
        tick_until_moved(&mut p);
        // The donor compacts what was freed below its offer, as the daemon does every tick.
        assert!(p.table.pages_on(0).len() <= 4, "{scheme}");
        let store = &mut p.transport.servers[0].store;
        store.compact(usize::MAX);
        store.check_invariants();
        // Groups' parity included (`parity:N`: the owner asked the holder which groups it
        // holds above its offer and sent their members to new groups).
        assert_eq!(store.pages_beyond_offer(), 0, "{scheme}: all moved");
        assert!(store.stored_pages() <= 4, "{scheme}");
        if scheme.starts_with("parity") {
            assert!(p.counters().parity_groups_leaving > 0, "{scheme}");
        }
        assert_every_page_reads_back(&mut p, scheme);
        let c = p.counters();
        assert!(c.pages_migrated > 0, "{scheme}: {c:?}");
        assert_eq!(c.pages_migrated, c.migrations_started, "{scheme}");
        assert_eq!(c.pages_migrated_to_disk, 0, "{scheme}");
        if scheme == "none" || scheme.starts_with("mirror") {
            assert_eq!(
                c.pages_migrated_direct, c.pages_migrated,
                "{scheme}: server to server"
            );
        } else {
            assert_eq!(c.pages_migrated_direct, 0, "{scheme}: through the owner");
        }
        // Still protected: a second server can die and nothing is lost.
        if scheme != "none" {
            p.transport.servers[1].dead = true;
            for page in 0..60 {
                assert_eq!(
                    read(&mut p, page).unwrap(),
                    content(page, 1),
                    "{scheme} page {page}"
                );
            }
        }
        p.check_invariants().unwrap();
    }
}

#[test]
fn ticks_move_pages_without_waiting_when_every_credit_is_out() {
    // A window of one request per server: a step's reads and writes find no credit. They
    // queue and go with the replies later ticks take in; no tick waits for them (ticks run
    // under a region's lock, between its faults).
    for scheme in ["none", "mirror:2", "parity:2", "rs:2+1"] {
        let mut cluster = MemCluster::new(&[100, 100, 100, 100]);
        cluster.window = 1;
        cluster.no_handover = true;
        let mut p = Pager::new(
            PagerConfig {
                pages: 60,
                cache_pages: 0,
                writeback_batch: 4,
                batch_max: 1,
                redundancy: scheme.parse().unwrap(),
                ..sealed()
            },
            cluster,
            MemDisk::default(),
        );
        fill_then_shrink_server_0(&mut p);
        ticks_until_moved(&mut p);
        p.flush().unwrap();
        assert!(p.table.pages_on(0).len() <= 4, "{scheme}");
        assert_every_page_reads_back(&mut p, scheme);
        let c = p.counters();
        assert!(c.pages_migrated > 0, "{scheme}: {c:?}");
        assert_eq!(c.pages_migrated_direct, 0, "{scheme}: through the owner");
    }
}

/// Under `parity:2` off one of three servers, no group can get a second member (its holder
/// and its one member take the other two): the migration ships its groups half full, by
/// ticks alone, and the donor ends up holding nothing, groups' parity included. (Between
/// real daemons, `crates/cli/tests/adapt.rs` `parity_held_by_a_donor_that_shrinks_leaves_with_its_pages`
/// found such a migration waiting for the program's next flush.)
#[test]
fn a_parity_migration_with_no_room_for_full_groups_ends_by_ticks_alone() {
    let mut p = Pager::new(
        PagerConfig {
            pages: 30,
            cache_pages: 0,
            writeback_batch: 4,
            redundancy: "parity:2".parse().unwrap(),
            ..sealed()
        },
        MemCluster::new(&[100, 100, 100]),
        MemDisk::default(),
    );
    for page in 0..30 {
        p.write(page, &content(page, 4)).unwrap();
    }
    p.flush().unwrap();
    let held = p.table.pages_on(0).len();
    assert!(held > 0);
    p.transport.servers[0].store.set_offer(0);
    // Ticks alone, no flush: the donor is empty when they stop.
    ticks_until_moved(&mut p);
    // Groups' parity included; the members of the groups it held moved too.
    assert_eq!(p.transport.servers[0].store.stored_pages(), 0);
    assert!(p.counters().pages_migrated >= held as u64);
    assert!(p.counters().parity_groups_leaving > 0);
    for page in 0..30 {
        assert_eq!(read(&mut p, page).unwrap(), content(page, 4), "page {page}");
    }
}

#[test]
fn with_no_room_left_in_the_cluster_pages_move_to_the_owners_disk() {
    let mut p = pager(MemCluster::new(&[40, 40]), 70, 0, Backing::Cluster);
    for page in 0..70 {
        p.write(page, &content(page, 2)).unwrap();
    }
    p.flush().unwrap();
    assert_eq!(p.pages_on_disk_only(), 0);
    let held = p.transport.servers[0].store.stored_pages();
    p.transport.servers[0].store.set_offer(10);
    tick_until_moved(&mut p);
    let store = &mut p.transport.servers[0].store;
    store.compact(usize::MAX);
    assert_eq!(store.pages_beyond_offer(), 0);
    // Server 1 had room for 40 - (70 - held) of them; the rest went to the disk.
    let c = p.counters().clone();
    assert_eq!(c.pages_migrated, held - 10);
    assert_eq!(c.pages_migrated_to_disk, held - 10 - (40 - (70 - held)));
    assert_eq!(p.pages_on_disk_only(), c.pages_migrated_to_disk);
    for page in 0..70 {
        assert_eq!(read(&mut p, page).unwrap(), content(page, 2), "page {page}");
    }
}

#[test]
fn a_page_written_or_discarded_while_it_moves_keeps_its_newest_version() {
    let mut p = pager(MemCluster::new(&[100, 100]), 40, 0, Backing::Cluster);
    for page in 0..40 {
        p.write(page, &content(page, 3)).unwrap();
    }
    p.flush().unwrap();
    let on0 = p.table.pages_on(0);
    p.transport.servers[0].store.set_offer(0);
    // One tick learns what leaves (the probe), the next starts moving; then the program
    // writes and discards pages of server 0 before the moves are acknowledged.
    p.set_schedule(ScheduleConfig {
        probe_every_us: 1_000,
        ..ScheduleConfig::default()
    });
    p.on_tick(1_000).unwrap();
    p.on_tick(2_000).unwrap();
    p.on_tick(3_000).unwrap();
    assert!(p.counters().migrations_started > 0);
    for &page in on0.iter().step_by(3) {
        p.write(page, &content(page, 4)).unwrap();
    }
    for &page in on0.iter().skip(1).step_by(3) {
        p.discard(page).unwrap();
    }
    tick_until_moved(&mut p);
    for page in 0..40 {
        let want = match on0.iter().position(|&q| q == page) {
            Some(i) if i % 3 == 0 => content(page, 4),
            Some(i) if i % 3 == 1 => vec![0; PAGE_SIZE],
            _ => content(page, 3),
        };
        assert_eq!(read(&mut p, page).unwrap(), want, "page {page}");
    }
    assert_eq!(p.transport.servers[0].store.stored_pages(), 0);
    p.check_invariants().unwrap();
}

/// Copies each server holds against those the table names: no copy left behind.
fn no_copy_the_table_does_not_name(p: &Pager<MemCluster, MemDisk>) {
    for (s, srv) in p.transport.servers.iter().enumerate() {
        assert_eq!(
            srv.store.stored_pages(),
            p.table.pages_on(s).len() as u64,
            "server {s} holds copies the table does not name"
        );
    }
}

/// Server to server (`handover.rs`): the new server has taken the pages when the program
/// writes some of them again and discards others, before the old server's answer arrives.
/// Each keeps its newest version, and no server is left with a copy the table does not name.
#[test]
fn a_direct_move_that_loses_a_race_leaves_no_copy_behind() {
    let mut p = pager(MemCluster::new(&[100, 100, 100]), 40, 0, Backing::Cluster);
    for page in 0..40 {
        p.write(page, &content(page, 3)).unwrap();
    }
    p.flush().unwrap();
    let on0 = p.table.pages_on(0);
    assert!(on0.len() > 6, "server 0 holds {} pages", on0.len());
    p.transport.servers[0].store.set_offer(0);
    // Any answer from server 0 says what leaves.
    read(&mut p, on0[0]).unwrap();
    assert_eq!(p.pages_leaving(), on0.len() as u64);
    let step = p.migrate(64).unwrap();
    assert_eq!(step.started, on0.len());
    // The new servers answer the EXPECTs; server 0 hands the pages over at once (this
    // transport serves a request as it is sent) but its answer waits.
    for (s, frame) in take_replies(&mut p) {
        let (id, reply) = decode_reply(&frame).unwrap();
        p.on_reply(s, id, &reply).unwrap();
    }
    assert!(
        !p.transport.servers[0].replies.is_empty(),
        "MIGRATE answered"
    );
    assert_eq!(p.pages_in_handover(), on0.len());
    let adopted: u64 = (1..3)
        .map(|s| p.transport.servers[s].store.counters().pages_adopted)
        .sum();
    assert_eq!(
        adopted,
        on0.len() as u64,
        "the new servers hold them already"
    );
    for &page in on0.iter().step_by(3) {
        p.write(page, &content(page, 4)).unwrap();
    }
    for &page in on0.iter().skip(1).step_by(3) {
        p.discard(page).unwrap();
    }
    tick_until_moved(&mut p);
    for page in 0..40 {
        let want = match on0.iter().position(|&q| q == page) {
            Some(i) if i % 3 == 0 => content(page, 4),
            Some(i) if i % 3 == 1 => vec![0; PAGE_SIZE],
            _ => content(page, 3),
        };
        assert_eq!(read(&mut p, page).unwrap(), want, "page {page}");
    }
    assert_eq!(p.transport.servers[0].store.stored_pages(), 0);
    let c = p.counters();
    let untouched = on0.len() - on0.len().div_ceil(3) - (on0.len() - 1).div_ceil(3);
    assert!(c.pages_migrated_direct as usize >= untouched, "{c:?}");
    assert_eq!(p.pages_in_handover(), 0);
    no_copy_the_table_does_not_name(&p);
    p.check_invariants().unwrap();
}

/// The old server dies after handing pages over, before its answer: the new server's copies
/// are deleted (the table never named them), and the pages are as lost as any on a dead
/// server under `none` (mirror:2 keeps them).
#[test]
fn the_old_server_dying_midway_leaves_no_copy_behind() {
    for scheme in ["none", "mirror:2"] {
        let mut p = Pager::new(
            PagerConfig {
                pages: 30,
                cache_pages: 0,
                writeback_batch: 4,
                redundancy: scheme.parse().unwrap(),
                ..sealed()
            },
            MemCluster::new(&[100, 100, 100, 100]),
            MemDisk::default(),
        );
        for page in 0..30 {
            p.write(page, &content(page, 5)).unwrap();
        }
        p.flush().unwrap();
        let on0 = p.table.pages_on(0);
        p.transport.servers[0].store.set_offer(0);
        read(&mut p, on0[0]).unwrap();
        p.migrate(64).unwrap();
        for (s, frame) in take_replies(&mut p) {
            let (id, reply) = decode_reply(&frame).unwrap();
            p.on_reply(s, id, &reply).unwrap();
        }
        assert!(p.pages_in_handover() > 0, "{scheme}");
        p.transport.servers[0].replies.clear();
        p.transport.servers[0].dead = true;
        p.on_failure(0, TransportError::Disconnected("killed".into()));
        assert_eq!(p.pages_in_handover(), 0, "{scheme}");
        recover_all(&mut p);
        p.flush().unwrap();
        for s in 1..4 {
            assert_eq!(
                p.transport.servers[s].store.stored_pages(),
                p.table.pages_on(s).len() as u64,
                "{scheme}: server {s} holds copies the table does not name"
            );
        }
        if scheme == "mirror:2" {
            for page in 0..30 {
                assert_eq!(read(&mut p, page).unwrap(), content(page, 5), "page {page}");
            }
        }
        p.check_invariants().unwrap();
    }
}

/// A migration step larger than a frame may carry (the schedule's default is 256 pages) sends
/// its EXPECTs and MIGRATEs in frames a server accepts (a server drops the connection of a
/// longer batch: found by CI, where a donor's pages all went to the disk).
#[test]
fn a_step_larger_than_a_frame_goes_in_frames() {
    let mut p = pager(MemCluster::new(&[1000, 1000]), 800, 0, Backing::Cluster);
    for page in 0..800 {
        p.write(page, &content(page, 6)).unwrap();
    }
    p.flush().unwrap();
    let on0 = p.table.pages_on(0);
    assert!(
        on0.len() > 2 * netram_proto::MAX_BATCH,
        "{} pages on server 0",
        on0.len()
    );
    p.transport.servers[0].store.set_offer(0);
    read(&mut p, on0[0]).unwrap();
    let step = p.migrate(4 * netram_proto::MAX_BATCH).unwrap();
    assert!(step.started > netram_proto::MAX_BATCH, "{step:?}");
    tick_until_moved(&mut p);
    let c = p.counters();
    assert_eq!(c.pages_migrated_direct as usize, on0.len(), "{c:?}");
    assert_eq!(c.pages_migrated_to_disk, 0);
    assert_eq!(p.transport.servers[0].store.stored_pages(), 0);
    for page in 0..800 {
        assert_eq!(read(&mut p, page).unwrap(), content(page, 6), "page {page}");
    }
    no_copy_the_table_does_not_name(&p);
}

/// An old server that will not hand over to the new one (it does not count it a member of its
/// cluster: every MIGRATE comes back unreachable, though the owner reaches the new server):
/// the owner stops asking for that pair and moves the pages itself; the migration ends.
#[test]
fn pages_an_old_server_will_not_hand_over_move_through_the_owner() {
    let mut p = Pager::new(
        PagerConfig {
            pages: 40,
            cache_pages: 0,
            writeback_batch: 4,
            redundancy: "mirror:2".parse().unwrap(),
            ..sealed()
        },
        MemCluster::new(&[100, 100, 100, 100]),
        MemDisk::default(),
    );
    for page in 0..40 {
        p.write(page, &content(page, 3)).unwrap();
    }
    p.flush().unwrap();
    p.transport.no_handover = true;
    let store = &mut p.transport.servers[0].store;
    store.set_offer(2);
    store.compact(usize::MAX);
    tick_until_moved(&mut p);
    let store = &mut p.transport.servers[0].store;
    store.compact(usize::MAX);
    assert_eq!(store.pages_beyond_offer(), 0, "all moved");
    let c = p.counters().clone();
    assert!(c.pages_migrated > 0, "{c:?}");
    assert_eq!(c.pages_migrated_direct, 0, "{c:?}");
    assert!(
        c.migrations_refused > 0,
        "the direct moves were tried: {c:?}"
    );
    for page in 0..40 {
        assert_eq!(read(&mut p, page).unwrap(), content(page, 3), "page {page}");
    }
    p.check_invariants().unwrap();
}
