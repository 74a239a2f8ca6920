//! The messages of the wire protocol, encoded and decoded whole: the handshake (HELLO and
//! HELLO_ACK with their proofs), READ/WRITE requests and responses, STAT, RDMA_INFO, NIXL_INFO
//! and ERROR.

use super::{
    FLAG_NIXL_REQUEST, FLAG_PROOF, FLAG_RDMA_REQUEST, FLAG_WELCOME, HEADER_LEN, Header, MAX_DATA,
    MAX_MESSAGE, MAX_NAME, MAX_NIXL_METADATA, MsgType, NONCE_LEN, Reader, WireError, put_str,
    read_resp_head, truncate, write_req_head,
};
use std::fmt;

/// NIXL_INFO's device field for host memory.
const HOST_MEMORY: u32 = u32::MAX;

/// RDMA connection information (`gpuio_rdma_info_t`), exchanged over the TCP control channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
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
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
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
        /// Whether [`Message::SyncReq`] makes written bytes durable (a file export; memory
        /// starts afresh when the agent restarts).
        durable: bool,
        /// The agent's instance (as in [`Message::Welcome`]).
        instance: u64,
    },
    /// Asks the agent to make the bytes written to an export durable (`fdatasync` of a file
    /// export); answered [`Message::Done`], or refused where the export cannot be.
    SyncReq {
        /// The export's name.
        export: String,
    },
    /// Asks the agent to reserve room for the first `len` bytes of an export before any is
    /// written (a file export's blocks are allocated), so that a copy the disk cannot hold is
    /// refused before it overwrites anything; answered [`Message::Done`].
    ReserveReq {
        /// The export's name.
        export: String,
        /// Bytes from the start.
        len: u64,
    },
    /// A [`Message::SyncReq`] or [`Message::ReserveReq`] done.
    Done,
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
    /// NIXL's way to an export: the metadata of a NIXL agent that registered the export and
    /// nothing else (a bearer credential for its bytes), its address in the agent's process,
    /// and where it lies.
    NixlInfo {
        /// The NIXL agent's metadata.
        metadata: Vec<u8>,
        /// The export's first byte, in the agent's address space.
        addr: u64,
        /// `Some(ordinal)`: GPU memory of that CUDA device (registered as NIXL's VRAM);
        /// `None`: host memory.
        gpu: Option<u32>,
    },
    /// A client's request to reach `export` over NIXL.
    NixlRequest {
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
                durable,
                instance,
            } => write!(
                f,
                "StatResp {{ {size} of {capacity} bytes, writable: {writable}, durable: \
                 {durable}, instance {instance:#x} }}"
            ),
            Self::SyncReq { export } => write!(f, "SyncReq {{ {export:?} }}"),
            Self::ReserveReq { export, len } => write!(f, "ReserveReq {{ {export:?}, {len} }}"),
            Self::Done => write!(f, "Done"),
            Self::RdmaInfo(i) => write!(f, "{i:?}"),
            Self::RdmaRequest { info, export } => {
                write!(f, "RdmaRequest {{ {export:?}, {info:?} }}")
            }
            // The metadata is a credential: its size only.
            Self::NixlInfo {
                metadata,
                addr,
                gpu,
            } => write!(
                f,
                "NixlInfo {{ {} bytes of metadata, at {addr:#x}, gpu {gpu:?} }}",
                metadata.len()
            ),
            Self::NixlRequest { export } => write!(f, "NixlRequest {{ {export:?} }}"),
            Self::Error { code, message } => write!(f, "Error {{ {code}: {message:?} }}"),
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
            Self::SyncReq { .. } => MsgType::SyncReq,
            Self::ReserveReq { .. } => MsgType::ReserveReq,
            Self::Done => MsgType::Done,
            Self::RdmaInfo(_) | Self::RdmaRequest { .. } => MsgType::RdmaInfo,
            Self::NixlInfo { .. } | Self::NixlRequest { .. } => MsgType::NixlInfo,
            Self::Error { .. } => MsgType::Error,
        }
    }

    fn flags(&self) -> u32 {
        match self {
            Self::Proof { .. } => FLAG_PROOF,
            Self::Welcome { .. } => FLAG_WELCOME,
            Self::RdmaRequest { .. } => FLAG_RDMA_REQUEST,
            Self::NixlRequest { .. } => FLAG_NIXL_REQUEST,
            _ => 0,
        }
    }

    /// Encodes the whole message (header and payload) under `request_id`. Strings, data and
    /// read lengths beyond the limits are cut to them (a sender's bug must not produce an
    /// undecodable message).
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
                p.extend_from_slice(&(*len).min(MAX_DATA as u64).to_le_bytes());
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
                durable,
                instance,
            } => {
                p.extend_from_slice(&size.to_le_bytes());
                p.extend_from_slice(&capacity.to_le_bytes());
                p.push(u8::from(*writable));
                p.push(u8::from(*durable));
                p.extend_from_slice(&instance.to_le_bytes());
            }
            Self::SyncReq { export } => put_str(&mut p, &name(export)),
            Self::ReserveReq { export, len } => {
                put_str(&mut p, &name(export));
                p.extend_from_slice(&len.to_le_bytes());
            }
            Self::Done => {}
            Self::RdmaInfo(i) => i.put(&mut p),
            Self::RdmaRequest { info, export } => {
                info.put(&mut p);
                put_str(&mut p, &name(export));
            }
            Self::NixlInfo {
                metadata,
                addr,
                gpu,
            } => {
                let m = &metadata[..metadata.len().min(MAX_NIXL_METADATA)];
                p.extend_from_slice(&addr.to_le_bytes());
                p.extend_from_slice(&(m.len() as u32).to_le_bytes());
                p.extend_from_slice(m);
                p.extend_from_slice(&gpu.unwrap_or(HOST_MEMORY).to_le_bytes());
            }
            Self::NixlRequest { export } => put_str(&mut p, &name(export)),
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
            MsgType::SyncReq => "SYNC_REQ",
            MsgType::ReserveReq => "RESERVE_REQ",
            MsgType::Done => "DONE",
            MsgType::RdmaInfo => "RDMA_INFO",
            MsgType::NixlInfo => "NIXL_INFO",
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
                let writable = r.flag("writable")?;
                let durable = r.flag("durable")?;
                Self::StatResp {
                    size,
                    capacity,
                    writable,
                    durable,
                    instance: r.u64()?,
                }
            }
            (MsgType::SyncReq, 0) => Self::SyncReq {
                export: r.string(MAX_NAME)?,
            },
            (MsgType::ReserveReq, 0) => Self::ReserveReq {
                export: r.string(MAX_NAME)?,
                len: r.u64()?,
            },
            (MsgType::Done, 0) => Self::Done,
            (MsgType::RdmaInfo, 0) => Self::RdmaInfo(RdmaInfo::take(&mut r)?),
            (MsgType::RdmaInfo, FLAG_RDMA_REQUEST) => Self::RdmaRequest {
                info: RdmaInfo::take(&mut r)?,
                export: r.string(MAX_NAME)?,
            },
            (MsgType::NixlInfo, 0) => {
                let addr = r.u64()?;
                let n = r.u32()? as usize;
                if n > MAX_NIXL_METADATA {
                    return Err(r.bad(format!(
                        "{n} bytes of NIXL metadata (limit {MAX_NIXL_METADATA})"
                    )));
                }
                let metadata = r.take(n)?.to_vec();
                let gpu = Some(r.u32()?).filter(|&g| g != HOST_MEMORY);
                Self::NixlInfo {
                    metadata,
                    addr,
                    gpu,
                }
            }
            (MsgType::NixlInfo, FLAG_NIXL_REQUEST) => Self::NixlRequest {
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
