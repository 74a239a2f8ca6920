//! The NVMe completion status, as errors carry it
//! ([`HalError::NvmeCommand`](super::HalError::NvmeCommand)); gpuio-nvme's
//! `spec::Status` is this type.

use super::ErrorCode;
use std::fmt;

/// A completion's status field: status code type (SCT) and status code (SC), with the
/// More and Do Not Retry bits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct NvmeStatus(pub u16);

impl NvmeStatus {
    /// Successful completion.
    pub const SUCCESS: NvmeStatus = NvmeStatus(0);
    /// Generic: invalid command opcode.
    pub const INVALID_OPCODE: NvmeStatus = NvmeStatus::generic(0x01);
    /// Generic: invalid field in command.
    pub const INVALID_FIELD: NvmeStatus = NvmeStatus::generic(0x02);
    /// Generic: data transfer error.
    pub const DATA_TRANSFER_ERROR: NvmeStatus = NvmeStatus::generic(0x04);
    /// Generic: internal error.
    pub const INTERNAL_ERROR: NvmeStatus = NvmeStatus::generic(0x06);
    /// Generic: invalid namespace or format.
    pub const INVALID_NAMESPACE: NvmeStatus = NvmeStatus::generic(0x0b);
    /// Generic: PRP offset invalid.
    pub const INVALID_PRP_OFFSET: NvmeStatus = NvmeStatus::generic(0x13);
    /// Generic (NVM): LBA out of range.
    pub const LBA_OUT_OF_RANGE: NvmeStatus = NvmeStatus::generic(0x80);
    /// Command specific: invalid queue identifier.
    pub const INVALID_QUEUE_ID: NvmeStatus = NvmeStatus::specific(0x01);
    /// Command specific: invalid queue size.
    pub const INVALID_QUEUE_SIZE: NvmeStatus = NvmeStatus::specific(0x02);
    /// Command specific: completion queue invalid.
    pub const INVALID_CQ: NvmeStatus = NvmeStatus::specific(0x00);
    /// Media error: unrecovered read error.
    pub const UNRECOVERED_READ: NvmeStatus = NvmeStatus::media(0x81);
    /// Media error: write fault.
    pub const WRITE_FAULT: NvmeStatus = NvmeStatus::media(0x80);

    const fn with(sct: u16, sc: u16) -> NvmeStatus {
        NvmeStatus((sct & 0x7) << 8 | (sc & 0xff))
    }

    /// NvmeStatus code type 0 (generic) with code `sc`.
    pub const fn generic(sc: u16) -> NvmeStatus {
        NvmeStatus::with(0, sc)
    }

    /// NvmeStatus code type 1 (command specific) with code `sc`.
    pub const fn specific(sc: u16) -> NvmeStatus {
        NvmeStatus::with(1, sc)
    }

    /// NvmeStatus code type 2 (media and data integrity) with code `sc`.
    pub const fn media(sc: u16) -> NvmeStatus {
        NvmeStatus::with(2, sc)
    }

    /// The status code type and code alone, without the More, Do Not Retry and retry-delay
    /// bits: what to compare against the named statuses.
    pub fn code(self) -> NvmeStatus {
        NvmeStatus::with(self.sct() as u16, self.sc() as u16)
    }

    /// NvmeStatus code type.
    pub fn sct(self) -> u8 {
        (self.0 >> 8 & 0x7) as u8
    }

    /// NvmeStatus code.
    pub fn sc(self) -> u8 {
        self.0 as u8
    }

    /// Whether the command succeeded.
    pub fn is_success(self) -> bool {
        self.sct() == 0 && self.sc() == 0
    }

    /// The controller says the same command would fail again.
    pub fn do_not_retry(self) -> bool {
        self.0 >> 14 & 1 == 1
    }

    /// The gpuio error code for this status: the caller's mistake (a bad field, namespace or
    /// LBA) is `InvalidArg`, everything else `Io`.
    pub fn error_code(self) -> ErrorCode {
        match self.code() {
            NvmeStatus::INVALID_FIELD
            | NvmeStatus::INVALID_NAMESPACE
            | NvmeStatus::LBA_OUT_OF_RANGE => ErrorCode::InvalidArg,
            _ => ErrorCode::Io,
        }
    }

    /// The specification's name for this status, where the driver knows it.
    pub fn name(self) -> &'static str {
        match self.code() {
            NvmeStatus::SUCCESS => "successful completion",
            NvmeStatus::INVALID_OPCODE => "invalid command opcode",
            NvmeStatus::INVALID_FIELD => "invalid field in command",
            NvmeStatus::DATA_TRANSFER_ERROR => "data transfer error",
            NvmeStatus::INTERNAL_ERROR => "internal error",
            NvmeStatus::INVALID_NAMESPACE => "invalid namespace or format",
            NvmeStatus::INVALID_PRP_OFFSET => "PRP offset invalid",
            NvmeStatus::LBA_OUT_OF_RANGE => "LBA out of range",
            NvmeStatus::INVALID_CQ => "completion queue invalid",
            NvmeStatus::INVALID_QUEUE_ID => "invalid queue identifier",
            NvmeStatus::INVALID_QUEUE_SIZE => "invalid queue size",
            NvmeStatus::UNRECOVERED_READ => "unrecovered read error",
            NvmeStatus::WRITE_FAULT => "write fault",
            _ => "unknown status",
        }
    }
}

impl fmt::Debug for NvmeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for NvmeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (SCT {:#x}, SC {:#04x}{})",
            self.name(),
            self.sct(),
            self.sc(),
            if self.do_not_retry() { ", DNR" } else { "" }
        )
    }
}
