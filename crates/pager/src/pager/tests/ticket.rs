//! Reads by ticket (`ticket.rs`): many in flight at once, their replies delivered in any order
//! and interleaved with the pager's other operations, each finishing once with its page.

use super::*;

/// Pushes up to `n` of the replies the servers have queued, shuffled, as a loop that owns the
/// sockets would; returns how many.
fn deliver(p: &mut Pager<MemCluster, MemDisk>, rng: &mut fastrand::Rng, n: usize) -> usize {
    let mut replies = take_replies(p);
    rng.shuffle(&mut replies);
    let mut delivered = 0;
    for (i, (s, frame)) in replies.into_iter().enumerate() {
        if i >= n {
            // Not delivered yet: back in its server's queue.
            p.transport_mut().servers[s].replies.push_back(frame);
            continue;
        }
        let (id, reply) = decode_reply(&frame).unwrap();
        p.on_reply(s, id, &reply).unwrap();
        p.check_invariants().unwrap();
        delivered += 1;
    }
    delivered
}

#[test]
fn reads_by_ticket_stay_in_flight_together_and_finish_in_any_order() {
    let mut p = pager(MemCluster::new(&[64, 64, 64]), 64, 8, Backing::Cluster);
    let pages: Vec<u64> = (0..40).collect();
    let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 3)).collect();
    p.write_many(&pages, &data).unwrap();
    p.flush().unwrap();
    let gets = p.counters().gets;
    // 30 reads started, none waited for: every one is a GET in flight or queued for credits.
    for pg in 0..30u64 {
        p.start_read(pg, 1000 + pg).unwrap();
        p.check_invariants().unwrap();
    }
    assert_eq!(p.tickets(), 30);
    p.send_queued();
    let misses = p.counters().gets - gets;
    assert!(misses >= 20, "only {misses} of 30 reads went to a server");
    let mut rng = fastrand::Rng::with_seed(11);
    let mut got: HashMap<u64, Vec<u8>> = HashMap::new();
    while p.tickets() > 0 {
        // A loop's turn: the replies that arrived, then what finished.
        let delivered = deliver(&mut p, &mut rng, 3);
        p.take_finished(|tag, page, data| {
            assert_eq!(tag, 1000 + page);
            assert!(got.insert(page, data.unwrap().to_vec()).is_none(), "once");
        })
        .unwrap();
        p.check_invariants().unwrap();
        assert!(
            delivered > 0 || p.tickets() == 0 || p.has_finished(),
            "stuck"
        );
    }
    for pg in 0..30u64 {
        assert_eq!(got[&pg], content(pg, 3), "page {pg}");
    }
    assert!(p.idle());
}

/// A pager under `mirror:2` over three servers, without a cache, with pages 0..16 written
/// (`content(page, fill)`).
fn mirrored_with_16_pages(fill: u8) -> Pager<MemCluster, MemDisk> {
    let mut p = Pager::new(
        PagerConfig {
            pages: 32,
            cache_pages: 0,
            redundancy: "mirror:2".parse().unwrap(),
            ..sealed()
        },
        MemCluster::new(&[64, 64, 64]),
        MemDisk::default(),
    );
    for pg in 0..16 {
        p.write(pg, &content(pg, fill)).unwrap();
    }
    p
}

#[test]
fn a_ticket_whose_server_dies_is_read_from_another_copy() {
    let mut p = mirrored_with_16_pages(5);
    for pg in 0..16 {
        p.start_read(pg, pg).unwrap();
    }
    // One server dies with its replies unsent.
    let dead = p.holders(0)[0];
    p.transport_mut().servers[dead].replies.clear();
    p.transport_mut().servers[dead].dead = true;
    p.on_failure(dead, TransportError::Disconnected("killed".into()));
    let mut rng = fastrand::Rng::with_seed(3);
    let mut got = 0;
    while p.tickets() > 0 {
        deliver(&mut p, &mut rng, usize::MAX);
        p.take_finished(|_, page, data| {
            assert_eq!(data.unwrap(), &content(page, 5)[..], "page {page}");
            got += 1;
        })
        .unwrap();
    }
    assert_eq!(got, 16);
    assert!(p.counters().reads_from_other_copy > 0);
    p.check_invariants().unwrap();
}

