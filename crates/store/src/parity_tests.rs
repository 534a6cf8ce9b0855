//! Dynamic parity across a few stores wired together by hand: the request logic of
//! [`crate::serve`] on every node, deltas carried from member servers to holders the way the
//! daemon and the simulator carry them, and reconstructions checked against what was written.

use crate::serve::{finish_forward, handle_request, store_stats, DeltaOutcome, Outcome};
use crate::{DeltaFrom, SessionHandle, Store, StoreConfig};
use netram_proto::{
    decode_reply, DeleteStatus, DeltaStatus, ErrorCode, GetResult, Member, OwnedRecord, Page,
    PageKey, ParityOp, PutStatus, Record, Reply, Request, PAGE_SIZE,
};
use std::collections::HashSet;
use std::net::SocketAddr;

struct Node {
    addr: SocketAddr,
    store: Store<Vec<u8>>,
    /// The client's session here.
    h: SessionHandle,
}

/// Five servers, one client with a session on each; `down` servers do not answer deltas.
struct Cluster {
    nodes: Vec<Node>,
    down: HashSet<usize>,
    next_id: u64,
}

fn addr(i: usize) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, i as u8 + 1], 7077))
}

fn data(b: u8) -> Vec<u8> {
    (0..PAGE_SIZE).map(|i| b.wrapping_add(i as u8)).collect()
}

/// Node `i`'s node id, as its certificate would name it.
fn node(i: usize) -> u64 {
    i as u64 + 1
}

/// A delta as node `i` forwards it: a server, checked against the member's node id.
fn from(i: usize) -> DeltaFrom {
    DeltaFrom::Peer(crate::Peer::Server(node(i)))
}

fn key(p: u64) -> PageKey {
    PageKey::new(1, p)
}

impl Cluster {
    fn new() -> Self {
        let nodes = (0..5)
            .map(|i| {
                let mut store = Store::new(vec![0u8; 64 * PAGE_SIZE], StoreConfig::default());
                let h = store.open_session(7, 1, 1, 0).unwrap();
                // The servers' own sessions at each other, which deltas travel on.
                store.open_session(100 + i as u64, 1, 1, 0).unwrap();
                Node {
                    addr: addr(i),
                    store,
                    h,
                }
            })
            .collect();
        Self {
            nodes,
            down: HashSet::new(),
            next_id: 1,
        }
    }

    fn index(&self, a: SocketAddr) -> usize {
        self.nodes.iter().position(|n| n.addr == a).unwrap()
    }

    /// Runs a request of the client on node `i`, carrying deltas to holders; returns the reply.
    fn request(&mut self, i: usize, req: Request<'_>) -> Vec<u8> {
        let id = self.next_id;
        self.next_id += 1;
        let mut out = Vec::new();
        let h = self.nodes[i].h;
        let o = handle_request(
            &mut self.nodes[i].store,
            h,
            id,
            req,
            0,
            0,
            &mut out,
            store_stats,
        );
        if let Outcome::Forward(fwd) = o {
            let outcomes: Vec<DeltaOutcome> = fwd
                .deltas
                .iter()
                .map(|(holder, d)| {
                    let j = self.index(holder.addr);
                    assert_eq!(holder.node, node(j), "the holder node the owner named");
                    if self.down.contains(&j) {
                        return DeltaOutcome::Unreachable;
                    }
                    match self.nodes[j].store.apply_delta(&d.as_delta(), from(i)) {
                        DeltaStatus::Applied => DeltaOutcome::Applied,
                        DeltaStatus::UnknownGroup | DeltaStatus::Stale => {
                            DeltaOutcome::UnknownGroup
                        }
                    }
                })
                .collect();
            finish_forward(&mut self.nodes[i].store, h, fwd, &outcomes, 0, 0, &mut out);
        }
        out
    }

    fn put(&mut self, i: usize, p: u64, version: u32, b: u8, op: ParityOp) -> PutStatus {
        // The client names node i by its address.
        let op = match op {
            ParityOp::Join {
                holder,
                holder_node,
                group,
                ..
            } => ParityOp::Join {
                holder,
                holder_node,
                group,
                member: addr(i),
            },
            keep => keep,
        };
        let d = data(b);
        let page = Page::seal(key(p), version, &d);
        let out = self.request(i, Request::PutParity(vec![(page, op)]));
        match decode_reply(&out).unwrap().1 {
            Reply::Put { status, .. } => status[0],
            r => panic!("{r:?}"),
        }
    }

