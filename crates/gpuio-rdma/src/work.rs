//! Work requests: what one does ([`Op`]), the verbs library's request built from it
//! ([`send_wr`], [`recv_wr`]), how a verb in place in a `HostRegion` is cut into requests of at
//! most [`MAX_WORK_BYTES`] ([`one_sided`]), and what a completion that failed means
//! ([`completion_err`]). Plain functions the queue pair posts and waits with, tested here
//! without a NIC.

use super::memory::{HostRegion, RemoteRegion};
use gpuio_hal::{ErrorCode, HalError, Result};
use rdma_sys::*;
use std::ffi::CStr;
use std::ops::Range;

/// Bytes one work request moves at most; longer transfers are several requests.
const MAX_WORK_BYTES: usize = 1 << 30;

/// What one work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    Read {
        addr: u64,
        rkey: u32,
    },
    Write {
        addr: u64,
        rkey: u32,
    },
    CompareSwap {
        addr: u64,
        rkey: u32,
        expect: u64,
        swap: u64,
    },
    FetchAdd {
        addr: u64,
        rkey: u32,
        add: u64,
    },
    Send,
    Recv,
}

/// The work requests moving `bytes` (inside `region`) from or to the peer's `remote` region at
/// `remote_off`: one per [`MAX_WORK_BYTES`], each made by `op` from its remote address and key.
pub(super) fn one_sided(
    region: &HostRegion,
    bytes: &[u8],
    remote: &RemoteRegion,
    remote_off: u64,
    op: impl Fn(u64, u32) -> Op,
) -> Result<Vec<(ibv_sge, Op)>> {
    let start = remote.at(remote_off, bytes.len())?;
    pieces(bytes.len(), MAX_WORK_BYTES)
        .map(|piece| {
            let addr = start + piece.start as u64;
            Ok((region.sge(&bytes[piece])?, op(addr, remote.rkey)))
        })
        .collect()
}

/// `len` bytes cut into consecutive ranges of `max` bytes (the last one shorter), as
/// `chunks(max)` cuts a slice; none for no bytes.
fn pieces(len: usize, max: usize) -> impl Iterator<Item = Range<usize>> {
    (0..len.div_ceil(max)).map(move |i| i * max..len.min((i + 1) * max))
}

/// The receive work request `id` into the one entry `sge`, which must outlive its posting.
pub(super) fn recv_wr(id: u64, sge: &mut ibv_sge) -> ibv_recv_wr {
    // SAFETY: a zeroed ibv_recv_wr is valid (null next, no entries); the fields that matter are
    // set here.
    let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = id;
    wr.sg_list = sge;
    wr.num_sge = 1;
    wr
}

/// The signaled send-queue work request `id` doing `op` (not [`Op::Recv`]) on the one entry
/// `sge`, which must outlive its posting.
pub(super) fn send_wr(id: u64, sge: &mut ibv_sge, op: Op) -> ibv_send_wr {
    // SAFETY: a zeroed ibv_send_wr is valid (null next, no entries, no remote); the fields
    // that matter are set here.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = id;
    wr.sg_list = sge;
    wr.num_sge = 1;
    wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
    let (opcode, remote) = match op {
        Op::Read { addr, rkey } => (ibv_wr_opcode::IBV_WR_RDMA_READ, Some((addr, rkey))),
        Op::Write { addr, rkey } => (ibv_wr_opcode::IBV_WR_RDMA_WRITE, Some((addr, rkey))),
        Op::CompareSwap {
            addr,
            rkey,
            expect,
            swap,
        } => {
            wr.wr.atomic = atomic_t {
                remote_addr: addr,
                compare_add: expect,
                swap,
                rkey,
            };
            (ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP, None)
        }
        Op::FetchAdd { addr, rkey, add } => {
            wr.wr.atomic = atomic_t {
                remote_addr: addr,
                compare_add: add,
                swap: 0,
                rkey,
            };
            (ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD, None)
        }
        Op::Send | Op::Recv => (ibv_wr_opcode::IBV_WR_SEND, None),
    };
    wr.opcode = opcode;
    if let Some((remote_addr, rkey)) = remote {
        wr.wr.rdma = rdma_t { remote_addr, rkey };
    }
    wr
}

/// The error of a completion that did not succeed.
pub(super) fn completion_err(what: &'static str, status: ibv_wc_status::Type) -> HalError {
    // SAFETY: ibv_wc_status_str returns a static C string for any status.
    let why = unsafe { CStr::from_ptr(ibv_wc_status_str(status)) };
    HalError::Rdma {
        op: what,
        message: why.to_string_lossy().into_owned(),
        code: completion_code(status),
    }
}

