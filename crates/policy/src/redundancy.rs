//! Redundancy schemes: how a pager instance (an NBD device, a region) keeps its pages alive
//! through the crash of servers (issue 6; Markatos' mirroring, paper 003 §2.1; Nswap's
//! dynamic parity, paper 004 §IV-B and IV-C; Reed-Solomon as today's far-memory systems use
//! it). This module only names the schemes and their arithmetic — how many distinct servers a
//! group spans, how many of them may fail, what a stored page costs — so that placement, the
//! pager and the simulator agree on it; the schemes themselves come with the redundancy work.

use std::fmt;
use std::str::FromStr;

/// A pager instance's redundancy, as the user writes it: `none`, `mirror:N`, `parity:N`,
/// `rs:K+M`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scheme {
    /// One copy: a server's crash loses its pages.
    #[default]
    None,
    /// `copies` copies on distinct servers.
    Mirror { copies: u8 },
    /// One parity page per `group` data pages, all on distinct servers (Nswap's dynamic parity).
    Parity { group: u8 },
    /// `data` data pages and `parity` parity pages on `data + parity` distinct servers; any
    /// `parity` of them may fail.
    ReedSolomon { data: u8, parity: u8 },
}

/// Bounds that keep groups within what a cluster of a few dozen servers can place.
pub const MAX_COPIES: u8 = 8;
pub const MAX_PARITY_GROUP: u8 = 16;
pub const MAX_RS_PIECES: u8 = 32;

impl Scheme {
    /// Distinct servers one group of pages spans.
    pub fn servers_needed(self) -> usize {
        match self {
            Scheme::None => 1,
            Scheme::Mirror { copies } => copies.into(),
            Scheme::Parity { group } => usize::from(group) + 1,
            Scheme::ReedSolomon { data, parity } => usize::from(data) + usize::from(parity),
        }
    }

    /// Servers of a group that may fail without losing a page.
    pub fn failures_tolerated(self) -> usize {
        match self {
            Scheme::None => 0,
            Scheme::Mirror { copies } => usize::from(copies) - 1,
            Scheme::Parity { .. } => 1,
            Scheme::ReedSolomon { parity, .. } => parity.into(),
        }
    }

    /// Cluster memory per stored page, in pages (1.0 without redundancy).
    pub fn pages_per_page(self) -> f64 {
        match self {
            Scheme::None => 1.0,
            Scheme::Mirror { copies } => copies.into(),
            Scheme::Parity { group } => (f64::from(group) + 1.0) / f64::from(group),
            Scheme::ReedSolomon { data, parity } => {
                (f64::from(data) + f64::from(parity)) / f64::from(data)
            }
        }
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scheme::None => write!(f, "none"),
            Scheme::Mirror { copies } => write!(f, "mirror:{copies}"),
            Scheme::Parity { group } => write!(f, "parity:{group}"),
            Scheme::ReedSolomon { data, parity } => write!(f, "rs:{data}+{parity}"),
        }
    }
}

/// Why a redundancy the user wrote is refused; each says what would be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseSchemeError {
    #[error("unknown redundancy {0:?}: expected none, mirror:N, parity:N or rs:K+M")]
    Unknown(String),
    #[error("{scheme:?}: {what} must be a small number, not {value:?}")]
    NotANumber {
        scheme: String,
        what: &'static str,
        value: String,
    },
    #[error("{0:?}: mirror needs 2 to {MAX_COPIES} copies (mirror:1 is none)")]
    Copies(String),
    #[error("{0:?}: parity needs 2 to {MAX_PARITY_GROUP} data pages per parity page")]
    Group(String),
    #[error("{0:?}: Reed-Solomon is written rs:K+M, e.g. rs:4+2")]
    RsForm(String),
    #[error("{0:?}: rs:K+M needs K ≥ 1, M ≥ 1 and K + M ≤ {MAX_RS_PIECES}")]
    RsPieces(String),
}

impl FromStr for Scheme {
    type Err = ParseSchemeError;

    fn from_str(s: &str) -> Result<Self, ParseSchemeError> {
        let num = |v: &str, what: &'static str| -> Result<u8, ParseSchemeError> {
            v.parse::<u8>().map_err(|_| ParseSchemeError::NotANumber {
                scheme: s.to_owned(),
                what,
                value: v.to_owned(),
            })
        };
        if s == "none" {
            return Ok(Scheme::None);
        }
        let (kind, arg) = s
            .split_once(':')
            .ok_or_else(|| ParseSchemeError::Unknown(s.to_owned()))?;
        match kind {
            "mirror" => {
                let copies = num(arg, "the number of copies")?;
                if !(2..=MAX_COPIES).contains(&copies) {
                    return Err(ParseSchemeError::Copies(s.to_owned()));
                }
                Ok(Scheme::Mirror { copies })
            }
            "parity" => {
                let group = num(arg, "the group size")?;
                if !(2..=MAX_PARITY_GROUP).contains(&group) {
                    return Err(ParseSchemeError::Group(s.to_owned()));
                }
                Ok(Scheme::Parity { group })
            }
            "rs" => {
                let (k, m) = arg
                    .split_once('+')
                    .ok_or_else(|| ParseSchemeError::RsForm(s.to_owned()))?;
                let (data, parity) = (num(k, "K")?, num(m, "M")?);
                if data == 0
                    || parity == 0
                    || u16::from(data) + u16::from(parity) > MAX_RS_PIECES.into()
                {
                    return Err(ParseSchemeError::RsPieces(s.to_owned()));
                }
                Ok(Scheme::ReedSolomon { data, parity })
            }
            _ => Err(ParseSchemeError::Unknown(s.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_issue_s_schemes_and_their_arithmetic() {
        let rs: Scheme = "rs:4+2".parse().unwrap();
        assert_eq!(rs, Scheme::ReedSolomon { data: 4, parity: 2 });
        assert_eq!(rs.servers_needed(), 6);
        assert_eq!(rs.failures_tolerated(), 2);
        assert!((rs.pages_per_page() - 1.5).abs() < 1e-9);
        let p: Scheme = "parity:4".parse().unwrap();
        assert_eq!((p.servers_needed(), p.failures_tolerated()), (5, 1));
        assert!((p.pages_per_page() - 1.25).abs() < 1e-9);
        let m: Scheme = "mirror:2".parse().unwrap();
        assert_eq!((m.servers_needed(), m.failures_tolerated()), (2, 1));
        assert_eq!(m.pages_per_page(), 2.0);
        assert_eq!("none".parse::<Scheme>().unwrap().failures_tolerated(), 0);
    }

    #[test]
    fn bad_schemes_are_refused_with_a_reason() {
        for (bad, why) in [
            ("mirror:1", "mirror:1 is none"),
            ("mirror:x", "small number"),
            ("parity:1", "2 to 16"),
            ("rs:4", "rs:K+M"),
            ("rs:0+2", "K ≥ 1"),
            ("rs:30+3", "K + M ≤ 32"),
            ("raid5", "expected none"),
            ("", "expected none"),
        ] {
            let e = bad.parse::<Scheme>().unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    proptest! {
        #[test]
        fn display_parses_back(kind in 0u8..4, a in 1u8..40, b in 1u8..40) {
            let text = match kind {
                0 => "none".to_string(),
                1 => format!("mirror:{a}"),
                2 => format!("parity:{a}"),
                _ => format!("rs:{a}+{b}"),
            };
            if let Ok(s) = text.parse::<Scheme>() {
                prop_assert_eq!(s.to_string(), text);
                prop_assert!(s.failures_tolerated() < s.servers_needed());
            }
        }
    }
}