/// A server that hangs (its connection open, its replies never coming) is found by the
/// pager's own reply timeout, without anything waiting on the transport: `expire` fails it
/// once a read waited for it has been unanswered for `reply_timeout_us` (not before), and
/// the reads it held are served by the other copy.
#[test]
fn a_ticket_whose_server_hangs_is_timed_out_by_expire_and_read_from_another_copy() {
    let mut p = mirrored_with_16_pages(6);
    p.flush().unwrap();
    let timeout = 5_000_000;
    p.set_schedule(ScheduleConfig {
        reply_timeout_us: timeout,
        ..ScheduleConfig::default()
    });
    let hung = p.holders(0)[0];
    p.transport_mut().servers[hung].held = true;
    // Nothing is late before anything was sent: a mark only.
    assert_eq!(p.expire(1_000), 0);
    for pg in 0..16 {
        p.start_read(pg, pg).unwrap();
    }
    p.send_queued();
    let mut rng = fastrand::Rng::with_seed(5);
    let mut got = 0;
    let mut take = |p: &mut Pager<MemCluster, MemDisk>, got: &mut usize| {
        // The hung server's replies never come.
        p.transport_mut().servers[hung].replies.clear();
        deliver(p, &mut rng, usize::MAX);
        p.take_finished(|_, page, data| {
            assert_eq!(data.unwrap(), &content(page, 6)[..], "page {page}");
            *got += 1;
        })
        .unwrap();
        p.check_invariants().unwrap();
    };
    // The other servers' reads finish; the hung one's wait. (Marks are taken as time goes.)
    take(&mut p, &mut got);
    let held = p.tickets();
    assert!(held > 0, "some reads went to the hung server first");
    // The first mark after the reads were sent is at 2 s (one per sixteenth of the timeout
    // at most: none at 2 ms); their age counts from there, never from before their sending.
    for now in [2_000, 2_000_000, timeout, 2_000_000 + timeout - 1] {
        assert_eq!(
            p.expire(now),
            0,
            "at {now} µs no request has waited {timeout} µs"
        );
    }
    assert_eq!(p.counters().servers_dead, 0);
    assert_eq!(p.expire(2_000_000 + timeout), 1);
    assert_eq!(p.counters().requests_timed_out, 1);
    assert_eq!(p.counters().servers_dead, 1);
    // Its reads go to the other copy.
    while p.tickets() > 0 {
        take(&mut p, &mut got);
    }
    assert_eq!(got, 16);
    assert!(p.counters().reads_from_other_copy > 0);
}

#[derive(Debug, Clone)]
enum Step {
    Write(u64, u8),
    /// `write_over_budget`: never waits, the pool growing if no slot is free.
    WriteOver(u64, u8),
    Start(u64),
    Deliver(usize),
    Take,
    Read(u64),
    Flush,
    Discard(u64),
    Kill(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => (0u64..24, any::<u8>()).prop_map(|(p, r)| Step::Write(p, r)),
        3 => (0u64..24, any::<u8>()).prop_map(|(p, r)| Step::WriteOver(p, r)),
        6 => (0u64..24).prop_map(Step::Start),
        4 => (1usize..6).prop_map(Step::Deliver),
        3 => Just(Step::Take),
        2 => (0u64..24).prop_map(Step::Read),
        1 => Just(Step::Flush),
        1 => (0u64..24).prop_map(Step::Discard),
        1 => (0usize..3).prop_map(Step::Kill),
    ]
}