    fn delete(&mut self, i: usize, p: u64) -> DeleteStatus {
        let out = self.request(i, Request::Delete(vec![key(p)]));
        match decode_reply(&out).unwrap().1 {
            Reply::Delete { status, .. } => status[0],
            r => panic!("{r:?}"),
        }
    }

    fn record(&mut self, i: usize, p: u64) -> OwnedRecord {
        let out = self.request(i, Request::Get(vec![key(p)]));
        let mut r = OwnedRecord::default();
        match decode_reply(&out).unwrap().1 {
            Reply::Get { pages, .. } => match pages[0] {
                GetResult::Found(page) => r.xor(&Record::of(&page)),
                m => panic!("{m:?}"),
            },
            r => panic!("{r:?}"),
        }
        r
    }

    /// Ships the parity of `members` ((node, page)) to `holder` as `group`.
    fn ship(&mut self, holder: usize, group: u64, max: u8, members: &[(usize, u64)]) -> PutStatus {
        let mut parity = OwnedRecord::default();
        for &(i, p) in members {
            let r = self.record(i, p);
            parity.xor(&r.as_record());
        }
        let members = members
            .iter()
            .map(|&(i, p)| Member {
                server: addr(i),
                node: node(i),
                key: key(p),
                version: self.record(i, p).version,
            })
            .collect();
        let out = self.request(
            holder,
            Request::ParityShip {
                group,
                max_members: max,
                members,
                record: parity.as_record(),
            },
        );
        match decode_reply(&out).unwrap().1 {
            Reply::Put { status, .. } => status[0],
            r => panic!("{r:?}"),
        }
    }

    /// Rebuilds the page that `dead` held from the group `holder` reports and the survivors,
    /// as the owner does after a crash; returns the page's data and version.
    fn reconstruct(&mut self, holder: usize, dead: usize) -> (PageKey, u32, Vec<u8>) {
        let out = self.request(
            holder,
            Request::ParityScan {
                dead: addr(dead),
                max: 10,
            },
        );
        let Reply::ParityScan { groups, .. } = decode_reply(&out).unwrap().1 else {
            panic!()
        };
        assert_eq!(groups.len(), 1, "one group has a member on the dead server");
        let g = &groups[0];
        let mut r = OwnedRecord::default();
        r.xor(&g.record);
        let mut lost = None;
        for m in &g.members {
            if m.server == addr(dead) {
                lost = Some(m.key);
                continue;
            }
            let other = self.record(self.index(m.server), m.key.page);
            r.xor(&other.as_record());
        }
        let k = lost.unwrap();
        let page = r.as_record().page(k);
        assert!(page.verify(), "the reconstruction carries a valid checksum");
        (k, page.version, page.data.to_vec())
    }

    fn check(&self) {
        for n in &self.nodes {
            n.store.check_invariants();
            assert_eq!(n.store.counters().parity_groups_inconsistent, 0);
        }
    }
}

/// A join of node `holder`'s group `group` (`Cluster::put` fills in the member's address).
fn join(holder: usize, group: u64) -> ParityOp {
    ParityOp::Join {
        holder: addr(holder),
        holder_node: node(holder),
        group,
        member: addr(holder),
    }
}

