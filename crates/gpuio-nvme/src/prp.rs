//! Physical Region Page entries: how a command names the memory it moves.
//!
//! PRP1 is the transfer's first byte (any dword-aligned address); each further memory page is
//! named by its page-aligned address. A transfer that touches two pages puts the second in
//! PRP2; one that touches more puts a PRP list's address in PRP2, the list holding the second
//! page onwards. This driver keeps each list in one page (512 entries, no chaining), so one
//! command moves at most [`MAX_TRANSFER`] bytes; larger requests are split by the caller.

use super::spec::PAGE;
use gpuio_hal::error::{HalError, Result};

/// Entries in one PRP list page.
pub const LIST_ENTRIES: usize = PAGE / 8;

/// The most one command moves with a single-page PRP list: 2 MiB touches at most 513 pages
/// (PRP1's, then 512 listed), however its start is aligned.
pub const MAX_TRANSFER: usize = LIST_ENTRIES * PAGE;

/// Where PRP2 points.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prp2 {
    /// The transfer stays in PRP1's page: PRP2 is unused (0).
    Unused,
    /// The transfer's second (and last) page.
    Page(u64),
    /// These page addresses, to be written into a PRP list page whose address goes in PRP2.
    List(Vec<u64>),
}

/// The PRP entries for `len` bytes at IO address `iova`: PRP1 and what PRP2 holds.
pub fn entries(iova: u64, len: usize) -> Result<(u64, Prp2)> {
    if len == 0 || !iova.is_multiple_of(4) {
        return Err(HalError::InvalidArgument(format!(
            "an NVMe transfer needs a dword-aligned address and a length (got {iova:#x}, {len} bytes)"
        )));
    }
    if len > MAX_TRANSFER {
        return Err(HalError::InvalidArgument(format!(
            "{len} bytes is more than one NVMe command moves here ({MAX_TRANSFER})"
        )));
    }
    let page = PAGE as u64;
    let overflow = || HalError::InvalidArgument("an NVMe transfer's end overflows".into());
    let end = iova.checked_add(len as u64).ok_or_else(overflow)?;
    let first_page_end = (iova / page + 1).checked_mul(page).ok_or_else(overflow)?;
    if end <= first_page_end {
        return Ok((iova, Prp2::Unused));
    }
    let rest: Vec<u64> = (first_page_end..end).step_by(PAGE).collect();
    Ok(match rest.as_slice() {
        [one] => (iova, Prp2::Page(*one)),
        _ => (iova, Prp2::List(rest)),
    })
}

/// The pages a command's PRP1 and PRP2 name for `len` bytes, as a device (the software
/// controller) walks them: `(address, bytes)` pieces in order. `list` reads the PRP list at an
/// address (`count` entries); `None` where it cannot (the address is not mapped).
pub fn walk(
    prp1: u64,
    prp2: u64,
    len: usize,
    list: impl FnOnce(u64, usize) -> Option<Vec<u64>>,
) -> Option<Vec<(u64, usize)>> {
    let page = PAGE as u64;
    let first = (page - prp1 % page).min(len as u64) as usize;
    let mut pieces = vec![(prp1, first)];
    let mut left = len - first;
    if left == 0 {
        return Some(pieces);
    }
    let pages = left.div_ceil(PAGE);
    let addresses = if pages == 1 {
        vec![prp2]
    } else {
        if pages > LIST_ENTRIES {
            return None;
        }
        list(prp2, pages)?
    };
    for a in addresses {
        if a % page != 0 {
            return None;
        }
        let n = left.min(PAGE);
        pieces.push((a, n));
        left -= n;
    }
    Some(pieces)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_page_two_pages_and_a_list() {
        assert_eq!(entries(0x10000, 512).unwrap(), (0x10000, Prp2::Unused));
        assert_eq!(entries(0x10000, 4096).unwrap(), (0x10000, Prp2::Unused));
        assert_eq!(
            entries(0x10200, 4096).unwrap(),
            (0x10200, Prp2::Page(0x11000))
        );
        assert_eq!(
            entries(0x10000, 8192).unwrap(),
            (0x10000, Prp2::Page(0x11000))
        );
        assert_eq!(
            entries(0x10000, 8193).unwrap(),
            (0x10000, Prp2::List(vec![0x11000, 0x12000]))
        );
        let (_, Prp2::List(l)) = entries(0x10800, MAX_TRANSFER).unwrap() else {
            panic!("expected a list")
        };
        assert_eq!(l.len(), LIST_ENTRIES);
    }

    #[test]
    fn bad_transfers_are_refused() {
        assert!(entries(0x10002, 512).is_err());
        assert!(entries(0x10000, 0).is_err());
        assert!(entries(0x10000, MAX_TRANSFER + 1).is_err());
        assert!(entries(u64::MAX - 3, 8).is_err());
    }

    #[test]
    fn walking_the_entries_gives_back_the_transfer() {
        for (iova, len) in [
            (0x10000u64, 512usize),
            (0x10200, 4096),
            (0x10000, 8192),
            (0x10c00, 70_000),
        ] {
            let (prp1, prp2) = entries(iova, len).unwrap();
            let (p2, list) = match prp2 {
                Prp2::Unused => (0, vec![]),
                Prp2::Page(p) => (p, vec![]),
                Prp2::List(l) => (0xf000_0000, l),
            };
            let pieces = walk(prp1, p2, len, |at, n| {
                assert_eq!(at, 0xf000_0000);
                Some(list[..n].to_vec())
            })
            .unwrap();
            assert_eq!(pieces.iter().map(|p| p.1).sum::<usize>(), len);
            assert_eq!(pieces[0].0, iova);
            let mut at = iova;
            for (a, n) in pieces {
                assert_eq!(a, at, "pieces are contiguous in IO address space");
                at += n as u64;
            }
        }
        assert_eq!(
            walk(0x10000, 0x20001, 8192, |_, _| None),
            None,
            "unaligned PRP2"
        );
    }
}