/// What a ticket may return: the page as it was when the read started, or anything written
/// over it (or the zeros of a discard) before the read finished; an error only if the page
/// was discarded meanwhile.
#[derive(Debug, Default)]
struct Allowed {
    contents: Vec<Vec<u8>>,
    discarded: bool,
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(128),
        ..ProptestConfig::default()
    })]

    /// Reads by ticket interleaved with writes, reads, flushes, discards and server deaths,
    /// replies delivered a few at a time in any order: each ticket finishes once, with a page
    /// it may see; the invariants hold after every step; ordinary reads see the last write.
    #[test]
    fn tickets_interleaved_with_everything_else_see_a_version_they_may_see(
        steps in prop::collection::vec(step(), 1..120),
        cache in 0usize..6,
        seed: u64,
    ) {
        let mut cluster = MemCluster::new(&[12, 14, 16]);
        cluster.window = 3;
        let mut p = pager(cluster, 24, cache, Backing::ClusterDisk);
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
        let zero = vec![0u8; PAGE_SIZE];
        let mut open: HashMap<u64, (u64, Allowed)> = HashMap::new();
        let mut next_tag = 0u64;
        let take = |p: &mut Pager<MemCluster, MemDisk>,
                        open: &mut HashMap<u64, (u64, Allowed)>|
         -> Result<(), TestCaseError> {
            let mut bad = None;
            p.take_finished(|tag, page, data| {
                let Some((want_page, allowed)) = open.remove(&tag) else {
                    bad = Some(format!("ticket {tag} finished twice or never started"));
                    return;
                };
                let ok = page == want_page
                    && match data {
                        Ok(d) => allowed.contents.iter().any(|c| c[..] == *d),
                        Err(_) => allowed.discarded,
                    };
                if !ok && bad.is_none() {
                    bad = Some(format!("ticket {tag} of page {page}: {:?}", data.map(|d| d[0])));
                }
            })
            .unwrap();
            prop_assert!(bad.is_none(), "{}", bad.unwrap_or_default());
            Ok(())
        };
        for s in steps {
            match s {
                Step::Write(pg, r) | Step::WriteOver(pg, r) => {
                    let c = content(pg, r);
                    if matches!(s, Step::WriteOver(..)) {
                        let waits = p.counters().waits;
                        p.write_over_budget(pg, &c).unwrap();
                        prop_assert!(
                            p.counters().waits == waits
                                || p.counters().writes_over_budget_waited > 0,
                            "write_over_budget waited with room to grow"
                        );
                    } else {
                        p.write(pg, &c).unwrap();
                    }
                    for (_, (tp, a)) in open.iter_mut() {
                        if *tp == pg {
                            a.contents.push(c.clone());
                        }
                    }
                    model.insert(pg, c);
                }
                Step::Start(pg) => {
                    let now = model.get(&pg).cloned().unwrap_or_else(|| zero.clone());
                    p.start_read(pg, next_tag).unwrap();
                    open.insert(next_tag, (pg, Allowed { contents: vec![now], discarded: false }));
                    next_tag += 1;
                }
                Step::Deliver(n) => {
                    deliver(&mut p, &mut rng, n);
                }
                Step::Take => take(&mut p, &mut open)?,
                Step::Read(pg) => {
                    let want = model.get(&pg).cloned().unwrap_or_else(|| zero.clone());
                    prop_assert!(read(&mut p, pg).unwrap() == want, "page {}", pg);
                }
                Step::Flush => p.flush().unwrap(),
                Step::Discard(pg) => {
                    p.discard(pg).unwrap();
                    for (_, (tp, a)) in open.iter_mut() {
                        if *tp == pg {
                            a.contents.push(zero.clone());
                            a.discarded = true;
                        }
                    }
                    model.remove(&pg);
                }
                Step::Kill(s) => {
                    if p.transport().servers.iter().filter(|s| !s.dead).count() > 1 {
                        p.transport_mut().servers[s].dead = true;
                    }
                }
            }
            if let Err(e) = p.check_invariants() {
                prop_assert!(false, "after {:?}: {}", s, e);
            }
            prop_assert_eq!(p.tickets(), open.len());
        }
        // The loop's last turns: everything arrives, every ticket finishes.
        for _ in 0..1000 {
            if p.tickets() == 0 {
                break;
            }
            deliver(&mut p, &mut rng, usize::MAX);
            p.poll().unwrap();
            take(&mut p, &mut open)?;
        }
        prop_assert_eq!(p.tickets(), 0);
        prop_assert!(open.is_empty());
        p.flush().unwrap();
        for (pg, c) in &model {
            prop_assert!(read(&mut p, *pg).unwrap() == *c, "page {}", pg);
        }
        p.check_invariants().map_err(TestCaseError::fail)?;
    }
}

