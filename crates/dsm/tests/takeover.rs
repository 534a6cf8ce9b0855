//! The library's crash, step by step (the model check, `model.rs`, covers every
//! interleaving; these are the cases by name): the survivors' reports, the directory rebuilt
//! from them, and the crashed library's time refused.

use netram_dsm::{Access, Fault, Library, Msg, Site, Want};

fn page(ticket: u64, grant: Want, data: u32) -> Msg<u32> {
    Msg::Page {
        page: 0,
        grant,
        ticket,
        data,
        wait: vec![],
    }
}

/// Site 2 holds the write copy it got from site 3 (which kept it: its Forget was lost with
/// the library, site 1): the write copy is the page, site 3's kept copy is forgotten; a page
/// nobody reported went with the library.
#[test]
fn a_write_copy_is_the_page_and_what_nobody_holds_is_lost() {
    let mut s2: Site<u32> = Site::new(2, 1, false, 0);
    let mut s3: Site<u32> = Site::new(3, 1, false, 0);
    assert!(matches!(s3.fault(0, Want::Write), Fault::Ask(1, _)));
    s3.on_msg(1, page(1, Want::Write, 10), 0);
    s3.accessed(0);
    assert!(matches!(s2.fault(0, Want::Write), Fault::Ask(1, _)));
    let send = Msg::Send {
        page: 0,
        to: 2,
        grant: Want::Write,
        ticket: 2,
        wait: vec![],
    };
    let (out, _) = s3.on_msg(1, send, 1);
    let (_, Msg::Page { data, .. }) = out[0].clone() else {
        panic!("{out:?}")
    };
    s2.on_msg(3, page(2, Want::Write, data), 2);
    assert!(s3.has_ghost(0));

    let reports = vec![(2, s2.library_down()), (3, s3.library_down())];
    let (lib, out) = Library::rebuild::<u32>(2, &reports, [2, 3]);
    assert_eq!(lib.holders(0), (2, Access::Write, vec![2]));
    assert_eq!(out, [(3, Msg::Forget { page: 0, ticket: 2 })]);
    assert!(lib.lost(1), "a page nobody reported went with the library");
    assert_eq!(lib.era(), 1);
}

/// Nobody holds the page, and site 3 keeps the write copy it sent to site 4, which crashed
/// with the library before installing it: given back to site 3. A page of the crashed
/// library's time that arrives after the report is refused, and faults wait for the new
/// library, then ask it.
#[test]
fn a_kept_copy_nobody_installed_is_given_back() {
    let mut s3: Site<u32> = Site::new(3, 1, false, 0);
    let mut s2: Site<u32> = Site::new(2, 1, false, 0);
    assert!(matches!(s3.fault(0, Want::Write), Fault::Ask(1, _)));
    s3.on_msg(1, page(1, Want::Write, 10), 0);
    s3.accessed(0);
    let send = Msg::Send {
        page: 0,
        to: 4,
        grant: Want::Write,
        ticket: 5,
        wait: vec![],
    };
    s3.on_msg(1, send, 1);
    assert!(matches!(s2.fault(0, Want::Read), Fault::Ask(1, _)));

    let reports = vec![(2, s2.library_down()), (3, s3.library_down())];
    // Site 2's read, ordered by the crashed library, arrives now: refused.
    let late = page(6, Want::Read, 10);
    assert_eq!(s2.on_msg(3, late, 2), (vec![], None));
    assert_eq!(s2.fault(0, Want::Read), Fault::Wait);

    let (lib, out) = Library::rebuild::<u32>(2, &reports, [2, 3]);
    assert_eq!(lib.holders(0), (3, Access::Write, vec![3]));
    assert_eq!(out, [(3, Msg::Restore { page: 0, ticket: 5 })]);
    for s in [&mut s2, &mut s3] {
        s.new_library(2, lib.era());
    }
    s3.on_msg(2, Msg::Restore { page: 0, ticket: 5 }, 3);
    assert_eq!(s3.take_restored(), [0]);
    assert_eq!(s3.access(0), Access::Write);
    assert!(matches!(s2.fault(0, Want::Read), Fault::Ask(2, _)));
}
