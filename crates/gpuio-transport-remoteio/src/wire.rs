//! The RemoteIO wire protocol (docs/REFERENCE.md#wire-protocol): a 28-byte little-endian header
//! (magic `0x47505549`, version, message type, flags, request id, payload length) and one payload
//! per message type. Decoding is strict: a wrong magic or version, an unknown type, a payload
//! longer than the limits or not exactly the size its fields need is a [`WireError`], never a
//! guess.

use std::fmt;

/// `GPUI` in the header's first four bytes.
pub const MAGIC: u32 = 0x4750_5549;
/// The protocol version this build speaks. Version 2: the client proves its key first, the
/// welcome carries the agent's proof and instance, STAT answers carry the instance.
pub const VERSION: u16 = 2;
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
    /// RDMA connection information.
    RdmaInfo = 0x20,
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
            0x20 => Self::RdmaInfo,
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

/// RDMA connection information (`gpuio_rdma_info_t`), exchanged over the TCP control channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaInfo {
    /// Queue pair number.
    pub qp_num: u32,
    /// Local identifier (InfiniBand).
    pub lid: u16,
    /// Global identifier (RoCE).
    pub gid: [u8; 16],
    /// Remote key of the exposed region.
    pub rkey: u32,
    /// Virtual address of the exposed region.
    pub vaddr: u64,
}

impl RdmaInfo {
    fn put(&self, p: &mut Vec<u8>) {
        p.extend_from_slice(&self.qp_num.to_le_bytes());
        p.extend_from_slice(&self.lid.to_le_bytes());
        p.extend_from_slice(&self.gid);
        p.extend_from_slice(&self.rkey.to_le_bytes());
        p.extend_from_slice(&self.vaddr.to_le_bytes());
    }

    fn take(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(Self {
            qp_num: r.u32()?,
            lid: r.u16()?,
            gid: r.array()?,
            rkey: r.u32()?,
            vaddr: r.u64()?,
        })
    }
}

