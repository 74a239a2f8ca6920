//! The NVMe protocol's vocabulary (NVM Express Base Specification 1.4): controller registers,
//! the 64-byte submission and 16-byte completion queue entries, opcodes, status codes, and
//! the Identify data the driver reads. One `#[repr(C)]` definition of each shared layout; the
//! const asserts below pin sizes and offsets so a change cannot drift silently.

use std::time::Duration;

/// Byte offsets of the controller registers in BAR0.
pub mod reg {
    /// Controller Capabilities (64 bits).
    pub const CAP: usize = 0x00;
    /// Version.
    pub const VS: usize = 0x08;
    /// Interrupt Mask Set.
    pub const INTMS: usize = 0x0c;
    /// Controller Configuration.
    pub const CC: usize = 0x14;
    /// Controller Status.
    pub const CSTS: usize = 0x1c;
    /// Admin Queue Attributes.
    pub const AQA: usize = 0x24;
    /// Admin Submission Queue base address (64 bits).
    pub const ASQ: usize = 0x28;
    /// Admin Completion Queue base address (64 bits).
    pub const ACQ: usize = 0x30;
    /// The first doorbell (the admin SQ's tail).
    pub const DOORBELLS: usize = 0x1000;
}

/// CC bits.
pub mod cc {
    /// Enable.
    pub const EN: u32 = 1;
    /// I/O submission queue entry size: 2^6 = 64 bytes.
    pub const IOSQES_64: u32 = 6 << 16;
    /// I/O completion queue entry size: 2^4 = 16 bytes.
    pub const IOCQES_16: u32 = 4 << 20;
    /// Shutdown notification: normal (bits 14..16 = 01).
    pub const SHN_NORMAL: u32 = 1 << 14;
}

/// CSTS bits.
pub mod csts {
    /// Ready.
    pub const RDY: u32 = 1;
    /// Controller Fatal Status.
    pub const CFS: u32 = 1 << 1;
}

/// The controller's memory page size this driver uses (CC.MPS = 0): 4 KiB. Queues, PRP
/// entries and PRP lists are in units of it.
pub const PAGE: usize = 4096;

/// The doorbell offset of queue `qid`'s submission tail (`completion = false`) or completion
/// head, for a doorbell stride of `4 << dstrd` bytes.
pub fn doorbell(qid: u16, completion: bool, dstrd: u8) -> usize {
    reg::DOORBELLS + (2 * qid as usize + completion as usize) * (4usize << dstrd)
}

/// CAP, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cap {
    /// Maximum entries per queue (MQES + 1).
    pub max_queue_entries: u32,
    /// Queues must be physically contiguous.
    pub contiguous_queues: bool,
    /// Worst-case time to become ready or not ready after CC.EN changes.
    pub timeout: Duration,
    /// Doorbell stride exponent: doorbells are `4 << dstrd` bytes apart.
    pub dstrd: u8,
    /// The NVM command set is supported.
    pub nvm_command_set: bool,
    /// Smallest memory page size, as 2^(12 + n).
    pub mpsmin: u8,
    /// Largest memory page size, as 2^(12 + n).
    pub mpsmax: u8,
}

impl Cap {
    /// Decodes the 64-bit register.
    pub fn from_raw(raw: u64) -> Self {
        Self {
            max_queue_entries: (raw & 0xffff) as u32 + 1,
            contiguous_queues: raw >> 16 & 1 == 1,
            timeout: Duration::from_millis(500 * (raw >> 24 & 0xff).max(1)),
            dstrd: (raw >> 32 & 0xf) as u8,
            nvm_command_set: raw >> 37 & 1 == 1,
            mpsmin: (raw >> 48 & 0xf) as u8,
            mpsmax: (raw >> 52 & 0xf) as u8,
        }
    }

