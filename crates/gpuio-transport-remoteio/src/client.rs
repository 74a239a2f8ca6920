//! A blocking RemoteIO client over one TCP connection: the HELLO handshake (the client checks
//! the agent's proof too), then reads and writes of any size, split into messages of at most
//! [`MAX_DATA`] bytes.

use crate::auth;
use crate::wire::{HEADER_LEN, Header, MAX_DATA, Message};
use crate::{RemoteIoError, Result, code_from_i32};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A connection to an agent.
#[derive(Debug)]
pub struct RemoteClient {
    stream: TcpStream,
    next_id: u64,
}

impl RemoteClient {
    /// Connects to the agent at `addr` and authenticates with the key `key_id` / `secret`.
    /// `timeout` bounds the connect and every later wait for the agent.
    pub fn connect(
        addr: SocketAddr,
        key_id: &str,
        secret: &[u8],
        timeout: Duration,
    ) -> Result<Self> {
        let stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let mut c = Self { stream, next_id: 1 };
        let cn = auth::nonce()?;
        c.send(
            &Message::Hello {
                key_id: key_id.into(),
                nonce: cn,
            },
            0,
        )?;
        let (sn, proof) = match c.recv()?.1 {
            Message::Challenge { nonce, proof } => (nonce, proof),
            Message::Error { message, .. } => return Err(RemoteIoError::Auth(message)),
            other => return Err(unexpected(&other)),
        };
        if !auth::check_server(secret, &cn, &sn, &proof) {
            return Err(RemoteIoError::Auth(
                "the agent could not prove it holds the key".into(),
            ));
        }
        let proof = auth::client_proof(secret, &cn, &sn)
            .ok_or_else(|| RemoteIoError::Auth("unusable key".into()))?;
        c.send(&Message::Proof { proof }, 0)?;
        match c.recv()?.1 {
            Message::Welcome => Ok(c),
            Message::Error { message, .. } => Err(RemoteIoError::Auth(message)),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads `buf.len()` bytes of `export` at `offset`.
    pub fn read(&mut self, export: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        let mut at = 0usize;
        while at < buf.len() {
            let n = (buf.len() - at).min(MAX_DATA);
            let id = self.request(&Message::ReadReq {
                export: export.into(),
                offset: advance(offset, at)?,
                len: n as u64,
            })?;
            match self.response(id)? {
                Message::ReadResp { data } if data.len() == n => {
                    buf[at..at + n].copy_from_slice(&data);
                }
                Message::ReadResp { data } => {
                    return Err(RemoteIoError::Protocol(crate::wire::WireError::Malformed {
                        what: "READ_RESP",
                        why: format!("{} bytes for a read of {n}", data.len()),
                    }));
                }
                other => return Err(unexpected(&other)),
            }
            at += n;
        }
        Ok(())
    }

    /// Writes `data` to `export` at `offset`; returns the bytes written (all of them).
    pub fn write(&mut self, export: &str, offset: u64, data: &[u8]) -> Result<u64> {
        let mut at = 0usize;
        while at < data.len() {
            let n = (data.len() - at).min(MAX_DATA);
            let id = self.request(&Message::WriteReq {
                export: export.into(),
                offset: advance(offset, at)?,
                data: data[at..at + n].to_vec(),
            })?;
            match self.response(id)? {
                Message::WriteResp { written } if written == n as u64 => {}
                Message::WriteResp { written } => {
                    return Err(RemoteIoError::Protocol(crate::wire::WireError::Malformed {
                        what: "WRITE_RESP",
                        why: format!("{written} bytes written of {n}"),
                    }));
                }
                other => return Err(unexpected(&other)),
            }
            at += n;
        }
        Ok(data.len() as u64)
    }

    /// Sends raw bytes (tests use it to break the protocol on purpose).
    #[doc(hidden)]
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<()> {
        self.stream.write_all(bytes)?;
        Ok(())
    }

    fn request(&mut self, msg: &Message) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        self.send(msg, id)?;
        Ok(id)
    }

    /// The response to request `id`: an ERROR becomes [`RemoteIoError::Remote`].
    fn response(&mut self, id: u64) -> Result<Message> {
        let (header, msg) = self.recv()?;
        if let Message::Error { code, message } = msg {
            return Err(RemoteIoError::Remote {
                code: code_from_i32(code),
                message,
            });
        }
        if header.request_id != id {
            return Err(RemoteIoError::Protocol(crate::wire::WireError::Malformed {
                what: "response",
                why: format!("answers request {} instead of {id}", header.request_id),
            }));
        }
        Ok(msg)
    }

    fn send(&mut self, msg: &Message, id: u64) -> Result<()> {
        self.stream.write_all(&msg.encode(id))?;
        Ok(())
    }

    fn recv(&mut self) -> Result<(Header, Message)> {
        let mut h = [0u8; HEADER_LEN];
        self.stream.read_exact(&mut h).map_err(timeouts)?;
        let header = Header::decode(&h)?;
        let mut payload = vec![0u8; header.payload_len as usize];
        self.stream.read_exact(&mut payload).map_err(timeouts)?;
        Ok((header, Message::decode(&header, &payload)?))
    }
}

fn advance(offset: u64, by: usize) -> Result<u64> {
    offset
        .checked_add(by as u64)
        .ok_or_else(|| RemoteIoError::InvalidArgument(format!("offset {offset}+{by} overflows")))
}

fn unexpected(msg: &Message) -> RemoteIoError {
    RemoteIoError::Protocol(crate::wire::WireError::Malformed {
        what: "response",
        why: format!("unexpected {msg:?}"),
    })
}

/// A read that hit the socket timeout is a timeout, not a network failure.
fn timeouts(e: std::io::Error) -> RemoteIoError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            RemoteIoError::TimedOut("waiting for the agent".into())
        }
        _ => RemoteIoError::Network(e),
    }
}