#[test]
fn a_pager_driven_by_its_replies_alone_does_not_grow() {
    // What the userfaultfd handler does for every fault: start, deliver, take. Nothing ever
    // waits, so nothing asks for the oldest request (where answered ones were dropped): a
    // `netram run` of GNU sort grew by 16 bytes a request until this was found.
    let mut p = pager(MemCluster::new(&[64, 64]), 32, 4, Backing::Cluster);
    for pg in 0..32 {
        p.write(pg, &content(pg, 1)).unwrap();
    }
    p.flush().unwrap();
    let mut rng = fastrand::Rng::with_seed(5);
    for round in 0..5_000u64 {
        let pg = rng.u64(0..32);
        p.start_read(pg, round).unwrap();
        p.send_queued();
        deliver(&mut p, &mut rng, usize::MAX);
        p.take_finished(|_, page, data| assert_eq!(data.unwrap(), &content(page, 1)[..]))
            .unwrap();
    }
    assert!(p.counters().gets > 1_000, "the reads went to the servers");
    p.check_invariants().unwrap();
}

/// A degraded read by ticket under Reed-Solomon never waits: its stripe's rebuild is started
/// when its ticket is taken, with every reply held back (a decode that waited would time out
/// on them and fail the servers), and the page is served from that rebuild once the pieces
/// are in: decoded once, for the read and the rebuild both.
#[test]
fn a_degraded_read_by_ticket_does_not_wait_for_its_stripe() {
    let mut p = rs_pager(5, 24, "rs:2+2");
    for page in 0..24 {
        p.write(page, &content(page, 1)).unwrap();
    }
    p.flush().unwrap();
    let page = (0..24)
        .find(|&pg| p.holders(pg).contains(&4))
        .expect("some data piece is on server 4");
    p.transport_mut().servers[4].dead = true;
    p.on_failure(4, TransportError::Disconnected("killed".into()));
    let degraded = p.degraded_pages();
    for s in 0..4 {
        p.transport_mut().servers[s].held = true;
    }
    p.start_read(page, 7).unwrap();
    p.check_invariants().unwrap();
    let mut got = None;
    p.take_finished(|_, _, _| panic!("nothing is in yet"))
        .unwrap();
    p.check_invariants().unwrap();
    assert_eq!(
        p.counters().servers_dead,
        1,
        "nothing waited for the held replies"
    );
    assert!(p.counters().gets > 0, "the stripe's pieces are asked for");
    for s in 0..4 {
        p.transport_mut().servers[s].held = false;
    }
    let mut rng = fastrand::Rng::with_seed(3);
    for _ in 0..100 {
        if got.is_some() {
            break;
        }
        deliver(&mut p, &mut rng, usize::MAX);
        p.take_finished(|tag, pg, data| {
            assert_eq!((tag, pg), (7, page));
            got = Some(data.unwrap().to_vec());
        })
        .unwrap();
        p.check_invariants().unwrap();
    }
    assert_eq!(got.expect("the read finished"), content(page, 1));
    assert_eq!(p.counters().degraded_reads, 1);
    assert_eq!(p.tickets(), 0);
    assert!(
        p.degraded_pages() < degraded,
        "the read's stripe was rebuilt on the way"
    );
    p.flush().unwrap();
    for pg in 0..24 {
        assert_eq!(read(&mut p, pg).unwrap(), content(pg, 1), "page {pg}");
    }
    p.check_invariants().unwrap();
}

