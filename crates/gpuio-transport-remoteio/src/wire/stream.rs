//! The heads of the two messages whose data streams: a READ_RESP's header and length, after
//! which the agent sends the data straight from the export and the client receives it straight
//! into the destination; a WRITE_REQ's fields, after which the client sends the data from the
//! caller's slice and the agent receives it into place.

use super::{
    HEADER_LEN, Header, MAX_DATA, MAX_NAME, MsgType, Reader, WireError, put_str, truncate,
};

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
