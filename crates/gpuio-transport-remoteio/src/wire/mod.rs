//! The RemoteIO wire protocol (docs/REFERENCE.md#wire-protocol): a 28-byte little-endian header
//! (magic `0x47505549`, version, message type, flags, request id, payload length) and one payload
//! per message type. Decoding is strict: a wrong magic or version, an unknown type, a payload
//! longer than the limits or not exactly the size its fields need is a [`WireError`], never a
//! guess.
//!
//! This file holds the header, the limits and the field reader every decoder shares;
//! `message.rs` the messages, encoded and decoded whole; `stream.rs` the heads of READ_RESP
//! and WRITE_REQ on their own, so that their data can stream between sockets and memory.

mod message;
mod stream;
#[cfg(test)]
mod tests;

pub use message::{Message, RdmaInfo};
pub use stream::{READ_RESP_HEAD, WriteHead, check_read_resp, read_resp_head, write_req_head};

/// `GPUI` in the header's first four bytes.
pub const MAGIC: u32 = 0x4750_5549;
/// The protocol version this build speaks. Version 2: the client proves its key first, the
/// welcome carries the agent's proof and instance, STAT answers carry the instance. Version 3:
/// STAT answers say whether an export can be made durable; SYNC and RESERVE requests.
/// Version 4: NIXL_INFO answers end with the export's memory (host, or the CUDA device).
pub const VERSION: u16 = 4;
/// Bytes of the message header.
pub const HEADER_LEN: usize = 28;
/// Largest payload accepted (a READ/WRITE carries at most [`MAX_DATA`] bytes of data).
pub const MAX_PAYLOAD: u64 = MAX_DATA as u64 + 4096;
/// Largest data transfer in one READ or WRITE message; larger transfers are split.
pub const MAX_DATA: usize = 16 << 20;
/// Longest export or key name, in bytes.
pub const MAX_NAME: usize = 255;
/// Longest error message, in bytes.
pub const MAX_MESSAGE: usize = 1024;
/// Bytes of a HELLO nonce and of an HMAC-SHA-256 proof.
pub const NONCE_LEN: usize = 32;
/// Largest payload of a handshake message (a HELLO: the key's name and a nonce). An agent
/// reads no more than this from a client that has not proven its key.
pub const MAX_HANDSHAKE_PAYLOAD: u64 = (2 + MAX_NAME + NONCE_LEN) as u64;
/// Largest payload of a request other than a WRITE_REQ (whose data streams): the agent never
/// buffers more than this for one.
pub const MAX_REQUEST_PAYLOAD: u64 = 1024;

/// HELLO flag: the client's proof (third message of the handshake).
pub const FLAG_PROOF: u32 = 1;
/// HELLO_ACK flag: the server accepted the client's proof and proves the key in turn (fourth
/// message).
pub const FLAG_WELCOME: u32 = 2;
/// RDMA_INFO flag: a client's request to reach an export over RDMA (its queue pair, then the
/// export's name); the agent answers with a plain RDMA_INFO (its queue pair, the region).
pub const FLAG_RDMA_REQUEST: u32 = 1;
/// NIXL_INFO flag: a client's request to reach an export over NIXL (the export's name); the
/// agent answers with a plain NIXL_INFO (its NIXL agent's metadata, the export's address).
pub const FLAG_NIXL_REQUEST: u32 = 1;
/// Largest NIXL agent metadata a NIXL_INFO carries (one agent with one registration takes a
/// few hundred bytes).
pub const MAX_NIXL_METADATA: usize = 64 << 10;

/// Message types (docs/REFERENCE.md#wire-protocol).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum MsgType {
    /// Client greeting, then its proof.
    Hello = 0x01,
    /// Server challenge, then its welcome (with its proof).
    HelloAck = 0x02,
    /// Read a range of an export.
    ReadReq = 0x10,
    /// Write a range of an export.
    WriteReq = 0x11,
    /// The bytes read.
    ReadResp = 0x12,
    /// How many bytes were written.
    WriteResp = 0x13,
    /// An export's size and access (gpuio extension).
    StatReq = 0x14,
    /// The answer to a STAT_REQ (gpuio extension).
    StatResp = 0x15,
    /// Make an export's written bytes durable (gpuio extension).
    SyncReq = 0x16,
    /// Reserve room for an export's first bytes before writing them (gpuio extension).
    ReserveReq = 0x17,
    /// A SYNC_REQ or RESERVE_REQ done (gpuio extension).
    Done = 0x18,
    /// RDMA connection information.
    RdmaInfo = 0x20,
    /// NIXL connection information (gpuio extension).
    NixlInfo = 0x21,
    /// A refused or failed request (and, for a protocol error, the end of the connection).
    Error = 0xFF,
}

