//! Agents of several "machines" in one process, each with its own copy of a segment and its
//! own mappings of it (each with its own userfaultfd, as separate processes would have),
//! joined by a network of channels. Threads load and store through the mappings as programs
//! would; the checks are on what they read.

use netram_dsm::SiteId;
use netram_shm::{Agent, Door, Mapped, Meta, Role, Running, SegmentId, View};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PAGE: usize = netram_proto::PAGE_SIZE;
const SEG: SegmentId = 0x5e6;

/// Agents 1..=n joined by channels; agent 1 creates the segment and is its library.
struct Cluster {
    agents: Vec<Running>,
    doors: Arc<Mutex<HashMap<SiteId, Door>>>,
}

impl Cluster {
    fn new(n: u64, pages: u32, delta_ms: u32) -> Cluster {
        let doors: Arc<Mutex<HashMap<SiteId, Door>>> = Arc::default();
        let mut agents = Vec::new();
        for me in 1..=n {
            let net_doors = doors.clone();
            let net = Box::new(move |to: SiteId, frame: Vec<u8>| {
                let door = net_doors.lock().unwrap().get(&to).cloned();
                if let Some(d) = door {
                    d.deliver(me, frame);
                }
            });
            let running = Running::start(Agent::new(me, net)).unwrap();
            doors.lock().unwrap().insert(me, running.door());
            agents.push(running);
        }
        let c = Cluster { agents, doors };
        let meta = Meta {
            pages,
            delta_ms,
            uid: 0,
            mode: 0o600,
        };
        c.door(1)
            .call(move |a| a.add(SEG, "test", meta, Role::Library(None)).map(|_| ()))
            .unwrap()
            .unwrap();
        // The others find it by name, as a process attaching it would.
        let members: Vec<SiteId> = (1..=n).collect();
        for me in 2..=n {
            let members = members.clone();
            let (tx, rx) = std::sync::mpsc::channel();
            c.door(me)
                .call(move |a| a.lookup("test", &members, Duration::from_secs(5), tx))
                .unwrap();
            let found = rx.recv().unwrap().unwrap();
            assert_eq!((found.segment, found.meta, found.library), (SEG, meta, 1));
            c.door(me)
                .call(move |a| {
                    a.add(SEG, "test", meta, Role::Site(found.library))
                        .map(|_| ())
                })
                .unwrap()
                .unwrap();
        }
        c
    }

    fn door(&self, site: SiteId) -> Door {
        self.doors.lock().unwrap()[&site].clone()
    }

    /// A new mapping of the segment at `site`, as a new process there would make.
    fn map(&self, site: SiteId) -> Mapped {
        let door = self.door(site);
        let (fd, pages) = door
            .call(|a| {
                let c = a.copy(SEG).unwrap();
                (c.fd().try_clone().unwrap(), c.pages())
            })
            .unwrap();
        let mut m = Mapped::new(&fd, pages).unwrap();
        let view = View {
            uffd: m.take_uffd().unwrap(),
            base: m.ptr as usize,
            pages,
            pid: std::process::id(),
            number: 0,
        };
        door.call(move |a| a.add_view(SEG, view).map(drop))
            .unwrap()
            .unwrap();
        m
    }

    fn counters(&self, site: SiteId) -> netram_shm::Counters {
        self.door(site).call(|a| a.counters.clone()).unwrap()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.doors.lock().unwrap().clear();
        for a in self.agents.drain(..) {
            a.stop();
        }
    }
}

/// The word `i` of a mapping, as an atomic (the threads share it as programs share memory).
fn word(m: &Mapped, i: usize) -> &AtomicU64 {
    assert!((i + 1) * 8 <= m.len);
    // SAFETY: an aligned u64 inside the live mapping, accessed only atomically by the tests.
    unsafe { &*(m.ptr.add(i * 8) as *const AtomicU64) }
}

/// Two sites take turns incrementing one counter (each waits for its parity, then adds one):
/// every increment needs the page to move with the latest value, so a lost or stale write
/// shows as a count that stops or comes out wrong.
#[test]
fn two_sites_take_turns_on_one_word() {
    let c = Cluster::new(2, 4, 0);
    let rounds = 300u64;
    let maps: Vec<Mapped> = (1..=2).map(|s| c.map(s)).collect();
    std::thread::scope(|s| {
        for (i, m) in maps.iter().enumerate() {
            let w = word(m, 0);
            s.spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(60);
                for _ in 0..rounds {
                    loop {
                        let v = w.load(Ordering::SeqCst);
                        if v % 2 == i as u64 {
                            w.store(v + 1, Ordering::SeqCst);
                            break;
                        }
                        assert!(Instant::now() < deadline, "stuck at {v}");
                        std::hint::spin_loop();
                    }
                }
            });
        }
    });
    for m in &maps {
        assert_eq!(word(m, 0).load(Ordering::SeqCst), 2 * rounds);
    }
    let (a, b) = (c.counters(1), c.counters(2));
    assert!(a.pages_sent + b.pages_sent >= rounds, "{a:?} {b:?}");
    assert_eq!(a.frames_refused + b.frames_refused, 0);
}