    /// Encodes it (the software controller publishes its CAP this way).
    pub fn to_raw(self) -> u64 {
        (self.max_queue_entries.saturating_sub(1) as u64 & 0xffff)
            | (self.contiguous_queues as u64) << 16
            | ((self.timeout.as_millis() / 500).clamp(1, 255) as u64) << 24
            | (self.dstrd as u64 & 0xf) << 32
            | (self.nvm_command_set as u64) << 37
            | (self.mpsmin as u64 & 0xf) << 48
            | (self.mpsmax as u64 & 0xf) << 52
    }
}

/// Admin command opcodes.
pub mod admin {
    /// Delete I/O Submission Queue.
    pub const DELETE_SQ: u8 = 0x00;
    /// Create I/O Submission Queue.
    pub const CREATE_SQ: u8 = 0x01;
    /// Delete I/O Completion Queue.
    pub const DELETE_CQ: u8 = 0x04;
    /// Create I/O Completion Queue.
    pub const CREATE_CQ: u8 = 0x05;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Feature: Number of Queues (CDW11: I/O SQs and CQs wanted, 0-based; the result: given).
    pub const FEATURE_NUMBER_OF_QUEUES: u32 = 0x07;
    /// Identify CNS: a namespace's data structure.
    pub const CNS_NAMESPACE: u32 = 0x00;
    /// Identify CNS: the controller's data structure.
    pub const CNS_CONTROLLER: u32 = 0x01;
    /// Identify CNS: the active namespace IDs (up to 1024, ascending).
    pub const CNS_ACTIVE_NAMESPACES: u32 = 0x02;
}

/// NVM command set opcodes.
pub mod io {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
}

/// A submission queue entry (64 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(64))]
pub struct Sqe {
    /// Opcode (bits 0..8), fused operation (8..10), PRP or SGL (14..16), command identifier
    /// (16..32).
    pub cdw0: u32,
    /// Namespace identifier.
    pub nsid: u32,
    /// Reserved (command specific).
    pub cdw2: u32,
    /// Reserved (command specific).
    pub cdw3: u32,
    /// Metadata pointer.
    pub mptr: u64,
    /// PRP entry 1.
    pub prp1: u64,
    /// PRP entry 2 (a second page, or a PRP list).
    pub prp2: u64,
    /// Command dwords 10..16.
    pub cdw10: u32,
    /// Command dword 11.
    pub cdw11: u32,
    /// Command dword 12.
    pub cdw12: u32,
    /// Command dword 13.
    pub cdw13: u32,
    /// Command dword 14.
    pub cdw14: u32,
    /// Command dword 15.
    pub cdw15: u32,
}

impl Sqe {
    /// An entry with `opcode` for namespace `nsid`; the command identifier is set at
    /// submission.
    pub fn new(opcode: u8, nsid: u32) -> Self {
        Self {
            cdw0: opcode as u32,
            nsid,
            ..Self::default()
        }
    }

    /// The opcode.
    pub fn opcode(&self) -> u8 {
        self.cdw0 as u8
    }

    /// The command identifier.
    pub fn cid(&self) -> u16 {
        (self.cdw0 >> 16) as u16
    }

    /// Sets the command identifier.
    pub fn set_cid(&mut self, cid: u16) {
        self.cdw0 = (self.cdw0 & 0xffff) | (cid as u32) << 16;
    }

    /// A READ or WRITE of `blocks` logical blocks from `lba` (`blocks` ≥ 1, ≤ 65536).
    pub fn rw(opcode: u8, nsid: u32, lba: u64, blocks: u32) -> Self {
        Self {
            cdw10: lba as u32,
            cdw11: (lba >> 32) as u32,
            cdw12: blocks.saturating_sub(1) & 0xffff,
            ..Self::new(opcode, nsid)
        }
    }

    /// A READ or WRITE's starting LBA.
    pub fn lba(&self) -> u64 {
        self.cdw10 as u64 | (self.cdw11 as u64) << 32
    }

    /// A READ or WRITE's block count.
    pub fn blocks(&self) -> u32 {
        (self.cdw12 & 0xffff) + 1
    }
}