/// Lets servers 0..5 answer again and delivers their replies (shuffled by `seed`) until the
/// read by ticket `tag` of `page` finishes; its data.
fn released_read(p: &mut Pager<MemCluster, MemDisk>, tag: u64, page: u64, seed: u64) -> Vec<u8> {
    for s in 0..5 {
        p.transport_mut().servers[s].held = false;
    }
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut got = None;
    for _ in 0..1_000 {
        if got.is_some() {
            break;
        }
        deliver(p, &mut rng, usize::MAX);
        p.take_finished(|t, pg, data| {
            assert_eq!((t, pg), (tag, page));
            got = Some(data.unwrap().to_vec());
        })
        .unwrap();
        p.check_invariants().unwrap();
    }
    got.expect("the read finished")
}

/// The same under parity: a degraded read by ticket drives recovery on each time finished
/// reads are taken (scans, then the survivors' reads), never waiting for the held replies,
/// and is served once its group has rebuilt its page.
#[test]
fn a_degraded_read_by_ticket_under_parity_does_not_wait_for_recovery() {
    let mut p = parity_pager(6, 24, 0);
    for page in 0..24 {
        p.write(page, &content(page, 1)).unwrap();
    }
    p.flush().unwrap();
    let page = (0..24)
        .find(|&pg| p.holders(pg).contains(&5))
        .expect("some page is on server 5");
    p.transport_mut().servers[5].dead = true;
    p.on_failure(5, TransportError::Disconnected("killed".into()));
    for s in 0..5 {
        p.transport_mut().servers[s].held = true;
    }
    p.start_read(page, 7).unwrap();
    p.take_finished(|_, _, _| panic!("nothing is in yet"))
        .unwrap();
    p.check_invariants().unwrap();
    assert_eq!(
        p.counters().servers_dead,
        1,
        "nothing waited for the held replies"
    );
    assert_eq!(p.tickets(), 1, "the read waits for its page");
    assert_eq!(released_read(&mut p, 7, page, 5), content(page, 1));
    assert_eq!(p.tickets(), 0);
    assert!(p.counters().parity_members_rebuilt > 0);
    p.flush().unwrap();
    for pg in 0..24 {
        assert_eq!(read(&mut p, pg).unwrap(), content(pg, 1), "page {pg}");
    }
    p.check_invariants().unwrap();
}

/// A read by ticket under parity whose server sends the page bad on every read: the server is
/// declared dead (its one copy lies) and the read waits for recovery as any degraded read by
/// ticket does, never decoded the waiting way. (Before, `take_finished` decoded it, waiting:
/// here that wait timed out on the held replies and declared every server dead.)
#[test]
fn a_read_by_ticket_of_a_page_sent_bad_again_and_again_waits_for_recovery() {
    let mut p = parity_pager(6, 24, 0);
    for page in 0..24 {
        p.write(page, &content(page, 2)).unwrap();
    }
    p.flush().unwrap();
    let page = (0..24)
        .find(|&pg| p.holders(pg).contains(&5))
        .expect("some page is on server 5");
    p.transport_mut().servers[5].corrupt_always = true;
    for s in 0..5 {
        p.transport_mut().servers[s].held = true;
    }
    p.start_read(page, 7).unwrap();
    p.send_queued();
    // Server 5's answers, bad every time, each read sent to it again until it is given up.
    for _ in 0..20 {
        let bad: Vec<Vec<u8>> = p.transport_mut().servers[5].replies.drain(..).collect();
        for frame in bad {
            let (id, reply) = decode_reply(&frame).unwrap();
            p.on_reply(5, id, &reply).unwrap();
        }
        p.take_finished(|_, _, _| panic!("nothing good is in yet"))
            .unwrap();
        p.check_invariants().unwrap();
        if p.counters().servers_dead > 0 {
            break;
        }
    }
    assert_eq!(
        p.counters().servers_dead,
        1,
        "server 5 given up, and nothing waited for the held replies"
    );
    assert_eq!(p.tickets(), 1, "the read waits for its page");
    assert_eq!(released_read(&mut p, 7, page, 9), content(page, 2));
    assert!(p.counters().parity_members_rebuilt > 0);
}