#[test]
fn overwrites_reach_the_holder_and_a_lost_member_is_rebuilt() {
    let mut c = Cluster::new();
    for (i, p) in [(0, 10), (1, 11), (2, 12)] {
        assert_eq!(c.put(i, p, 1, p as u8, join(3, 5)), PutStatus::Stored);
    }
    assert_eq!(
        c.ship(3, 5, 4, &[(0, 10), (1, 11), (2, 12)]),
        PutStatus::Stored
    );
    // Overwrite in place: node 1 sends old ⊕ new to node 3 before it answers.
    assert_eq!(c.put(1, 11, 2, 99, ParityOp::Keep), PutStatus::Stored);
    assert_eq!(c.nodes[3].store.counters().parity_deltas_applied, 1);
    for dead in 0..3 {
        let (k, v, d) = c.reconstruct(3, dead);
        let want = [(10, 1, 10u8), (11, 2, 99), (12, 1, 12)][dead];
        assert_eq!(
            (k.page, v, d),
            (want.0, want.1, data(want.2)),
            "member on {dead}"
        );
    }
    // The owner takes a rebuilt page out of its group itself, naming itself as SELF.
    let (k, v, d) = c.reconstruct(3, 1);
    let mut record = OwnedRecord::default();
    record.xor(&Record::of(&Page::seal(k, v, &d)));
    let removal = netram_proto::Delta {
        owner: netram_proto::Owner::SELF,
        group: 5,
        member: addr(1),
        key: k,
        from: v,
        to: v,
        kind: netram_proto::DeltaKind::Remove,
        record: record.as_record(),
    };
    let out = c.request(3, Request::ParityDelta(vec![removal]));
    match decode_reply(&out).unwrap().1 {
        Reply::ParityDelta { status, .. } => assert_eq!(status, vec![DeltaStatus::Applied]),
        r => panic!("{r:?}"),
    }
    assert_eq!(c.nodes[3].store.held_groups()[0].2.len(), 2);
    // Garbage collection takes a page out of its group; the others still rebuild.
    assert_eq!(c.delete(0, 10), DeleteStatus::Deleted);
    let (k, v, d) = c.reconstruct(3, 2);
    assert_eq!((k.page, v, d), (12, 1, data(12)));
    // A holder that cannot be told: nothing changes, the client learns why.
    c.down.insert(3);
    assert_eq!(
        c.put(2, 12, 2, 50, ParityOp::Keep),
        PutStatus::HolderUnreachable
    );
    assert_eq!(c.delete(2, 12), DeleteStatus::HolderUnreachable);
    assert_eq!(c.record(2, 12).data[..], data(12)[..]);
    // Once the owner declares the holder dead, the scan hands back its orphans, untagged.
    let out = c.request(
        2,
        Request::ParityScan {
            dead: addr(3),
            max: 10,
        },
    );
    let Reply::ParityScan {
        orphans, groups, ..
    } = decode_reply(&out).unwrap().1
    else {
        panic!()
    };
    assert_eq!((orphans, groups.len()), (vec![key(12)], 0));
    assert_eq!(c.put(2, 12, 2, 50, ParityOp::Keep), PutStatus::Unprotected);
    assert_eq!(c.delete(2, 12), DeleteStatus::Deleted);
    c.check();
}

#[test]
fn small_groups_merge_and_old_ids_still_reach_them() {
    let mut c = Cluster::new();
    for (i, p) in [(0, 1), (1, 2)] {
        c.put(i, p, 1, p as u8, join(4, 100));
    }
    for (i, p) in [(2, 3), (3, 4)] {
        c.put(i, p, 1, p as u8, join(4, 200));
    }
    c.ship(4, 100, 4, &[(0, 1), (1, 2)]);
    c.ship(4, 200, 4, &[(2, 3), (3, 4)]);
    let held = &c.nodes[4].store;
    assert_eq!(held.counters().parity_groups_merged, 1);
    assert_eq!(held.held_groups().len(), 1);
    assert_eq!(held.stored_pages(), 1, "one parity frame for both");
    // A member tagged with the absorbed group's id still updates the merged parity.
    c.put(2, 3, 2, 77, ParityOp::Keep);
    c.put(0, 1, 2, 66, ParityOp::Keep);
    assert_eq!(c.reconstruct(4, 2).2, data(77));
    assert_eq!(c.reconstruct(4, 0).2, data(66));
    assert_eq!(c.reconstruct(4, 3).2, data(4));
    // A page that joins another group leaves its old one first.
    assert_eq!(c.put(3, 4, 2, 40, join(0, 300)), PutStatus::Stored);
    assert_eq!(c.nodes[4].store.held_groups()[0].2.len(), 3);
    for (i, p) in [(0, 1), (1, 2), (2, 3)] {
        assert_eq!(c.delete(i, p), DeleteStatus::Deleted);
    }
    let held = &c.nodes[4].store;
    assert_eq!(held.counters().parity_groups_freed, 1);
    assert_eq!(held.stored_pages(), 0, "the emptied group's frame is free");
    c.check();
}