/// A completion queue entry (16 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Cqe {
    /// Command-specific result.
    pub result: u32,
    /// Reserved.
    pub rsvd: u32,
    /// The submission queue's head as the controller last consumed it.
    pub sq_head: u16,
    /// The submission queue the command came from.
    pub sq_id: u16,
    /// The command identifier.
    pub cid: u16,
    /// Phase tag (bit 0) and status field (bits 1..16).
    pub status: u16,
}

impl Cqe {
    /// The phase tag.
    pub fn phase(&self) -> bool {
        self.status & 1 == 1
    }

    /// The status, without the phase tag.
    pub fn status(&self) -> Status {
        Status(self.status >> 1)
    }
}

const _: () = {
    assert!(std::mem::size_of::<Sqe>() == 64);
    assert!(std::mem::offset_of!(Sqe, nsid) == 4);
    assert!(std::mem::offset_of!(Sqe, mptr) == 16);
    assert!(std::mem::offset_of!(Sqe, prp1) == 24);
    assert!(std::mem::offset_of!(Sqe, prp2) == 32);
    assert!(std::mem::offset_of!(Sqe, cdw10) == 40);
    assert!(std::mem::offset_of!(Sqe, cdw15) == 60);
    assert!(std::mem::size_of::<Cqe>() == 16);
    assert!(std::mem::offset_of!(Cqe, sq_head) == 8);
    assert!(std::mem::offset_of!(Cqe, cid) == 12);
    assert!(std::mem::offset_of!(Cqe, status) == 14);
};

pub use gpuio_hal::error::NvmeStatus as Status;

/// What the Identify Controller data structure says that the driver uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControllerIdentity {
    /// PCI vendor ID.
    pub vendor: u16,
    /// Serial number (trimmed).
    pub serial: String,
    /// Model number (trimmed).
    pub model: String,
    /// Firmware revision (trimmed).
    pub firmware: String,
    /// Maximum data transfer size, as 2^n memory pages (0: no limit).
    pub mdts: u8,
    /// Number of namespaces.
    pub namespaces: u32,
}

impl ControllerIdentity {
    /// Parses the 4096-byte structure.
    pub fn parse(data: &[u8; PAGE]) -> Self {
        let text = |r: std::ops::Range<usize>| {
            String::from_utf8_lossy(&data[r])
                .trim_matches(|c: char| c == ' ' || c == '\0')
                .to_string()
        };
        Self {
            vendor: u16::from_le_bytes([data[0], data[1]]),
            serial: text(4..24),
            model: text(24..64),
            firmware: text(64..72),
            mdts: data[77],
            namespaces: u32::from_le_bytes([data[516], data[517], data[518], data[519]]),
        }
    }

    /// The largest transfer one command may carry, in bytes (`None`: no limit).
    pub fn max_transfer(&self) -> Option<usize> {
        (self.mdts != 0).then(|| PAGE << self.mdts.min(20))
    }
}

/// What the Identify Namespace data structure says that the driver uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NamespaceIdentity {
    /// Namespace size in logical blocks.
    pub blocks: u64,
    /// The logical block size of the format in use, in bytes.
    pub block_size: u32,
    /// Metadata bytes per block in the format in use (this driver needs 0).
    pub metadata: u16,
}

impl NamespaceIdentity {
    /// Parses the 4096-byte structure; `None` for an inactive namespace (size 0) or a block
    /// size outside 2^9..=2^16.
    pub fn parse(data: &[u8; PAGE]) -> Option<Self> {
        let blocks = u64::from_le_bytes(data[0..8].try_into().ok()?);
        let format = (data[26] & 0xf) as usize;
        let lbaf = &data[128 + 4 * format..128 + 4 * format + 4];
        let lbads = lbaf[2];
        if blocks == 0 || !(9..=16).contains(&lbads) {
            return None;
        }
        Some(Self {
            blocks,
            block_size: 1 << lbads,
            metadata: u16::from_le_bytes([lbaf[0], lbaf[1]]),
        })
    }