impl MsgType {
    fn from_u16(v: u16) -> Option<Self> {
        Some(match v {
            0x01 => Self::Hello,
            0x02 => Self::HelloAck,
            0x10 => Self::ReadReq,
            0x11 => Self::WriteReq,
            0x12 => Self::ReadResp,
            0x13 => Self::WriteResp,
            0x14 => Self::StatReq,
            0x15 => Self::StatResp,
            0x16 => Self::SyncReq,
            0x17 => Self::ReserveReq,
            0x18 => Self::Done,
            0x20 => Self::RdmaInfo,
            0x21 => Self::NixlInfo,
            0xFF => Self::Error,
            _ => return None,
        })
    }
}

/// The fixed header in front of every message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The message type.
    pub msg_type: MsgType,
    /// Type-specific flags.
    pub flags: u32,
    /// Chosen by the requester; echoed by the response.
    pub request_id: u64,
    /// Bytes of payload that follow.
    pub payload_len: u64,
}

/// A wire protocol violation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not a gpuio message.
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    /// A version this build does not speak.
    #[error("protocol version {0} (this build speaks {VERSION})")]
    BadVersion(u16),
    /// A message type this build does not know.
    #[error("unknown message type {0:#06x}")]
    UnknownType(u16),
    /// A payload larger than the limits.
    #[error("payload of {0} bytes exceeds the limit of {MAX_PAYLOAD}")]
    TooLarge(u64),
    /// A payload that does not hold what its type needs.
    #[error("malformed {what}: {why}")]
    Malformed {
        /// The message type.
        what: &'static str,
        /// What is wrong.
        why: String,
    },
}

impl Header {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&(self.msg_type as u16).to_le_bytes());
        b[8..12].copy_from_slice(&self.flags.to_le_bytes());
        b[12..20].copy_from_slice(&self.request_id.to_le_bytes());
        b[20..28].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Decodes and checks a header: magic, version, type, payload limit.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, WireError> {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let version = u16_at(4);
        if version != VERSION {
            return Err(WireError::BadVersion(version));
        }
        let t = u16_at(6);
        let msg_type = MsgType::from_u16(t).ok_or(WireError::UnknownType(t))?;
        let payload_len = u64_at(20);
        if payload_len > MAX_PAYLOAD {
            return Err(WireError::TooLarge(payload_len));
        }
        Ok(Self {
            msg_type,
            flags: u32_at(8),
            request_id: u64_at(12),
            payload_len,
        })
    }
}

impl Header {
    /// Refuses a payload longer than `limit`: what a receiver buffers is bounded by what the
    /// message type (and, before the handshake, the sender's standing) needs, not by
    /// [`MAX_PAYLOAD`].
    pub fn check_payload(&self, limit: u64) -> Result<(), WireError> {
        if self.payload_len > limit {
            return Err(WireError::Malformed {
                what: "message",
                why: format!(
                    "a payload of {} bytes where at most {limit} are taken",
                    self.payload_len
                ),
            });
        }
        Ok(())
    }
}

/// Appends a length-prefixed (u16) string.
fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Reads a payload field by field, refusing anything short, long or ill-formed.
struct Reader<'a> {
    what: &'static str,
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn bad(&self, why: impl Into<String>) -> WireError {
        WireError::Malformed {
            what: self.what,
            why: why.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.b.len() < n {
            return Err(self.bad(format!("{} bytes where {n} were needed", self.b.len())));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A byte that must be 0 (false) or 1 (true).
    fn flag(&mut self, what: &str) -> Result<bool, WireError> {
        match self.array::<1>()? {
            [0] => Ok(false),
            [1] => Ok(true),
            [b] => Err(self.bad(format!("{what} flag {b}"))),
        }
    }

    fn string(&mut self, max: usize) -> Result<String, WireError> {
        let n = self.u16()? as usize;
        if n > max {
            return Err(self.bad(format!("a string of {n} bytes (limit {max})")));
        }
        let bytes = self.take(n)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.bad("a string that is not UTF-8"))
    }

    fn data(&mut self) -> Result<Vec<u8>, WireError> {
        let n = self.u64()?;
        if n > MAX_DATA as u64 {
            return Err(self.bad(format!("{n} bytes of data (limit {MAX_DATA})")));
        }
        Ok(self.take(n as usize)?.to_vec())
    }

    fn end(self) -> Result<(), WireError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(self.bad(format!("{} bytes left over", self.b.len())))
        }
    }
}

/// `s` cut to at most `max` bytes at a character boundary.
fn truncate(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}