/// A decoded message: its header fields that matter, and its payload.
#[derive(Clone, PartialEq, Eq)]
pub enum Message {
    /// Client greeting: which key it holds, and its nonce.
    Hello {
        /// The key's name (the key itself never crosses the wire).
        key_id: String,
        /// Fresh random bytes.
        nonce: [u8; NONCE_LEN],
    },
    /// Server challenge: its nonce. It proves nothing yet, so a client that holds no key
    /// learns nothing to test guesses against (and an unknown key gets one just the same).
    Challenge {
        /// Fresh random bytes.
        nonce: [u8; NONCE_LEN],
    },
    /// The client's proof of the key over both nonces.
    Proof {
        /// HMAC of the key over the client label and both nonces.
        proof: [u8; NONCE_LEN],
    },
    /// The server accepted the client's proof: its own proof, and which instance of the agent
    /// this is.
    Welcome {
        /// HMAC of the key over the server label and both nonces.
        proof: [u8; NONCE_LEN],
        /// Drawn at random when the agent starts: a restarted agent (whose memory exports
        /// start empty) has another one, so no transfer can mix two instances' bytes.
        instance: u64,
    },
    /// Read `len` bytes of `export` at `offset`.
    ReadReq {
        /// The export's name.
        export: String,
        /// Byte offset in the export.
        offset: u64,
        /// Bytes to read (at most [`MAX_DATA`]).
        len: u64,
    },
    /// Write `data` to `export` at `offset`.
    WriteReq {
        /// The export's name.
        export: String,
        /// Byte offset in the export.
        offset: u64,
        /// The bytes (at most [`MAX_DATA`]).
        data: Vec<u8>,
    },
    /// The bytes read.
    ReadResp {
        /// The bytes.
        data: Vec<u8>,
    },
    /// Bytes written.
    WriteResp {
        /// How many.
        written: u64,
    },
    /// Asks for an export's size and access.
    StatReq {
        /// The export's name.
        export: String,
    },
    /// An export's size and access.
    StatResp {
        /// Bytes readable now.
        size: u64,
        /// The most bytes writes may reach (a file export may grow to it).
        capacity: u64,
        /// Whether this session may write it.
        writable: bool,
        /// The agent's instance (as in [`Message::Welcome`]).
        instance: u64,
    },
    /// RDMA connection information: the agent's queue pair and the export's region.
    RdmaInfo(RdmaInfo),
    /// A client's request to reach `export` over RDMA from its queue pair `info` (its `rkey`
    /// and `vaddr` are unused).
    RdmaRequest {
        /// The client's queue pair.
        info: RdmaInfo,
        /// The export to reach.
        export: String,
    },
    /// A refused or failed request.
    Error {
        /// The error code (negative; docs/REFERENCE.md#error-codes).
        code: i32,
        /// What went wrong.
        message: String,
    },
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Data payloads are summarised, and proofs and nonces are not printed.
        match self {
            Self::Hello { key_id, .. } => write!(f, "Hello {{ key_id: {key_id:?} }}"),
            Self::Challenge { .. } => write!(f, "Challenge"),
            Self::Proof { .. } => write!(f, "Proof"),
            Self::Welcome { instance, .. } => write!(f, "Welcome {{ instance {instance:#x} }}"),
            Self::ReadReq {
                export,
                offset,
                len,
            } => write!(f, "ReadReq {{ {export:?}, {offset}+{len} }}"),
            Self::WriteReq {
                export,
                offset,
                data,
            } => write!(f, "WriteReq {{ {export:?}, {offset}+{} }}", data.len()),
            Self::ReadResp { data } => write!(f, "ReadResp {{ {} bytes }}", data.len()),
            Self::WriteResp { written } => write!(f, "WriteResp {{ {written} }}"),
            Self::StatReq { export } => write!(f, "StatReq {{ {export:?} }}"),
            Self::StatResp {
                size,
                capacity,
                writable,
                instance,
            } => write!(
                f,
                "StatResp {{ {size} of {capacity} bytes, writable: {writable}, instance \
                 {instance:#x} }}"
            ),
            Self::RdmaInfo(i) => write!(f, "{i:?}"),
            Self::RdmaRequest { info, export } => {
                write!(f, "RdmaRequest {{ {export:?}, {info:?} }}")
            }
            Self::Error { code, message } => write!(f, "Error {{ {code}: {message:?} }}"),
        }
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

impl Message {
    /// The message type this message is sent as.
    pub fn msg_type(&self) -> MsgType {
        match self {
            Self::Hello { .. } | Self::Proof { .. } => MsgType::Hello,
            Self::Challenge { .. } | Self::Welcome { .. } => MsgType::HelloAck,
            Self::ReadReq { .. } => MsgType::ReadReq,
            Self::WriteReq { .. } => MsgType::WriteReq,
            Self::ReadResp { .. } => MsgType::ReadResp,
            Self::WriteResp { .. } => MsgType::WriteResp,
            Self::StatReq { .. } => MsgType::StatReq,
            Self::StatResp { .. } => MsgType::StatResp,
            Self::RdmaInfo(_) | Self::RdmaRequest { .. } => MsgType::RdmaInfo,
            Self::Error { .. } => MsgType::Error,
        }
    }

    fn flags(&self) -> u32 {
        match self {
            Self::Proof { .. } => FLAG_PROOF,
            Self::Welcome { .. } => FLAG_WELCOME,
            Self::RdmaRequest { .. } => FLAG_RDMA_REQUEST,
            _ => 0,
        }
    }

    /// Encodes the whole message (header and payload) under `request_id`. Strings and data
    /// beyond the limits are cut to them (a sender's bug must not produce an undecodable
    /// message).
    pub fn encode(&self, request_id: u64) -> Vec<u8> {
        let mut p = Vec::new();
        let name = |s: &str| -> String { truncate(s, MAX_NAME) };
        match self {
            Self::Hello { key_id, nonce } => {
                put_str(&mut p, &name(key_id));
                p.extend_from_slice(nonce);
            }
            Self::Challenge { nonce } => p.extend_from_slice(nonce),
            Self::Proof { proof } => p.extend_from_slice(proof),
            Self::Welcome { proof, instance } => {
                p.extend_from_slice(proof);
                p.extend_from_slice(&instance.to_le_bytes());
            }
            Self::ReadReq {
                export,
                offset,
                len,
            } => {
                put_str(&mut p, &name(export));
                p.extend_from_slice(&offset.to_le_bytes());
                p.extend_from_slice(&len.to_le_bytes());
            }
            Self::WriteReq {
                export,
                offset,
                data,
            } => {
                let d = &data[..data.len().min(MAX_DATA)];
                let mut out = write_req_head(request_id, export, *offset, d.len());
                out.extend_from_slice(d);
                return out;
            }
            Self::ReadResp { data } => {
                let d = &data[..data.len().min(MAX_DATA)];
                let mut out = read_resp_head(request_id, d.len()).to_vec();
                out.extend_from_slice(d);
                return out;
            }
            Self::WriteResp { written } => p.extend_from_slice(&written.to_le_bytes()),
            Self::StatReq { export } => put_str(&mut p, &name(export)),
            Self::StatResp {
                size,
                capacity,
                writable,
                instance,
            } => {
                p.extend_from_slice(&size.to_le_bytes());
                p.extend_from_slice(&capacity.to_le_bytes());
                p.push(u8::from(*writable));
                p.extend_from_slice(&instance.to_le_bytes());
            }
            Self::RdmaInfo(i) => i.put(&mut p),
            Self::RdmaRequest { info, export } => {
                info.put(&mut p);
                put_str(&mut p, &name(export));
            }
            Self::Error { code, message } => {
                p.extend_from_slice(&code.to_le_bytes());
                put_str(&mut p, &truncate(message, MAX_MESSAGE));
            }
        }
        let header = Header {
            msg_type: self.msg_type(),
            flags: self.flags(),
            request_id,
            payload_len: p.len() as u64,
        };
        let mut out = Vec::with_capacity(HEADER_LEN + p.len());
        out.extend_from_slice(&header.encode());
        out.extend_from_slice(&p);
        out
    }