#[test]
fn a_write_over_budget_never_waits_for_a_slot_and_grows_the_pool_by_its_limit_at_most() {
    // The userfaultfd handler storing a forked child's pages as its agent copies them: no
    // reply comes in meanwhile (the handler reads none until it is done), and every slot is
    // soon in write-back. `write` would wait there; this takes a new slot instead.
    let mut p = Pager::new(
        PagerConfig {
            pages: 1024,
            cache_pages: 4,
            writeback_batch: 4,
            recovery_slots: 16,
            ..sealed()
        },
        MemCluster::new(&[1024, 1024]),
        MemDisk::default(),
    );
    let waits = p.counters().waits;
    let max = p.spare_slots_max();
    let mut pg = 0;
    while p.counters().slots_grown < max as u64 {
        p.write_over_budget(pg, &content(pg, 1)).unwrap();
        p.check_invariants().unwrap();
        assert_eq!(p.counters().waits, waits, "page {pg} waited");
        pg += 1;
        assert!(pg < 900, "the pool never grew: {:?}", p.counters());
    }
    assert_eq!(p.counters().writes_over_budget_waited, 0);
    // Its limit reached: the next one with no slot free waits, as `write` does.
    let mut rng = fastrand::Rng::with_seed(3);
    while p.counters().writes_over_budget_waited == 0 {
        p.write_over_budget(pg, &content(pg, 1)).unwrap();
        p.check_invariants().unwrap();
        pg += 1;
        assert!(pg < 1024, "never waited: {:?}", p.counters());
    }
    assert_eq!(p.counters().slots_grown, max as u64);
    // Replies in, in any order: every page reads back, and the pool keeps its size.
    deliver(&mut p, &mut rng, usize::MAX);
    p.flush().unwrap();
    for q in 0..pg {
        assert_eq!(read(&mut p, q).unwrap(), content(q, 1), "page {q}");
    }
    p.check_invariants().unwrap();
}

#[test]
fn taking_a_finished_read_never_waits_for_the_credits_its_eviction_needs() {
    // Keeping a page read by ticket evicts a dirty one from a full cache; its PUT finds every
    // server out of credits. It must queue, not wait for replies: the userfaultfd handler
    // installs fetches under the region's lock (a forking Python waited 231 times there).
    let mut cluster = MemCluster::new(&[64, 64]);
    cluster.window = 1;
    let mut p = Pager::new(
        PagerConfig {
            pages: 64,
            cache_pages: 4,
            writeback_batch: 1,
            batch_max: 1,
            ..sealed()
        },
        cluster,
        MemDisk::default(),
    );
    for pg in 0..8 {
        p.write(pg, &content(pg, 1)).unwrap();
    }
    p.flush().unwrap();
    // A cache of dirty pages.
    for pg in 10..14 {
        p.write(pg, &content(pg, 2)).unwrap();
    }
    p.flush().unwrap();
    for pg in 10..14 {
        p.write(pg, &content(pg, 3)).unwrap();
    }
    // A read whose reply comes in, then every server's one credit taken by reads left out.
    p.start_read(0, 1).unwrap();
    p.send_queued();
    let mut rng = fastrand::Rng::with_seed(1);
    while !p.has_finished() {
        assert!(deliver(&mut p, &mut rng, 1) > 0, "the read never finished");
    }
    for (tag, pg) in (2..).zip(1..8) {
        p.start_read(pg, tag).unwrap();
    }
    p.send_queued();
    assert!(p.sends_waiting(), "the servers still had credits");
    let waits = p.counters().waits;
    let mut got = None;
    p.take_finished(|tag, page, data| {
        assert_eq!((tag, page), (1, 0));
        got = Some(data.unwrap().to_vec());
    })
    .unwrap();
    assert_eq!(got.unwrap(), content(0, 1));
    assert_eq!(p.counters().waits, waits, "taking it waited for replies");
    p.check_invariants().unwrap();
    // Everything else arrives and finishes; the pages read back.
    for _ in 0..100 {
        deliver(&mut p, &mut rng, usize::MAX);
        p.send_queued();
        p.take_finished(|_, page, data| assert_eq!(data.unwrap(), &content(page, 1)[..]))
            .unwrap();
        if p.tickets() == 0 && !p.sends_waiting() && !p.awaits_replies() {
            break;
        }
    }
    assert_eq!(p.tickets(), 0);
    p.flush().unwrap();
    for pg in 10..14 {
        assert_eq!(read(&mut p, pg).unwrap(), content(pg, 3), "page {pg}");
    }
    p.check_invariants().unwrap();
}