#[test]
fn groups_that_share_a_server_do_not_merge() {
    let mut c = Cluster::new();
    c.put(0, 1, 1, 1, join(4, 1));
    c.put(0, 2, 1, 2, join(4, 2));
    c.ship(4, 1, 4, &[(0, 1)]);
    c.ship(4, 2, 4, &[(0, 2)]);
    assert_eq!(c.nodes[4].store.held_groups().len(), 2);
    c.check();
}

#[test]
fn a_key_twice_in_one_parity_put_is_refused_and_changes_nothing() {
    let mut c = Cluster::new();
    let d = data(1);
    let p = Page::seal(key(1), 1, &d);
    let out = c.request(
        0,
        Request::PutParity(vec![(p, ParityOp::Keep), (p, join(1, 1))]),
    );
    match decode_reply(&out).unwrap().1 {
        Reply::Error { code, .. } => assert_eq!(code, ErrorCode::BadRequest),
        r => panic!("{r:?}"),
    }
    assert_eq!(c.nodes[0].store.stored_pages(), 0);
}

#[test]
fn a_holder_whose_owner_session_ended_forgets_its_groups() {
    let mut c = Cluster::new();
    c.put(0, 1, 1, 1, join(4, 1));
    c.ship(4, 1, 4, &[(0, 1)]);
    let h = c.nodes[4].h;
    c.nodes[4].store.close(h).unwrap();
    assert!(c.nodes[4].store.held_groups().is_empty());
    // The member's server hears that the group is gone and stores the page outside any group.
    assert_eq!(c.put(0, 1, 2, 9, ParityOp::Keep), PutStatus::Unprotected);
    assert!(!c.nodes[0].store.tagged(c.nodes[0].h, key(1)));
    c.check();
}

#[test]
fn a_repeated_delta_is_answered_without_being_applied_twice() {
    let mut c = Cluster::new();
    for (i, p) in [(0, 1), (1, 2)] {
        c.put(i, p, 1, p as u8, join(2, 9));
    }
    c.ship(2, 9, 4, &[(0, 1), (1, 2)]);
    // Node 0 works out the overwrite's delta; it reaches the holder twice (an answer was lost
    // and the sender tried again).
    let d = data(50);
    let page = Page::seal(key(1), 2, &d);
    let h = c.nodes[0].h;
    let mut out = Vec::new();
    let req = Request::PutParity(vec![(page, ParityOp::Keep)]);
    let Outcome::Forward(fwd) = handle_request(
        &mut c.nodes[0].store,
        h,
        1,
        req,
        0,
        0,
        &mut out,
        store_stats,
    ) else {
        panic!("an overwrite of a member waits for its holder")
    };
    let owned = fwd.deltas[0].1.clone();
    let delta = owned.as_delta();
    assert_eq!(
        c.nodes[2].store.apply_delta(&delta, from(0)),
        DeltaStatus::Applied
    );
    assert_eq!(
        c.nodes[2].store.apply_delta(&delta, from(0)),
        DeltaStatus::Applied
    );
    assert_eq!(c.nodes[2].store.counters().parity_deltas_repeated, 1);
    finish_forward(
        &mut c.nodes[0].store,
        h,
        fwd,
        &[DeltaOutcome::Applied],
        0,
        0,
        &mut out,
    );
    assert_eq!(c.reconstruct(2, 0).2, data(50));
    // A delta from a version the parity does not cover is refused and marks the group.
    let stale = netram_proto::Delta {
        from: 7,
        to: 8,
        ..delta
    };
    assert_eq!(
        c.nodes[2].store.apply_delta(&stale, from(0)),
        DeltaStatus::Stale
    );
    assert_eq!(c.nodes[2].store.counters().parity_deltas_stale, 1);
    c.check();
}

