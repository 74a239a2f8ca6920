//! The RemoteIO wire protocol, as an agent and a client read it: a stream of messages (each a
//! header and its payload), and messages built field by field.
//!
//! What must hold: a header or payload either decodes or is a [`WireError`]; a message that
//! decodes encodes back to the same bytes (decoding is strict, so there is one encoding); the
//! streamed heads (`WriteHead::decode`, `check_read_resp`) accept exactly what the whole
//! decoder accepts, with the same fields; any message a sender builds decodes.

use crate::Target;
use arbitrary::{Arbitrary, Unstructured};
use gpuio_transport_remoteio::wire::{
    HEADER_LEN, Header, Message, MsgType, WriteHead, check_read_resp,
};

pub const TARGET: Target = Target {
    name: "wire",
    parses: "RemoteIO messages: headers, payloads, the streamed READ_RESP and WRITE_REQ heads",
    sources: &["crates/gpuio-transport-remoteio/src/wire"],
    run,
    seeds,
};

/// The first byte picks the form: even, a byte stream as a peer sends it; odd, a message
/// built from the rest.
fn run(data: &[u8]) {
    match data.split_first() {
        Some((mode, rest)) if mode & 1 == 0 => stream(rest),
        Some((_, rest)) => built(rest),
        None => {}
    }
}

fn stream(mut rest: &[u8]) {
    while let Some((head, tail)) = rest.split_first_chunk::<HEADER_LEN>() {
        let Ok(header) = Header::decode(head) else {
            return;
        };
        let n = usize::try_from(header.payload_len).map_or(tail.len(), |n| n.min(tail.len()));
        let (payload, next) = tail.split_at(n);
        let whole = Message::decode(&header, payload);
        if let Ok(m) = &whole {
            let again = m.encode(header.request_id);
            assert_eq!(
                again,
                [&head[..], payload].concat(),
                "{m:?} encodes otherwise"
            );
        }
        streamed_heads_agree(&header, payload, &whole);
        rest = next;
    }
}

/// The decoders of the heads of streamed messages agree with the whole decoder.
fn streamed_heads_agree(
    header: &Header,
    payload: &[u8],
    whole: &Result<Message, impl std::fmt::Debug>,
) {
    let complete = payload.len() as u64 == header.payload_len;
    match header.msg_type {
        MsgType::WriteReq if complete && payload.len() >= 2 => {
            let fields = 2 + WriteHead::rest_len([payload[0], payload[1]]);
            let Some(prefix) = payload.get(..fields) else {
                assert!(
                    whole.is_err(),
                    "a WRITE_REQ shorter than its fields decoded"
                );
                return;
            };
            match (WriteHead::decode(header, prefix), whole) {
                (
                    Ok(h),
                    Ok(Message::WriteReq {
                        export,
                        offset,
                        data,
                    }),
                ) => {
                    assert_eq!(
                        (&h.export, h.offset, h.len),
                        (export, *offset, data.len() as u64)
                    );
                }
                (Err(_), Err(_)) => {}
                (head, whole) => panic!("WRITE_REQ: head {head:?}, whole {whole:?}"),
            }
        }
        MsgType::ReadResp if complete && payload.len() >= 8 => {
            let len: [u8; 8] = payload[..8].try_into().expect("8 bytes");
            let head = check_read_resp(header, len, payload.len() - 8);
            assert_eq!(
                head.is_ok(),
                whole.is_ok(),
                "READ_RESP: head {head:?}, whole {whole:?}"
            );
        }
        _ => {}
    }
}

fn built(bytes: &[u8]) {
    let mut u = Unstructured::new(bytes);
    let (Ok(m), Ok(id)) = (Message::arbitrary(&mut u), u64::arbitrary(&mut u)) else {
        return;
    };
    let b = m.encode(id);
    let header = Header::decode(b[..HEADER_LEN].try_into().expect("a header"))
        .unwrap_or_else(|e| panic!("{m:?} encodes a bad header: {e}"));
    let back = Message::decode(&header, &b[HEADER_LEN..])
        .unwrap_or_else(|e| panic!("{m:?} encodes an undecodable payload: {e}"));
    assert_eq!(back.encode(id), b, "{m:?} decodes to {back:?}");
}

/// Every message type, encoded, as a stream; and as built messages.
fn seeds() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut all = vec![0u8];
    for i in 0..64u8 {
        let noise: Vec<u8> = (0..96u32)
            .map(|j| (j * 31 + u32::from(i) * 17) as u8)
            .collect();
        if let Ok(m) = Message::arbitrary(&mut Unstructured::new(&noise)) {
            let b = m.encode(u64::from(i));
            all.extend_from_slice(&b);
            out.push([&[0u8][..], &b].concat());
        }
        out.push([&[1u8][..], &noise].concat());
    }
    out.push(all);
    out
}
