//! The NBD parsers, fed what a hostile client could send: option headers, INFO/GO and
//! meta-context data, transmission requests. They return a value or an error, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use netram_nbd::wire::*;

fuzz_target!(|data: &[u8]| {
    let option = data.first().copied().unwrap_or(0) as u32;
    let _ = parse_info_request(option, data);
    let _ = parse_meta_context_request(option, data);
    if let Some(b) = data.get(..4) {
        let _ = parse_client_flags(b.try_into().unwrap());
    }
    if let Some(b) = data.get(..OPTION_HEADER_LEN) {
        if let Ok((_, len)) = parse_option_header(b.try_into().unwrap(), 65536) {
            assert!(len <= 65536);
        }
    }
    if let Some(b) = data.get(..REQUEST_LEN) {
        let _ = parse_request(b.try_into().unwrap());
    }
});
