//! Unit tests of the wire protocol: every message round-trips, the streamed heads match the
//! whole messages, bad headers and payloads are refused.

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

/// Found by fuzzing: a READ_REQ for more than [`MAX_DATA`] bytes encoded into a message no
/// receiver decodes; the length is cut to the limit, as strings and data are.
#[test]
fn over_long_reads_encode_at_the_limit() {
    let b = Message::ReadReq {
        export: "e".into(),
        offset: 0,
        len: u64::MAX,
    }
    .encode(1);
    let h = Header::decode(b[..HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!(
        Message::decode(&h, &b[HEADER_LEN..]).unwrap(),
        Message::ReadReq {
            export: "e".into(),
            offset: 0,
            len: MAX_DATA as u64
        }
    );
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
            durable: false,
            instance: 42,
        },
        Message::SyncReq {
            export: "ckpt".into(),
        },
        Message::ReserveReq {
            export: "ckpt".into(),
            len: 1 << 36,
        },
        Message::Done,
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
        Message::NixlRequest {
            export: "kv".into(),
        },
        Message::NixlInfo {
            metadata: (0..=255).collect(),
            addr: 0x7f00_dead_0000,
            gpu: None,
        },
        Message::NixlInfo {
            metadata: Vec::new(),
            addr: 0,
            gpu: Some(1),
        },
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
    // A read asking for more than one message may carry (the encoder cuts such a length, so
    // the field is set by hand).
    let mut big = Message::ReadReq {
        export: "x".into(),
        offset: 0,
        len: 1,
    }
    .encode(1);
    let at = big.len() - 8;
    big[at..].copy_from_slice(&(MAX_DATA as u64 + 1).to_le_bytes());
    let bh = Header::decode(big[..HEADER_LEN].try_into().unwrap()).unwrap();
    assert!(Message::decode(&bh, &big[HEADER_LEN..]).is_err());
}

#[test]
fn nixl_metadata_past_its_limit_is_malformed() {
    let mut payload = 0u64.to_le_bytes().to_vec();
    payload.extend_from_slice(&((super::MAX_NIXL_METADATA + 1) as u32).to_le_bytes());
    payload.resize(payload.len() + super::MAX_NIXL_METADATA + 1, 0);
    let header = Header {
        msg_type: MsgType::NixlInfo,
        flags: 0,
        request_id: 1,
        payload_len: payload.len() as u64,
    };
    let e = Message::decode(&header, &payload).unwrap_err();
    assert!(e.to_string().contains("NIXL metadata"), "{e}");
    // And a length past the payload's end is malformed too, not a panic.
    let mut short = 0u64.to_le_bytes().to_vec();
    short.extend_from_slice(&100u32.to_le_bytes());
    short.extend_from_slice(&[1, 2, 3]);
    let header = Header {
        payload_len: short.len() as u64,
        ..header
    };
    assert!(Message::decode(&header, &short).is_err());
}
