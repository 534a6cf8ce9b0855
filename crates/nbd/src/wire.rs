//! The NBD wire format (<https://github.com/NetworkBlockDevice/nbd/blob/master/doc/proto.md>):
//! constants, and I/O-free parsing of what a client sends and encoding of what the server
//! answers. All integers are big-endian (network order), written with `to_be_bytes`.

use thiserror::Error;

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054; // "IHAVEOPT"
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const CLIENT_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const CLIENT_NO_ZEROES: u32 = 1 << 1;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

// Option replies.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = (1 << 31) | 1;
pub const REP_ERR_POLICY: u32 = (1 << 31) | 2;
pub const REP_ERR_INVALID: u32 = (1 << 31) | 3;
pub const REP_ERR_TLS_REQD: u32 = (1 << 31) | 5;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) | 6;

// Info types.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_DF: u16 = 1 << 7;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// Commands and their flags.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Structured reply chunk types and flags.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;

// Block status flags of base:allocation.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// Error numbers on the wire (NBD's own values, which match Linux errno).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Errno {
    Perm = 1,
    Io = 5,
    NoMem = 12,
    Inval = 22,
    NoSpc = 28,
    Overflow = 75,
    NotSup = 95,
    Shutdown = 108,
}

pub const REQUEST_LEN: usize = 28;
pub const OPTION_HEADER_LEN: usize = 16;

/// Why bytes from a client cannot be understood; the connection is closed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    #[error("unknown client flags {0:#x}")]
    ClientFlags(u32),
    #[error("option data of {0} bytes is larger than allowed")]
    OptionTooLarge(u32),
    #[error("malformed option {option}: {why}")]
    BadOption { option: u32, why: &'static str },
}

/// The client's flags after the server's greeting.
pub fn parse_client_flags(b: [u8; 4]) -> Result<u32, WireError> {
    let flags = u32::from_be_bytes(b);
    if flags & !(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES) != 0 {
        return Err(WireError::ClientFlags(flags));
    }
    Ok(flags)
}

/// The header of one option: (option, length of its data).
pub fn parse_option_header(
    b: &[u8; OPTION_HEADER_LEN],
    max_len: u32,
) -> Result<(u32, u32), WireError> {
    let magic = u64::from_be_bytes(b[0..8].try_into().expect("8 bytes"));
    if magic != IHAVEOPT {
        return Err(WireError::BadMagic(magic));
    }
    let option = u32::from_be_bytes(b[8..12].try_into().expect("4 bytes"));
    let len = u32::from_be_bytes(b[12..16].try_into().expect("4 bytes"));
    if len > max_len {
        return Err(WireError::OptionTooLarge(len));
    }
    Ok((option, len))
}

/// The data of NBD_OPT_INFO and NBD_OPT_GO: an export name and the info types asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub requests: Vec<u16>,
}

fn be32(d: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(d.get(at..at + 4)?.try_into().ok()?))
}
fn be16(d: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(d.get(at..at + 2)?.try_into().ok()?))
}

/// The export name that opens INFO, GO and meta-context option data; returns it and where the
/// rest of the data starts.
fn export_name(option: u32, d: &[u8]) -> Result<(String, usize), WireError> {
    let bad = |why| WireError::BadOption { option, why };
    let len = be32(d, 0).ok_or(bad("no export name length"))? as usize;
    let name = d
        .get(4..4 + len)
        .ok_or(bad("export name runs past the data"))?;
    let name = String::from_utf8(name.to_vec()).map_err(|_| bad("export name is not UTF-8"))?;
    Ok((name, 4 + len))
}

pub fn parse_info_request(option: u32, d: &[u8]) -> Result<InfoRequest, WireError> {
    let bad = |why| WireError::BadOption { option, why };
    let (name, at) = export_name(option, d)?;
    let n = be16(d, at).ok_or(bad("no count of info requests"))? as usize;
    if d.len() != at + 2 + 2 * n {
        return Err(bad("info request count does not match the data"));
    }
    let requests = (0..n)
        .map(|i| be16(d, at + 2 + 2 * i).expect("length checked"))
        .collect();
    Ok(InfoRequest { name, requests })
}

/// The data of NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    pub name: String,
    pub queries: Vec<String>,
}

pub fn parse_meta_context_request(option: u32, d: &[u8]) -> Result<MetaContextRequest, WireError> {
    let bad = |why| WireError::BadOption { option, why };
    let name_len = be32(d, 0).ok_or(bad("no export name length"))? as usize;
    let name = d
        .get(4..4 + name_len)
        .ok_or(bad("export name runs past the data"))?;
    let name = String::from_utf8(name.to_vec()).map_err(|_| bad("export name is not UTF-8"))?;
    let mut at = 4 + name_len;
    let n = be32(d, at).ok_or(bad("no count of queries"))? as usize;
    at += 4;
    let mut queries = Vec::new();
    for _ in 0..n {
        let len = be32(d, at).ok_or(bad("query length runs past the data"))? as usize;
        let q = d
            .get(at + 4..at + 4 + len)
            .ok_or(bad("query runs past the data"))?;
        queries.push(String::from_utf8(q.to_vec()).map_err(|_| bad("query is not UTF-8"))?);
        at += 4 + len;
    }
    if at != d.len() {
        return Err(bad("trailing bytes"));
    }
    Ok(MetaContextRequest { name, queries })
}