/// A read by ticket started when nothing is in flight, no slot is free and the cache holds
/// only dirty pages grows the slot pool by one rather than write a victim back and wait for
/// its acknowledgement (it did).
#[test]
fn a_read_by_ticket_with_every_slot_dirty_or_held_does_not_wait() {
    let mut p = pager(MemCluster::new(&[64, 64]), 64, 8, Backing::Cluster);
    // Pages 0..8 on the servers, then 8 dirty pages in the cache.
    for pg in 0..8u64 {
        p.write(pg, &content(pg, 1)).unwrap();
    }
    p.flush().unwrap();
    for pg in 20..28u64 {
        p.write(pg, &content(pg, 2)).unwrap();
    }
    p.drain().unwrap();
    assert!(p.idle());
    assert!(p.cache.iter().all(|(_, &slot)| p.dirty[slot as usize]));
    // Every free slot held by a finished read not taken yet (cache hits hold a copy).
    let mut tag = 0;
    while !p.free_slots.is_empty() {
        p.start_read(20 + tag % 8, tag).unwrap();
        tag += 1;
    }
    let (waits, grown) = (p.counters().waits, p.counters().slots_grown);
    p.start_read(3, 100).unwrap();
    p.check_invariants().unwrap();
    assert_eq!(p.counters().waits, waits, "the read waited for a reply");
    assert_eq!(p.counters().slots_grown, grown + 1);
    p.send_queued();
    let mut got = None;
    while got.is_none() {
        assert!(p.poll().unwrap() > 0 || p.has_finished(), "stuck");
        p.take_finished(|t, page, data| {
            if t == 100 {
                got = Some((page, data.unwrap().to_vec()));
            }
        })
        .unwrap();
    }
    assert_eq!(got, Some((3, content(3, 1))));
    p.check_invariants().unwrap();
}

