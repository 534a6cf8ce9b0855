//! How a pager's operations fail: pages lost with a dead server (Nswap §IV: the loss is named,
//! never silent), corrupt pages (never returned as data), bad arguments, the local disk.

use netram_proto::PAGE_SIZE;

/// Pages that could not be read because the server holding them is dead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostPages {
    pub server: String,
    pub reason: String,
    pub pages: Vec<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum PagerError {
    /// The servers that held these pages are dead and there is no other copy.
    #[error("{}", lost_message(.0))]
    Lost(Vec<LostPages>),
    /// A page came back with a checksum or version that does not match, and there is no other
    /// copy. The data was not returned.
    #[error("page {page} from server {server} is corrupt ({what}); no other copy exists")]
    Corrupt {
        server: String,
        page: u64,
        what: &'static str,
    },
    #[error("page {page} is out of range: this pager has {pages} pages")]
    OutOfRange { page: u64, pages: u64 },
    #[error("buffer of {got} bytes for {pages} pages: expected {} bytes", .pages * PAGE_SIZE)]
    BadBuffer { got: usize, pages: usize },
    #[error("local disk: {0}")]
    Disk(#[from] std::io::Error),
    /// A server could not be added ([`crate::Pager::add_server`]).
    #[error("cannot use a new server: {0}")]
    AddServer(String),
}

fn lost_message(lost: &[LostPages]) -> String {
    lost.iter()
        .map(|l| {
            let shown: Vec<String> = l.pages.iter().take(8).map(u64::to_string).collect();
            let more = if l.pages.len() > 8 {
                format!(" and {} more", l.pages.len() - 8)
            } else {
                String::new()
            };
            format!(
                "{} page(s) lost with dead server {} ({}): pages {}{more}",
                l.pages.len(),
                l.server,
                l.reason,
                shown.join(", ")
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}