/// One transmission-phase request (28 bytes; a WRITE's data follows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub len: u32,
}

pub fn parse_request(b: &[u8; REQUEST_LEN]) -> Result<Request, WireError> {
    let magic = u32::from_be_bytes(b[0..4].try_into().expect("4 bytes"));
    if magic != REQUEST_MAGIC {
        return Err(WireError::BadMagic(magic.into()));
    }
    Ok(Request {
        flags: u16::from_be_bytes(b[4..6].try_into().expect("2 bytes")),
        kind: u16::from_be_bytes(b[6..8].try_into().expect("2 bytes")),
        cookie: u64::from_be_bytes(b[8..16].try_into().expect("8 bytes")),
        offset: u64::from_be_bytes(b[16..24].try_into().expect("8 bytes")),
        len: u32::from_be_bytes(b[24..28].try_into().expect("4 bytes")),
    })
}

/// Appends an option reply.
pub fn option_reply(out: &mut Vec<u8>, option: u32, kind: u32, data: &[u8]) {
    out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// Appends a simple reply header (a READ's data follows it).
pub fn simple_reply(out: &mut Vec<u8>, cookie: u64, error: u32) {
    out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
}

/// Appends a structured reply chunk header for a payload of `len` bytes.
pub fn chunk_header(out: &mut Vec<u8>, cookie: u64, flags: u16, kind: u16, len: u32) {
    out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

/// Appends a structured error chunk (the last of its reply).
pub fn error_chunk(out: &mut Vec<u8>, cookie: u64, error: Errno, message: &str) {
    let m = &message.as_bytes()[..message.len().min(4096)];
    chunk_header(
        out,
        cookie,
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        6 + m.len() as u32,
    );
    out.extend_from_slice(&(error as u32).to_be_bytes());
    out.extend_from_slice(&(m.len() as u16).to_be_bytes());
    out.extend_from_slice(m);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever a client sends, the parsers return a value or an error, never panic.
        #[test]
        fn parsers_never_panic(d in prop::collection::vec(any::<u8>(), 0..300), option: u32) {
            let _ = parse_info_request(option, &d);
            let _ = parse_meta_context_request(option, &d);
            if d.len() >= REQUEST_LEN {
                let _ = parse_request(d[..REQUEST_LEN].try_into().unwrap());
            }
            if d.len() >= OPTION_HEADER_LEN {
                let _ = parse_option_header(d[..OPTION_HEADER_LEN].try_into().unwrap(), 65536);
            }
        }

        #[test]
        fn info_requests_round_trip(name in "[a-z]{0,20}", reqs in prop::collection::vec(any::<u16>(), 0..6)) {
            let mut d = (name.len() as u32).to_be_bytes().to_vec();
            d.extend_from_slice(name.as_bytes());
            d.extend_from_slice(&(reqs.len() as u16).to_be_bytes());
            for r in &reqs { d.extend_from_slice(&r.to_be_bytes()); }
            prop_assert_eq!(parse_info_request(OPT_GO, &d).unwrap(), InfoRequest { name, requests: reqs });
        }
    }

    #[test]
    fn requests_parse_big_endian() {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&CMD_FLAG_FUA.to_be_bytes());
        b[6..8].copy_from_slice(&CMD_WRITE.to_be_bytes());
        b[8..16].copy_from_slice(&7u64.to_be_bytes());
        b[16..24].copy_from_slice(&4096u64.to_be_bytes());
        b[24..28].copy_from_slice(&512u32.to_be_bytes());
        let r = parse_request(&b).unwrap();
        assert_eq!(
            (r.flags, r.kind, r.cookie, r.offset, r.len),
            (CMD_FLAG_FUA, CMD_WRITE, 7, 4096, 512)
        );
        b[0] ^= 1;
        assert!(matches!(parse_request(&b), Err(WireError::BadMagic(_))));
    }

    #[test]
    fn meta_context_queries_parse_and_lies_are_caught() {
        let mut d = 0u32.to_be_bytes().to_vec();
        d.extend_from_slice(&1u32.to_be_bytes());
        d.extend_from_slice(&15u32.to_be_bytes());
        d.extend_from_slice(b"base:allocation");
        let m = parse_meta_context_request(OPT_SET_META_CONTEXT, &d).unwrap();
        assert_eq!(m.queries, vec!["base:allocation".to_string()]);
        d[7] = 9; // nine queries announced, one present
        assert!(parse_meta_context_request(OPT_SET_META_CONTEXT, &d).is_err());
    }
}