#[test]
fn a_dropped_member_damages_its_group_which_then_never_merges_or_counts_as_inconsistent() {
    let mut c = Cluster::new();
    for (i, p) in [(0, 1), (1, 2)] {
        c.put(i, p, 1, p as u8, join(4, 1));
    }
    c.ship(4, 1, 4, &[(0, 1), (1, 2)]);
    let zero = OwnedRecord::default();
    let drop = netram_proto::Delta {
        owner: netram_proto::Owner::SELF,
        group: 1,
        member: addr(0),
        key: key(1),
        from: 1,
        to: 1,
        kind: netram_proto::DeltaKind::Drop,
        record: zero.as_record(),
    };
    c.request(4, Request::ParityDelta(vec![drop]));
    assert_eq!(c.nodes[4].store.counters().parity_members_dropped, 1);
    // A small healthy group on other servers does not merge into it.
    c.put(2, 3, 1, 3, join(4, 2));
    c.ship(4, 2, 4, &[(2, 3)]);
    assert_eq!(c.nodes[4].store.held_groups().len(), 2);
    assert_eq!(c.delete(1, 2), DeleteStatus::Deleted);
    let counters = c.nodes[4].store.counters();
    assert_eq!(counters.parity_groups_damaged, 1);
    c.check();
}

#[test]
fn a_late_overwrite_of_a_page_its_owner_took_out_leaves_the_group_whole() {
    let mut c = Cluster::new();
    for (i, p) in [(0, 1), (1, 2), (2, 3)] {
        c.put(i, p, 1, p as u8, join(4, 5));
    }
    c.ship(4, 5, 4, &[(0, 1), (1, 2), (2, 3)]);
    // The owner gave up on node 0 and rebuilt page 1 elsewhere, removing it from the group
    // with the record it rebuilt.
    let old = c.record(0, 1);
    let remove = netram_proto::Delta {
        owner: netram_proto::Owner::SELF,
        group: 5,
        member: addr(0),
        key: key(1),
        from: 1,
        to: 1,
        kind: netram_proto::DeltaKind::Remove,
        record: old.as_record(),
    };
    c.request(4, Request::ParityDelta(vec![remove]));
    // Node 0 was alive after all and now gets the owner's earlier overwrite in place.
    assert_eq!(c.put(0, 1, 2, 77, ParityOp::Keep), PutStatus::Unprotected);
    assert!(!c.nodes[0].store.tagged(c.nodes[0].h, key(1)));
    let counters = c.nodes[4].store.counters();
    assert_eq!(counters.parity_deltas_stale, 0, "the group is not damaged");
    assert_eq!(counters.parity_deltas_unknown, 1);
    // The group still rebuilds its other members.
    c.down.insert(1);
    assert_eq!(c.reconstruct(4, 1), (key(2), 1, data(2)));
    c.check();
}

#[test]
fn groups_that_share_a_page_do_not_merge() {
    // The owner gave up on node 0 while it stored page 1 after all; the copy it wrote
    // instead is on node 1, in another group.
    let mut c = Cluster::new();
    c.put(0, 1, 1, 1, join(4, 1));
    c.put(1, 1, 1, 1, join(4, 2));
    c.ship(4, 1, 4, &[(0, 1)]);
    c.ship(4, 2, 4, &[(1, 1)]);
    assert_eq!(c.nodes[4].store.held_groups().len(), 2);
    // Deleting the second copy takes it out of its own group, not the other.
    assert_eq!(c.delete(1, 1), DeleteStatus::Deleted);
    c.down.insert(0);
    assert_eq!(c.reconstruct(4, 0), (key(1), 1, data(1)));
    c.check();
}

#[test]
fn a_late_delete_of_a_copy_given_up_on_leaves_the_newer_copy_in_the_group() {
    let mut c = Cluster::new();
    c.put(0, 1, 1, 1, join(4, 5));
    c.put(1, 2, 1, 2, join(4, 5));
    c.ship(4, 5, 4, &[(0, 1), (1, 2)]);
    // The owner gave up on node 0: it took page 1 out of the group with the image it rebuilt,
    // and wrote the page's next version to node 2, in a group the holder merges into group 5.
    let old = c.record(0, 1);
    let remove = netram_proto::Delta {
        owner: netram_proto::Owner::SELF,
        group: 5,
        member: addr(0),
        key: key(1),
        from: 1,
        to: 1,
        kind: netram_proto::DeltaKind::Remove,
        record: old.as_record(),
    };
    c.request(4, Request::ParityDelta(vec![remove]));
    c.put(2, 1, 2, 21, join(4, 6));
    c.ship(4, 6, 4, &[(2, 1)]);
    assert_eq!(c.nodes[4].store.counters().parity_groups_merged, 1);
    // Node 0 was alive after all, and now gets the owner's delete of the old copy.
    assert_eq!(c.delete(0, 1), DeleteStatus::Deleted);
    let counters = c.nodes[4].store.counters();
    assert_eq!(counters.parity_deltas_stale, 0, "the group is not damaged");
    c.down.insert(2);
    assert_eq!(c.reconstruct(4, 2), (key(1), 2, data(21)));
    c.check();
}