    /// Decodes the payload of a message whose header was checked by [`Header::decode`].
    pub fn decode(header: &Header, payload: &[u8]) -> Result<Self, WireError> {
        if payload.len() as u64 != header.payload_len {
            return Err(WireError::Malformed {
                what: "message",
                why: format!(
                    "{} payload bytes where the header says {}",
                    payload.len(),
                    header.payload_len
                ),
            });
        }
        let what = match header.msg_type {
            MsgType::Hello => "HELLO",
            MsgType::HelloAck => "HELLO_ACK",
            MsgType::ReadReq => "READ_REQ",
            MsgType::WriteReq => "WRITE_REQ",
            MsgType::ReadResp => "READ_RESP",
            MsgType::WriteResp => "WRITE_RESP",
            MsgType::StatReq => "STAT_REQ",
            MsgType::StatResp => "STAT_RESP",
            MsgType::RdmaInfo => "RDMA_INFO",
            MsgType::Error => "ERROR",
        };
        let mut r = Reader { what, b: payload };
        let flags = header.flags;
        let msg = match (header.msg_type, flags) {
            (MsgType::Hello, 0) => Self::Hello {
                key_id: r.string(MAX_NAME)?,
                nonce: r.array()?,
            },
            (MsgType::Hello, FLAG_PROOF) => Self::Proof { proof: r.array()? },
            (MsgType::HelloAck, 0) => Self::Challenge { nonce: r.array()? },
            (MsgType::HelloAck, FLAG_WELCOME) => Self::Welcome {
                proof: r.array()?,
                instance: r.u64()?,
            },
            (MsgType::ReadReq, 0) => {
                let export = r.string(MAX_NAME)?;
                let offset = r.u64()?;
                let len = r.u64()?;
                if len > MAX_DATA as u64 {
                    return Err(r.bad(format!("a read of {len} bytes (limit {MAX_DATA})")));
                }
                Self::ReadReq {
                    export,
                    offset,
                    len,
                }
            }
            (MsgType::WriteReq, 0) => Self::WriteReq {
                export: r.string(MAX_NAME)?,
                offset: r.u64()?,
                data: r.data()?,
            },
            (MsgType::ReadResp, 0) => Self::ReadResp { data: r.data()? },
            (MsgType::WriteResp, 0) => Self::WriteResp { written: r.u64()? },
            (MsgType::StatReq, 0) => Self::StatReq {
                export: r.string(MAX_NAME)?,
            },
            (MsgType::StatResp, 0) => {
                let size = r.u64()?;
                let capacity = r.u64()?;
                let writable = match r.array::<1>()? {
                    [0] => false,
                    [1] => true,
                    [b] => return Err(r.bad(format!("writable flag {b}"))),
                };
                Self::StatResp {
                    size,
                    capacity,
                    writable,
                    instance: r.u64()?,
                }
            }
            (MsgType::RdmaInfo, 0) => Self::RdmaInfo(RdmaInfo::take(&mut r)?),
            (MsgType::RdmaInfo, FLAG_RDMA_REQUEST) => Self::RdmaRequest {
                info: RdmaInfo::take(&mut r)?,
                export: r.string(MAX_NAME)?,
            },
            (MsgType::Error, 0) => {
                let code = i32::from_le_bytes(r.array()?);
                Self::Error {
                    code,
                    message: r.string(MAX_MESSAGE)?,
                }
            }
            (_, f) => return Err(r.bad(format!("flags {f:#x}"))),
        };
        r.end()?;
        Ok(msg)
    }
}

/// Bytes in front of a READ_RESP's data: the header and the data length.
pub const READ_RESP_HEAD: usize = HEADER_LEN + 8;

/// The header and length of a READ_RESP carrying `len` bytes (at most [`MAX_DATA`]): the
/// agent sends the data straight from the export after it, the client receives it straight
/// into the destination.
pub fn read_resp_head(request_id: u64, len: usize) -> [u8; READ_RESP_HEAD] {
    let mut out = [0u8; READ_RESP_HEAD];
    let header = Header {
        msg_type: MsgType::ReadResp,
        flags: 0,
        request_id,
        payload_len: 8 + len as u64,
    };
    out[..HEADER_LEN].copy_from_slice(&header.encode());
    out[HEADER_LEN..].copy_from_slice(&(len as u64).to_le_bytes());
    out
}

/// Checks the header and length in front of a READ_RESP's data against the `expected` bytes.
pub fn check_read_resp(
    header: &Header,
    len_field: [u8; 8],
    expected: usize,
) -> Result<(), WireError> {
    let len = u64::from_le_bytes(len_field);
    if len != expected as u64 || header.payload_len != 8 + len || header.flags != 0 {
        return Err(WireError::Malformed {
            what: "READ_RESP",
            why: format!(
                "{len} bytes (payload {}) for a read of {expected}",
                header.payload_len
            ),
        });
    }
    Ok(())
}

/// Everything of a WRITE_REQ but its data: the client sends the data from the caller's slice
/// after it.
pub fn write_req_head(request_id: u64, export: &str, offset: u64, len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(2 + export.len() + 16);
    put_str(&mut p, &truncate(export, MAX_NAME));
    p.extend_from_slice(&offset.to_le_bytes());
    p.extend_from_slice(&(len as u64).to_le_bytes());
    let header = Header {
        msg_type: MsgType::WriteReq,
        flags: 0,
        request_id,
        payload_len: (p.len() + len) as u64,
    };
    let mut out = Vec::with_capacity(HEADER_LEN + p.len() + len);
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(&p);
    out
}

/// The fields of a WRITE_REQ in front of its data, decoded by a receiver that streams the
/// data into place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteHead {
    /// The export's name.
    pub export: String,
    /// Byte offset in the export.
    pub offset: u64,
    /// Bytes of data that follow.
    pub len: u64,
}