/// The error code of a completion status that is not success: a peer refusing access (or a
/// local protection fault) is `Permission`, a peer that stopped answering `Network`.
fn completion_code(status: ibv_wc_status::Type) -> ErrorCode {
    match status {
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR | ibv_wc_status::IBV_WC_LOC_PROT_ERR => {
            ErrorCode::Permission
        }
        ibv_wc_status::IBV_WC_REM_INV_REQ_ERR => ErrorCode::InvalidArg,
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR | ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => {
            ErrorCode::Network
        }
        _ => ErrorCode::Io,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: usize = 1 << 30;

    /// The pieces as (start, end) pairs.
    fn cut(len: usize, max: usize) -> Vec<(usize, usize)> {
        pieces(len, max).map(|r| (r.start, r.end)).collect()
    }

    #[test]
    fn large_verbs_are_cut_into_work_requests_of_at_most_1_gib() {
        assert_eq!(MAX_WORK_BYTES, GIB);
        assert_eq!(cut(0, GIB), [], "no bytes, no work requests");
        assert_eq!(cut(1, GIB), [(0, 1)]);
        assert_eq!(cut(GIB, GIB), [(0, GIB)]);
        assert_eq!(cut(GIB + 1, GIB), [(0, GIB), (GIB, GIB + 1)]);
        let len = 5 * GIB / 2;
        assert_eq!(cut(len, GIB), [(0, GIB), (GIB, 2 * GIB), (2 * GIB, len)]);
        // The same cut as `chunks`, on slices small enough to have.
        let bytes: Vec<u8> = (0..=255).collect();
        for max in [1, 7, 64, 255, 256, 1000] {
            let cut: Vec<&[u8]> = pieces(bytes.len(), max).map(|r| &bytes[r]).collect();
            assert_eq!(cut, bytes.chunks(max).collect::<Vec<_>>(), "{max}");
        }
        // Each piece fits one scatter-gather entry.
        assert!(u32::try_from(MAX_WORK_BYTES).is_ok());
    }

    #[test]
    fn one_sided_work_requests_carry_their_remote_address_and_key() {
        let mut sge = ibv_sge {
            addr: 0x1000,
            length: 64,
            lkey: 5,
        };
        let wr = send_wr(
            9,
            &mut sge,
            Op::Write {
                addr: 0xabc0,
                rkey: 77,
            },
        );
        assert_eq!((wr.wr_id, wr.num_sge), (9, 1));
        assert_eq!(wr.opcode, ibv_wr_opcode::IBV_WR_RDMA_WRITE);
        assert_eq!(wr.send_flags, ibv_send_flags::IBV_SEND_SIGNALED.0);
        assert!(std::ptr::eq(wr.sg_list, &sge));
        assert!(wr.next.is_null());
        // SAFETY: send_wr set the `rdma` member for an RDMA write.
        let rdma = unsafe { wr.wr.rdma };
        assert_eq!((rdma.remote_addr, rdma.rkey), (0xabc0, 77));
        let wr = send_wr(
            10,
            &mut sge,
            Op::Read {
                addr: 0xdef0,
                rkey: 78,
            },
        );
        assert_eq!(wr.opcode, ibv_wr_opcode::IBV_WR_RDMA_READ);
        // SAFETY: as above, for an RDMA read.
        let rdma = unsafe { wr.wr.rdma };
        assert_eq!((rdma.remote_addr, rdma.rkey), (0xdef0, 78));
    }

    #[test]
    fn atomic_work_requests_carry_their_operands() {
        let mut sge = ibv_sge {
            addr: 0x2000,
            length: 8,
            lkey: 6,
        };
        let cas = Op::CompareSwap {
            addr: 0x40,
            rkey: 3,
            expect: 11,
            swap: 12,
        };
        let wr = send_wr(1, &mut sge, cas);
        assert_eq!(wr.opcode, ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP);
        // SAFETY: send_wr set the `atomic` member for an atomic.
        let a = unsafe { wr.wr.atomic };
        assert_eq!(
            (a.remote_addr, a.rkey, a.compare_add, a.swap),
            (0x40, 3, 11, 12)
        );
        let add = Op::FetchAdd {
            addr: 0x48,
            rkey: 4,
            add: 5,
        };
        let wr = send_wr(2, &mut sge, add);
        assert_eq!(wr.opcode, ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD);
        // SAFETY: as above.
        let a = unsafe { wr.wr.atomic };
        assert_eq!(
            (a.remote_addr, a.rkey, a.compare_add, a.swap),
            (0x48, 4, 5, 0)
        );
    }

    #[test]
    fn sends_and_receives_name_only_their_entry() {
        let mut sge = ibv_sge {
            addr: 0x3000,
            length: 100,
            lkey: 8,
        };
        let wr = send_wr(3, &mut sge, Op::Send);
        assert_eq!(wr.opcode, ibv_wr_opcode::IBV_WR_SEND);
        assert_eq!((wr.wr_id, wr.num_sge), (3, 1));
        // SAFETY: zeroed by send_wr and not set for a send.
        let rdma = unsafe { wr.wr.rdma };
        assert_eq!((rdma.remote_addr, rdma.rkey), (0, 0));
        let wr = recv_wr(4, &mut sge);
        assert_eq!((wr.wr_id, wr.num_sge), (4, 1));
        assert!(std::ptr::eq(wr.sg_list, &sge));
        assert!(wr.next.is_null());
    }

    #[test]
    fn completion_statuses_map_to_error_codes() {
        use ibv_wc_status::*;
        for (status, code) in [
            (IBV_WC_REM_ACCESS_ERR, ErrorCode::Permission),
            (IBV_WC_LOC_PROT_ERR, ErrorCode::Permission),
            (IBV_WC_REM_INV_REQ_ERR, ErrorCode::InvalidArg),
            (IBV_WC_RETRY_EXC_ERR, ErrorCode::Network),
            (IBV_WC_RNR_RETRY_EXC_ERR, ErrorCode::Network),
            (IBV_WC_WR_FLUSH_ERR, ErrorCode::Io),
            (IBV_WC_LOC_LEN_ERR, ErrorCode::Io),
            (IBV_WC_GENERAL_ERR, ErrorCode::Io),
        ] {
            let e = completion_err("RDMA read", status);
            assert_eq!(e.code(), code, "{e}");
            let HalError::Rdma { op, message, .. } = &e else {
                panic!("{e:?}")
            };
            assert_eq!(*op, "RDMA read");
            assert!(!message.is_empty(), "status {status} has a description");
        }
    }
}