#[test]
fn an_overwrite_whose_holder_applied_it_but_was_unheard_leaves_a_damaged_group_a_scan_reports() {
    let mut c = Cluster::new();
    for (i, p) in [(0, 1), (1, 2), (2, 3)] {
        c.put(i, p, 1, p as u8, join(4, 6));
    }
    c.ship(4, 6, 4, &[(0, 1), (1, 2), (2, 3)]);
    // The holder applies node 0's overwrite of page 1, but node 0 never hears back: it stores
    // nothing and tells its client the holder was unreachable.
    let new = data(60);
    let page = Page::seal(key(1), 2, &new);
    let h = c.nodes[0].h;
    let mut out = Vec::new();
    let req = Request::PutParity(vec![(page, ParityOp::Keep)]);
    let Outcome::Forward(fwd) = handle_request(
        &mut c.nodes[0].store,
        h,
        1,
        req,
        0,
        0,
        &mut out,
        store_stats,
    ) else {
        panic!("an overwrite of a member waits for its holder")
    };
    let delta = fwd.deltas[0].1.clone();
    assert_eq!(
        c.nodes[4].store.apply_delta(&delta.as_delta(), from(0)),
        DeltaStatus::Applied
    );
    finish_forward(
        &mut c.nodes[0].store,
        h,
        fwd,
        &[DeltaOutcome::Unreachable],
        0,
        0,
        &mut out,
    );
    match decode_reply(&out).unwrap().1 {
        Reply::Put { status, .. } => assert_eq!(status, [PutStatus::HolderUnreachable]),
        r => panic!("{r:?}"),
    }
    // The group now covers a version 2 that node 0 does not have, and nothing says so yet.
    let nobody = SocketAddr::from(([0, 0, 0, 0], 0));
    let scan = |c: &mut Cluster| {
        let out = c.request(
            4,
            Request::ParityScan {
                dead: nobody,
                max: 8,
            },
        );
        match decode_reply(&out).unwrap().1 {
            Reply::ParityScan {
                groups, orphans, ..
            } => {
                assert!(orphans.is_empty());
                groups
                    .iter()
                    .map(|g| (g.group, g.damaged))
                    .collect::<Vec<_>>()
            }
            r => panic!("{r:?}"),
        }
    };
    assert_eq!(scan(&mut c), []);
    // The client wrote version 2 elsewhere and deletes the copy on node 0: its delta is stale
    // at the holder, which marks the group; a scan that names no dead server reports it.
    assert_eq!(c.delete(0, 1), DeleteStatus::Deleted);
    assert_eq!(c.nodes[4].store.counters().parity_deltas_stale, 1);
    assert_eq!(scan(&mut c), [(6, true)]);
    // Scans about a dead server report it too, whether or not a member was there.
    let out = c.request(
        4,
        Request::ParityScan {
            dead: addr(3),
            max: 8,
        },
    );
    match decode_reply(&out).unwrap().1 {
        Reply::ParityScan { groups, .. } => assert!(groups.len() == 1 && groups[0].damaged),
        r => panic!("{r:?}"),
    }
}