/// Readers on three sites hold copies; a write on one invalidates the others, which then read
/// the new value; two mappings at one site (two processes of one machine) share one copy.
#[test]
fn a_write_invalidates_every_reader_and_a_machine_shares_its_copy() {
    let c = Cluster::new(3, 8, 0);
    let m1 = c.map(1);
    let m2 = c.map(2);
    let m2b = c.map(2);
    let m3 = c.map(3);
    let at = 3 * PAGE / 8; // page 3
    assert_eq!(word(&m1, at).load(Ordering::SeqCst), 0);
    assert_eq!(word(&m2, at).load(Ordering::SeqCst), 0);
    assert_eq!(word(&m3, at).load(Ordering::SeqCst), 0);
    assert_eq!(word(&m2b, at).load(Ordering::SeqCst), 0);
    word(&m3, at).store(42, Ordering::SeqCst);
    for m in [&m1, &m2, &m2b, &m3] {
        assert_eq!(word(m, at).load(Ordering::SeqCst), 42);
    }
    // A store through one process of site 2 is seen by the other at once (one copy).
    word(&m2, at + 1).store(7, Ordering::SeqCst);
    assert_eq!(word(&m2b, at + 1).load(Ordering::SeqCst), 7);
    assert_eq!(word(&m1, at + 1).load(Ordering::SeqCst), 7);
    assert_eq!(word(&m3, at).load(Ordering::SeqCst), 42);
    let sent: u64 = (1..=3).map(|s| c.counters(s).invalidated).sum();
    assert!(sent >= 3, "invalidations carried out: {sent}");
    // Pages never written travel as zero pages.
    assert_eq!(word(&m3, 7 * PAGE / 8).load(Ordering::SeqCst), 0);
    assert!(c.counters(1).zero_pages_sent >= 1);
}

/// Randomized: threads on three sites add to and load random words of a few pages. A word
/// only grows, so each thread checks it never reads a value below one it read or made before
/// (per-location order), and at the end every site sees each word equal to the number of
/// additions made to it (no store lost, none applied to a copy that was not the write copy).
#[test]
fn random_adds_and_loads_lose_nothing_and_keep_each_word_in_order() {
    let sites = 3u64;
    let words = 4 * PAGE / 8;
    let c = Cluster::new(sites, 4, 0);
    let maps: Vec<Mapped> = (1..=sites).map(|s| c.map(s)).collect();
    let ops = 3000u64;
    let added: Vec<Vec<u64>> = std::thread::scope(|s| {
        let threads: Vec<_> = maps
            .iter()
            .enumerate()
            .map(|(t, m)| {
                s.spawn(move || {
                    let mut rng = fastrand::Rng::with_seed(t as u64 + 1);
                    let mut seen = vec![0u64; words];
                    let mut added = vec![0u64; words];
                    for _ in 0..ops {
                        // Eight hot words, two to a page, so that pages move and a page's
                        // other word changes under a reader.
                        let i = rng.usize(..8) * (PAGE / 16);
                        let w = word(m, i);
                        let v = if rng.u8(..3) == 0 {
                            added[i] += 1;
                            w.fetch_add(1, Ordering::SeqCst) + 1
                        } else {
                            w.load(Ordering::SeqCst)
                        };
                        assert!(v >= seen[i], "word {i}: read {v} after {}", seen[i]);
                        seen[i] = v;
                    }
                    added
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for i in 0..words {
        let total: u64 = added.iter().map(|a| a[i]).sum();
        for m in &maps {
            assert_eq!(word(m, i).load(Ordering::SeqCst), total, "word {i}");
        }
    }
}

/// A name nobody created is absent once every member has said so; a member that does not
/// answer is named when the wait is over.
#[test]
fn a_name_nobody_created_is_absent() {
    let c = Cluster::new(3, 1, 0);
    let ask = |members: Vec<SiteId>| {
        let (tx, rx) = std::sync::mpsc::channel();
        c.door(2)
            .call(move |a| a.lookup("nothing", &members, Duration::from_millis(300), tx))
            .unwrap();
        rx.recv_timeout(Duration::from_secs(5)).unwrap()
    };
    assert_eq!(ask(vec![1, 2, 3]), Err(vec![]));
    assert_eq!(ask(vec![1, 3, 9]), Err(vec![9]));
}

/// A process that detaches and attaches again has two views of one segment at the agent for
/// a moment: the old one's going must not take the new one (it did when views went by
/// process: the new mapping then lost its userfaultfd and read holes as zeros, 1 run in 60
/// of the System V matrix multiply).
#[test]
fn an_old_view_going_leaves_the_new_one_of_the_same_process() {
    let c = Cluster::new(2, 2, 0);
    let old = c.map(2);
    let new = c.map(2);
    c.door(2).call(|a| a.drop_view_by_number(SEG, 1)).unwrap();
    drop(old);
    let m1 = c.map(1);
    word(&m1, 0).store(99, Ordering::SeqCst);
    // Site 2's remaining view must fault for the page, not read its hole as zero.
    assert_eq!(word(&new, 0).load(Ordering::SeqCst), 99);
    assert_eq!(c.counters(2).views_lost, 0);
}