impl WriteHead {
    /// Bytes of the fields after the name's 2-byte length: the name, the offset, the length.
    pub fn rest_len(name_len: [u8; 2]) -> usize {
        u16::from_le_bytes(name_len) as usize + 16
    }

    /// Decodes the fields (`prefix`: the name's length, the name, offset and length) and
    /// checks them against the header: a known size, at most [`MAX_DATA`] bytes of data, and a
    /// payload of exactly the fields and the data.
    pub fn decode(header: &Header, prefix: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader {
            what: "WRITE_REQ",
            b: prefix,
        };
        if header.msg_type != MsgType::WriteReq || header.flags != 0 {
            return Err(r.bad(format!("{:?} flags {:#x}", header.msg_type, header.flags)));
        }
        let export = r.string(MAX_NAME)?;
        let offset = r.u64()?;
        let len = r.u64()?;
        r.end()?;
        if len > MAX_DATA as u64 {
            return Err(WireError::Malformed {
                what: "WRITE_REQ",
                why: format!("{len} bytes of data (limit {MAX_DATA})"),
            });
        }
        if header.payload_len != prefix.len() as u64 + len {
            return Err(WireError::Malformed {
                what: "WRITE_REQ",
                why: format!(
                    "a payload of {} bytes for {len} bytes of data",
                    header.payload_len
                ),
            });
        }
        Ok(Self {
            export,
            offset,
            len,
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(m: Message) {
        let bytes = m.encode(7);
        let h = Header::decode(bytes[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!(h.request_id, 7);
        assert_eq!(Message::decode(&h, &bytes[HEADER_LEN..]).unwrap(), m);
    }

    #[test]
    fn streamed_heads_match_whole_messages() {
        let w = Message::WriteReq {
            export: "ckpt".into(),
            offset: 99,
            data: vec![4; 300],
        }
        .encode(5);
        let h = Header::decode(w[..HEADER_LEN].try_into().unwrap()).unwrap();
        let rest = WriteHead::rest_len([w[HEADER_LEN], w[HEADER_LEN + 1]]);
        let prefix = &w[HEADER_LEN..HEADER_LEN + 2 + rest];
        let head = WriteHead::decode(&h, prefix).unwrap();
        assert_eq!(
            (head.export.as_str(), head.offset, head.len),
            ("ckpt", 99, 300)
        );
        assert_eq!(&w[HEADER_LEN + 2 + rest..], &[4; 300][..]);
        // A header claiming more payload than the fields and data is refused.
        let longer = Header {
            payload_len: h.payload_len + 1,
            ..h
        };
        assert!(WriteHead::decode(&longer, prefix).is_err());

        let r = Message::ReadResp { data: vec![1; 77] }.encode(6);
        assert_eq!(&r[..READ_RESP_HEAD], &read_resp_head(6, 77));
        let h = Header::decode(r[..HEADER_LEN].try_into().unwrap()).unwrap();
        let len: [u8; 8] = r[HEADER_LEN..READ_RESP_HEAD].try_into().unwrap();
        assert!(check_read_resp(&h, len, 77).is_ok());
        assert!(check_read_resp(&h, len, 78).is_err());
    }

    #[test]
    fn every_message_round_trips() {
        for m in [
            Message::Hello {
                key_id: "ops".into(),
                nonce: [3; NONCE_LEN],
            },
            Message::Challenge {
                nonce: [1; NONCE_LEN],
            },
            Message::Proof {
                proof: [9; NONCE_LEN],
            },
            Message::Welcome {
                proof: [2; NONCE_LEN],
                instance: 0x1234_5678_9abc_def0,
            },
            Message::ReadReq {
                export: "kv".into(),
                offset: 1 << 40,
                len: 4096,
            },
            Message::WriteReq {
                export: "ckpt".into(),
                offset: 12,
                data: vec![5; 1000],
            },
            Message::ReadResp {
                data: vec![1, 2, 3],
            },
            Message::WriteResp { written: 1000 },
            Message::StatReq {
                export: "kv".into(),
            },
            Message::StatResp {
                size: 1 << 33,
                capacity: 1 << 34,
                writable: true,
                instance: 42,
            },
            Message::RdmaRequest {
                info: RdmaInfo {
                    qp_num: 9,
                    lid: 0,
                    gid: [7; 16],
                    rkey: 0,
                    vaddr: 0,
                },
                export: "kv".into(),
            },
            Message::RdmaInfo(RdmaInfo {
                qp_num: 0x12345,
                lid: 7,
                gid: [0xfe; 16],
                rkey: 99,
                vaddr: 0xdead_0000,
            }),
            Message::Error {
                code: -9,
                message: "read-only export".into(),
            },
        ] {
            round_trip(m);
        }
    }

    #[test]
    fn bad_headers_and_payloads_are_refused() {
        let good = Message::WriteResp { written: 1 }.encode(1);
        let mut h: [u8; HEADER_LEN] = good[..HEADER_LEN].try_into().unwrap();
        h[0] ^= 1;
        assert!(matches!(Header::decode(&h), Err(WireError::BadMagic(_))));
        let mut h: [u8; HEADER_LEN] = good[..HEADER_LEN].try_into().unwrap();
        h[4] = 9;
        assert!(matches!(Header::decode(&h), Err(WireError::BadVersion(9))));
        let mut h: [u8; HEADER_LEN] = good[..HEADER_LEN].try_into().unwrap();
        h[6] = 0x77;
        assert!(matches!(
            Header::decode(&h),
            Err(WireError::UnknownType(0x77))
        ));
        let mut h: [u8; HEADER_LEN] = good[..HEADER_LEN].try_into().unwrap();
        h[20..28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(Header::decode(&h), Err(WireError::TooLarge(_))));
        // A payload one byte short, and one byte long.
        let h = Header::decode(good[..HEADER_LEN].try_into().unwrap()).unwrap();
        let short = Header {
            payload_len: 7,
            ..h
        };
        assert!(Message::decode(&short, &good[HEADER_LEN..HEADER_LEN + 7]).is_err());
        let mut long = good[HEADER_LEN..].to_vec();
        long.push(0);
        let longh = Header {
            payload_len: 9,
            ..h
        };
        assert!(Message::decode(&longh, &long).is_err());
        // A read asking for more than one message may carry.
        let big = Message::ReadReq {
            export: "x".into(),
            offset: 0,
            len: MAX_DATA as u64 + 1,
        }
        .encode(1);
        let bh = Header::decode(big[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert!(Message::decode(&bh, &big[HEADER_LEN..]).is_err());
    }
}