#[test]
fn a_member_and_a_parity_page_compacted_below_a_shrunk_offer_stay_in_their_group() {
    let mut c = Cluster::new();
    // Five plain pages first on nodes 1 and 3, so that the member (on 1) and the group's
    // parity (on 3) land in frame 5; then the plain pages go, leaving frames 0..5 free.
    let plain = |c: &mut Cluster, i: usize, p: u64| {
        let d = data(p as u8);
        let out = c.request(i, Request::Put(vec![Page::seal(key(p), 1, &d)]));
        assert!(matches!(decode_reply(&out).unwrap().1, Reply::Put { .. }));
    };
    for i in [1, 3] {
        for p in 100..105 {
            plain(&mut c, i, p);
        }
    }
    for (i, p) in [(0, 10), (1, 11), (2, 12)] {
        assert_eq!(c.put(i, p, 1, p as u8, join(3, 5)), PutStatus::Stored);
    }
    assert_eq!(
        c.ship(3, 5, 4, &[(0, 10), (1, 11), (2, 12)]),
        PutStatus::Stored
    );
    for i in [1, 3] {
        for p in 100..105 {
            assert_eq!(c.delete(i, p), DeleteStatus::Deleted);
        }
        let s = &mut c.nodes[i].store;
        s.set_offer(5);
        assert_eq!(
            s.pages_beyond_offer(),
            1,
            "node {i}'s frame 5 is above the offer"
        );
        assert_eq!(s.compact(10), 1);
        assert_eq!(s.pages_beyond_offer(), 0);
        assert_eq!(s.take_given_back(), vec![5]);
        s.check_invariants();
    }
    // The member's overwrite still reaches the holder (its tag moved with it), and the
    // group's parity (moved too) still rebuilds every member.
    assert_eq!(c.put(1, 11, 2, 99, ParityOp::Keep), PutStatus::Stored);
    assert_eq!(c.nodes[3].store.counters().parity_deltas_applied, 1);
    for dead in 0..3 {
        let (k, v, d) = c.reconstruct(3, dead);
        let want = [(10, 1, 10u8), (11, 2, 99), (12, 1, 12)][dead];
        assert_eq!(
            (k.page, v, d),
            (want.0, want.1, data(want.2)),
            "member on {dead}"
        );
    }
    assert_eq!(c.delete(1, 11), DeleteStatus::Deleted);
    assert_eq!(c.nodes[3].store.held_groups()[0].2.len(), 2);
    c.check();
}

#[test]
fn a_holder_that_shrank_names_the_groups_above_its_offer_and_they_leave_with_their_members() {
    let mut c = Cluster::new();
    for (i, p) in [(0, 10), (1, 11), (2, 12)] {
        assert_eq!(c.put(i, p, 1, p as u8, join(3, 5)), PutStatus::Stored);
    }
    assert_eq!(
        c.ship(3, 5, 4, &[(0, 10), (1, 11), (2, 12)]),
        PutStatus::Stored
    );
    let scan = |c: &mut Cluster| {
        let out = c.request(
            3,
            Request::ParityScan {
                dead: netram_proto::SCAN_LEAVING,
                max: 8,
            },
        );
        match decode_reply(&out).unwrap().1 {
            Reply::ParityScan {
                groups, orphans, ..
            } => {
                assert!(orphans.is_empty());
                groups
                    .iter()
                    .map(|g| (g.group, g.members.len()))
                    .collect::<Vec<_>>()
            }
            r => panic!("{r:?}"),
        }
    };
    // Below the offer: nothing to name.
    assert_eq!(scan(&mut c), []);
    c.nodes[3].store.set_offer(0);
    assert_eq!(c.nodes[3].store.pages_beyond_offer(), 1);
    assert_eq!(scan(&mut c), [(5, 3)]);
    // The owner writes each member again into a new group held elsewhere: its server takes
    // it out of the old one first (a delta to node 3).
    for (i, p) in [(0, 10), (1, 11), (2, 12)] {
        assert_eq!(c.put(i, p, 2, p as u8, join(4, 6)), PutStatus::Stored);
    }
    assert_eq!(c.nodes[3].store.counters().parity_deltas_applied, 3);
    // The emptied group is freed (its parity all zeros, as the counters check), and its frame
    // is given back.
    assert_eq!(scan(&mut c), []);
    let s = &mut c.nodes[3].store;
    assert_eq!(s.pages_beyond_offer(), 0);
    assert_eq!(s.stored_pages(), 0);
    assert_eq!(s.take_given_back().len(), 1);
    c.check();
}
