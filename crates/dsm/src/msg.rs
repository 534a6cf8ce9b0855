//! The messages of MIRAGE+'s protocol (§2.2) between sites and a segment's library site. The
//! sender of a message is who the transport says it came from (an authenticated connection),
//! never a field of the message.

/// A site: a machine taking part in a segment (its node id).
pub type SiteId = u64;
/// A page of a segment, by index.
pub type PageNo = u32;
/// A request's number at the library, per page, increasing: every message about a request
/// carries it, so that one about another request is recognised and ignored.
pub type Ticket = u64;

/// What a site may do with its copy of a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Access {
    #[default]
    None,
    Read,
    Write,
}

/// What a fault asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Want {
    Read,
    Write,
}

impl Want {
    /// The access that satisfies it.
    pub fn access(self) -> Access {
        match self {
            Want::Read => Access::Read,
            Want::Write => Access::Write,
        }
    }
}

/// One protocol message; `D` is a page's contents (bytes on the wire, a version number in the
/// model).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Msg<D> {
    /// Site → library: a fault on `page` wants `want`.
    Request { page: PageNo, want: Want },
    /// Library → the clock site: send your copy to `to`, which gets `grant`; keep a read copy
    /// if `grant` is `Read` (a writer is downgraded), drop yours if it is `Write`. `wait`:
    /// the sites whose acknowledgements the requester collects before it installs the page
    /// (passed on in the `Page`).
    Send {
        page: PageNo,
        to: SiteId,
        grant: Want,
        ticket: Ticket,
        wait: Vec<SiteId>,
    },
    /// Library → a site holding a copy: drop it, and say so — to the requester `ack_to`
    /// (`Ack`), or to the library when `None` (`Invalidated`).
    Invalidate {
        page: PageNo,
        ticket: Ticket,
        ack_to: Option<SiteId>,
    },
    /// Site → library: dropped.
    Invalidated { page: PageNo, ticket: Ticket },
    /// Site → the requester the library named in its `Invalidate`: dropped.
    Ack { page: PageNo, ticket: Ticket },
    /// Library → a requester collecting acknowledgements: `site` crashed; do not wait for it.
    Excuse {
        page: PageNo,
        ticket: Ticket,
        site: SiteId,
    },
    /// The clock site → the requester: the newest contents, and the access it will have once
    /// every site in `wait` has acknowledged dropping its copy.
    Page {
        page: PageNo,
        grant: Want,
        ticket: Ticket,
        data: D,
        wait: Vec<SiteId>,
    },
    /// Library → a requester that holds the newest copy already (an upgrade): it is the
    /// writer once every site in `wait` has acknowledged dropping its copy.
    Grant {
        page: PageNo,
        ticket: Ticket,
        wait: Vec<SiteId>,
    },
    /// Requester → library: the page is installed; the library may serve the next request.
    Done { page: PageNo, ticket: Ticket },
    /// Library → requester: the page's only copy went with a site that crashed; the request
    /// fails (the process that touches the page is told, never given zeros).
    Lost { page: PageNo, ticket: Ticket },
    /// Library → a requester whose page was coming from a site that crashed: did ticket
    /// `ticket`'s page arrive? (`Done` again if it did, `Missing` if not.)
    Probe { page: PageNo, ticket: Ticket },
    /// Requester → library: ticket `ticket`'s page did not arrive, and will not be taken now.
    Missing { page: PageNo, ticket: Ticket },
    /// Library → the site that sent its write copy away: the requester installed it; drop the
    /// copy kept in case it had not.
    Forget { page: PageNo, ticket: Ticket },
    /// Library → the site that sent its write copy away: the requester crashed before it
    /// installed it; take the write copy back.
    Restore { page: PageNo, ticket: Ticket },
}

impl<D> Msg<D> {
    pub fn page(&self) -> PageNo {
        match self {
            Msg::Request { page, .. }
            | Msg::Send { page, .. }
            | Msg::Invalidate { page, .. }
            | Msg::Invalidated { page, .. }
            | Msg::Ack { page, .. }
            | Msg::Excuse { page, .. }
            | Msg::Page { page, .. }
            | Msg::Grant { page, .. }
            | Msg::Done { page, .. }
            | Msg::Lost { page, .. }
            | Msg::Probe { page, .. }
            | Msg::Missing { page, .. }
            | Msg::Forget { page, .. }
            | Msg::Restore { page, .. } => *page,
        }
    }

    /// The ticket it carries (a request has none yet).
    pub fn ticket(&self) -> Option<Ticket> {
        match self {
            Msg::Request { .. } => None,
            Msg::Send { ticket, .. }
            | Msg::Invalidate { ticket, .. }
            | Msg::Invalidated { ticket, .. }
            | Msg::Ack { ticket, .. }
            | Msg::Excuse { ticket, .. }
            | Msg::Page { ticket, .. }
            | Msg::Grant { ticket, .. }
            | Msg::Done { ticket, .. }
            | Msg::Lost { ticket, .. }
            | Msg::Probe { ticket, .. }
            | Msg::Missing { ticket, .. }
            | Msg::Forget { ticket, .. }
            | Msg::Restore { ticket, .. } => Some(*ticket),
        }
    }

    /// Whether the library is its receiver (else a site is).
    pub fn to_library(&self) -> bool {
        matches!(
            self,
            Msg::Request { .. } | Msg::Invalidated { .. } | Msg::Done { .. } | Msg::Missing { .. }
        )
    }
}
