//! netram's wire protocol: what a client and a page server say to each other over one TCP stream.
//!
//! This crate only turns messages into bytes and bytes into messages; it never touches a socket,
//! so the daemon, the simulator and the fuzzer all run the same decoder.
//!
//! The protocol is the user-space TCP counterpart of Distributed Anemone's RMAP (paper 001, §2.3)
//! and of Nswap's paging messages (paper 004, §III):
//!
//! * a versioned [handshake]: the client says who it is (node id, boot incarnation,
//!   session id), the server answers with its capacity, the lease period and the credit window;
//! * then length-prefixed [frames](message), each with a request id, so that one connection carries
//!   many requests in flight and replies may come back out of order. The credit window (Anemone's
//!   RMAP window) bounds how many requests a client may have outstanding on one connection;
//! * every reply piggy-backs the server's free capacity and request load (Anemone §2.4), which the
//!   client's placement policy reads;
//! * every page travels in an [envelope](page) with a crc32c that the *client* computes over the key,
//!   the version and the data, and checks on the way back, so that neither the network nor a
//!   server can corrupt or misplace a page unnoticed. The envelope has room for an AEAD tag.
//!
//! All integers are little-endian, written and read with `to_le_bytes`/`from_le_bytes`; nothing is
//! cast from host memory. Every decoder checks lengths before it allocates, so a hostile peer
//! cannot make the daemon allocate more than one frame's worth of memory, and returns a
//! [`DecodeError`] instead of panicking: the daemon closes that one connection and logs the reason.

mod codec;
pub mod compress;
pub mod dsm;
pub mod gms;
pub mod handshake;
pub mod message;
pub mod page;
pub mod parity;

pub use codec::{DecodeError, FrameBuilder};
pub use handshake::{
    Hello, Welcome, WelcomeStatus, HELLO_END_ON_CLOSE, HELLO_LEN, HELLO_SEALED_PAGES, WELCOME_LEN,
};
pub use message::{
    begin_get_reply, decode_reply, decode_request, frame_len, get_reply_data, get_reply_found,
    get_reply_missing, get_reply_tail, Counter, DeleteStatus, ErrorCode, GetResult, Kind, Load,
    MoveStatus, PutStatus, Reply, Request, SCAN_LEAVING,
};
pub use page::{expand_into, page_checksum, trim, Page, PageFlags, PageKey, ENVELOPE_LEN, TAG_LEN};
pub use parity::{
    Delta, DeltaKind, DeltaStatus, GroupRecord, Member, OwnedRecord, Owner, ParityOp, Record,
    MAX_GROUP_MEMBERS,
};

/// The size of every page netram moves: the x86-64 and arm64 base page.
pub const PAGE_SIZE: usize = 4096;

/// Eight bytes that open every handshake, so that a stray connection (an HTTP probe, an NBD
/// client on the wrong port) is told apart from a netram peer before anything else is read.
pub const MAGIC: [u8; 8] = *b"NETRAM\r\n";

/// The handshake's protocol version. A server answers a version it does not speak with
/// [`WelcomeStatus::VersionUnsupported`] and its own version, then closes. 2: a page travels
/// without its zero tail and its checksum is over what is left ([`page::trim`]).
pub const PROTOCOL_VERSION: u16 = 2;

/// The version byte in every frame header; bumped when the frame layout changes.
pub const FRAME_VERSION: u8 = 5;

/// Bytes of the frame header: length (u32), version (u8), kind (u8), flags (u16), request id (u64).
pub const FRAME_HEADER_LEN: usize = 16;

/// The most pages one batched PUT, GET or DELETE may carry.
pub const MAX_BATCH: usize = 128;

/// The largest frame either side accepts, header included. A full batch of pages fits with room
/// to spare; anything larger is refused before its body is read.
pub const MAX_FRAME_LEN: usize = 1 << 20;

/// Identifies one client machine (Nswap: its IP address). Stable across restarts.
pub type NodeId = u64;