/// Reads by ticket beyond what the slot pool can give without waiting (every slot held by a
/// finished read not taken yet or dirty in the cache, the pool grown by its limit) wait for a
/// slot as a state: `start_read` returns at once, no reply is waited for, and each read
/// starts, in order, as taken reads and write-backs give slots back; every one reads back
/// right. (Before, the one past the limit waited inside `start_read`.)
#[test]
fn reads_by_ticket_past_the_pools_limit_wait_for_a_slot_without_waiting() {
    let mut p = pager(MemCluster::new(&[256, 256]), 128, 8, Backing::Cluster);
    for pg in 0..64u64 {
        p.write(pg, &content(pg, 1)).unwrap();
    }
    p.flush().unwrap();
    // Dirty pages in the cache, so that no clean one gives its slot.
    for pg in 100..108u64 {
        p.write(pg, &content(pg, 2)).unwrap();
    }
    let waits = p.counters().waits;
    assert!(p.read_starts_now());
    let mut tag = 0u64;
    // Reads of pages on the servers, none taken: their slots stay held.
    while p.counters().ticket_slot_waits < 5 {
        p.start_read(tag % 64, tag).unwrap();
        p.check_invariants().unwrap();
        tag += 1;
        assert!(tag < 1000, "never ran out of slots: {:?}", p.counters());
    }
    assert_eq!(p.counters().waits, waits, "a start waited for a reply");
    assert!(
        !p.read_starts_now(),
        "reads wait for slots: a guess would wait behind them"
    );
    assert_eq!(p.counters().slots_grown as usize, p.spare_slots_max());
    assert_eq!(p.tickets() as u64, tag);
    // Replies in, in any order, reads taken as they finish: every one, the waiting ones too.
    let mut rng = fastrand::Rng::with_seed(5);
    let mut got = std::collections::BTreeMap::new();
    for _ in 0..10_000 {
        if p.tickets() == 0 {
            break;
        }
        p.send_queued();
        deliver(&mut p, &mut rng, 4);
        p.take_finished(|t, page, data| {
            assert_eq!(page, t % 64);
            assert!(
                got.insert(t, data.unwrap().to_vec()).is_none(),
                "read {t} twice"
            );
        })
        .unwrap();
        p.check_invariants().unwrap();
    }
    assert_eq!(p.tickets(), 0, "reads never finished: {:?}", p.counters());
    assert!(p.read_starts_now());
    assert_eq!(p.counters().waits, waits, "a read waited for a reply");
    assert_eq!(got.len() as u64, tag);
    for (t, data) in got {
        assert_eq!(data, content(t % 64, 1), "read {t}");
    }
    p.flush().unwrap();
    for pg in 100..108u64 {
        assert_eq!(read(&mut p, pg).unwrap(), content(pg, 2), "page {pg}");
    }
}

/// A waiting read while every slot holds a read by ticket that has finished and is not taken
/// yet (a caller that takes them later, holding the pager meanwhile: the userfaultfd handler
/// serving a forked child's fault behind reads of pages given back): the pool grows by a
/// slot, where before `take_slot` panicked ("no slot free, cached or in flight").
#[test]
fn a_waiting_read_behind_finished_reads_holding_every_slot_grows_the_pool() {
    let mut p = pager(MemCluster::new(&[512, 512]), 256, 8, Backing::Cluster);
    for pg in (0..200u64).chain([250]) {
        p.write(pg, &content(pg, 1)).unwrap();
    }
    p.flush().unwrap();
    let mut tag = 0u64;
    while p.counters().ticket_slot_waits == 0 {
        p.start_read(tag % 200, tag).unwrap();
        tag += 1;
        assert!(tag < 2000, "never ran out of slots: {:?}", p.counters());
    }
    // Every reply in, nothing taken: the slots are held by finished reads.
    let mut rng = fastrand::Rng::with_seed(3);
    for _ in 0..100 {
        p.send_queued();
        if deliver(&mut p, &mut rng, usize::MAX) == 0 {
            break;
        }
    }
    assert!(p.has_finished());
    let grown = p.counters().slots_grown;
    let mut buf = vec![0; PAGE_SIZE];
    p.read(250, &mut buf).unwrap();
    assert_eq!(buf, content(250, 1));
    assert!(p.counters().slots_grown > grown, "{:?}", p.counters());
    p.check_invariants().unwrap();
    // And the reads by ticket finish, each with its page.
    let mut got = 0;
    for _ in 0..1000 {
        p.send_queued();
        deliver(&mut p, &mut rng, usize::MAX);
        p.take_finished(|t, page, data| {
            assert_eq!(page, t % 200);
            assert_eq!(data.unwrap(), &content(page, 1)[..]);
            got += 1;
        })
        .unwrap();
        if p.tickets() == 0 {
            break;
        }
    }
    assert_eq!(got, tag);
    p.check_invariants().unwrap();
}