    /// The namespace's capacity in bytes.
    pub fn bytes(&self) -> u64 {
        self.blocks.saturating_mul(self.block_size as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_round_trips() {
        let cap = Cap {
            max_queue_entries: 1024,
            contiguous_queues: true,
            timeout: Duration::from_millis(7500),
            dstrd: 2,
            nvm_command_set: true,
            mpsmin: 0,
            mpsmax: 4,
        };
        assert_eq!(Cap::from_raw(cap.to_raw()), cap);
        // QEMU's emulated controller: MQES 2047, CQR, TO 15, CSS NVM, MPSMAX 4.
        let qemu = Cap::from_raw(0x0040_0020_0f01_07ff);
        assert_eq!(qemu.max_queue_entries, 2048);
        assert!(qemu.contiguous_queues && qemu.nvm_command_set);
        assert_eq!(qemu.timeout, Duration::from_millis(7500));
        assert_eq!((qemu.dstrd, qemu.mpsmin, qemu.mpsmax), (0, 0, 4));
    }

    #[test]
    fn doorbells_follow_the_stride() {
        assert_eq!(doorbell(0, false, 0), 0x1000);
        assert_eq!(doorbell(0, true, 0), 0x1004);
        assert_eq!(doorbell(3, false, 0), 0x1018);
        assert_eq!(doorbell(1, true, 2), 0x1000 + 3 * 16);
    }

    #[test]
    fn sqe_fields_pack() {
        let mut sqe = Sqe::rw(io::READ, 1, 0x1_2345_6789, 8);
        sqe.set_cid(0xbeef);
        assert_eq!(sqe.opcode(), io::READ);
        assert_eq!(sqe.cid(), 0xbeef);
        assert_eq!(sqe.lba(), 0x1_2345_6789);
        assert_eq!(sqe.blocks(), 8);
        assert_eq!(sqe.cdw12, 7);
    }

    #[test]
    fn statuses_decode() {
        let cqe = Cqe {
            status: (Status::LBA_OUT_OF_RANGE.0 | 1 << 14) << 1 | 1,
            ..Cqe::default()
        };
        assert!(cqe.phase());
        let s = cqe.status();
        assert_eq!((s.sct(), s.sc()), (0, 0x80));
        assert!(s.do_not_retry() && !s.is_success());
        assert_eq!(s.name(), "LBA out of range");
        assert_eq!(Status::specific(0x01), Status::INVALID_QUEUE_ID);
        assert_eq!(
            Status::media(0x81).to_string(),
            "unrecovered read error (SCT 0x2, SC 0x81)"
        );
        assert!(Status::SUCCESS.is_success());
    }

    #[test]
    fn identify_structures_parse() {
        let mut data = [0u8; PAGE];
        data[0..2].copy_from_slice(&0x1b36u16.to_le_bytes());
        data[4..12].copy_from_slice(b"gpuio-01");
        data[12..24].fill(b' ');
        data[24..29].copy_from_slice(b"model");
        data[77] = 7;
        data[516..520].copy_from_slice(&2u32.to_le_bytes());
        let id = ControllerIdentity::parse(&data);
        assert_eq!(
            (id.vendor, id.serial.as_str(), id.model.as_str()),
            (0x1b36, "gpuio-01", "model")
        );
        assert_eq!((id.mdts, id.namespaces), (7, 2));
        assert_eq!(id.max_transfer(), Some(512 * 1024));

        let mut ns = [0u8; PAGE];
        ns[0..8].copy_from_slice(&2048u64.to_le_bytes());
        ns[26] = 1; // format 1 in use
        ns[128 + 4 + 2] = 12; // 4 KiB blocks
        let n = NamespaceIdentity::parse(&ns).unwrap();
        assert_eq!((n.blocks, n.block_size, n.bytes()), (2048, 4096, 8 << 20));
        ns[0..8].fill(0);
        assert_eq!(NamespaceIdentity::parse(&ns), None);
    }
}
