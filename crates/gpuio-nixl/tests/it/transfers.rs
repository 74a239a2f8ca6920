//! Two agents in one process, over UCX: one-sided reads and writes between registered host
//! memory, every byte checked; the range checks made before posting; and what a peer without
//! the metadata (or with stale metadata) can do, which is nothing.

use gpuio_hal::{ErrorCode, HostAllocOptions, HostBuffer};
use gpuio_nixl::{NixlAgent, NixlMem, NixlRemote};

pub(crate) fn filled(len: usize, seed: u64) -> HostBuffer {
    let mut b = HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap();
    let mut x = seed | 1;
    for w in b.as_u64s_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *w = x;
    }
    b
}

#[test]
fn the_library_reports_its_plugins() {
    let Some(lib) = crate::nixl() else { return };
    assert!(lib.plugins.iter().any(|p| p == "UCX"), "{:?}", lib.plugins);
}

#[test]
fn reads_and_writes_move_every_byte() {
    if crate::nixl().is_none() {
        return;
    }
    const LEN: usize = 64 << 20;
    let (a, b) = (
        NixlAgent::new("it-a").unwrap(),
        NixlAgent::new("it-b").unwrap(),
    );
    let src = filled(LEN, 7);
    let mut dst = filled(LEN, 9);
    let exposed = a.register(&src, 0..LEN).unwrap();
    let local = b.register(&dst, 0..LEN).unwrap();
    let peer = b.connect(&a.metadata().unwrap()).unwrap();
    assert_eq!(peer.name(), "it-a");
    let remote = exposed.remote();

    // The whole region, then a piece at odd offsets.
    b.read_into(&local, dst.as_mut_slice(), &peer, &remote, 0)
        .unwrap();
    assert!(dst.as_slice() == src.as_slice(), "the read's bytes differ");
    let piece = &mut dst.as_mut_slice()[12_345..12_345 + 1_000_003];
    piece.fill(0);
    b.read_into(&local, piece, &peer, &remote, 777).unwrap();
    assert!(piece == &src.as_slice()[777..777 + 1_000_003]);

    // A write lands in the peer's memory.
    let fresh = filled(LEN, 11);
    dst.as_mut_slice().copy_from_slice(fresh.as_slice());
    b.write_from(
        &local,
        &dst.as_slice()[..LEN / 2],
        &peer,
        &remote,
        (LEN / 4) as u64,
    )
    .unwrap();
    assert!(src.as_slice()[LEN / 4..LEN / 4 + LEN / 2] == fresh.as_slice()[..LEN / 2]);
    assert!(src.as_slice()[..LEN / 4] != fresh.as_slice()[..LEN / 4]);

    // Memory no registration covers, registered for the call alone: both ways.
    let mut plain = vec![0u8; 3 << 20];
    b.read_direct(&mut plain, &peer, &remote, 5).unwrap();
    assert!(plain[..] == src.as_slice()[5..5 + (3 << 20)]);
    let mine: Vec<u8> = (0..1_000_001).map(|i| (i % 239) as u8).collect();
    b.write_direct(&mine, &peer, &remote, 99).unwrap();
    assert!(src.as_slice()[99..99 + mine.len()] == mine[..]);
    let e = b
        .read_direct(&mut plain, &peer, &remote, LEN as u64)
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
}

#[test]
fn ranges_are_checked_before_anything_is_posted() {
    if crate::nixl().is_none() {
        return;
    }
    let (a, b) = (
        NixlAgent::new("rc-a").unwrap(),
        NixlAgent::new("rc-b").unwrap(),
    );
    let src = filled(1 << 20, 1);
    let mut dst = filled(1 << 20, 2);
    let remote = a.register(&src, 4096..8192).unwrap().remote();
    let local = b.register(&dst, 0..4096).unwrap();
    let peer = b.connect(&a.metadata().unwrap()).unwrap();
    let before = dst.as_slice().to_vec();
    // Past the peer's region, and a local slice outside the registration.
    let e = b
        .read_into(&local, &mut dst.as_mut_slice()[..4096], &peer, &remote, 1)
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
    let e = b
        .read_into(
            &local,
            &mut dst.as_mut_slice()[4000..4200],
            &peer,
            &remote,
            0,
        )
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
    assert!(dst.as_slice() == before.as_slice(), "a refused read wrote");
    // A registration must lie inside its buffer and hold a byte.
    assert_eq!(
        a.register(&src, 0..(2 << 20)).unwrap_err().code(),
        ErrorCode::InvalidArg
    );
    assert_eq!(
        a.register(&src, 5..5).unwrap_err().code(),
        ErrorCode::InvalidArg
    );
}

#[test]
fn without_the_metadata_a_peer_reaches_nothing() {
    if crate::nixl().is_none() {
        return;
    }
    let (a, mut b) = (
        NixlAgent::new("md-a").unwrap(),
        NixlAgent::new("md-b").unwrap(),
    );
    let secret = filled(1 << 20, 3);
    let exposed = a.register(&secret, 0..(1 << 20)).unwrap();
    let mut dst = filled(1 << 20, 4);
    let local = b.register(&dst, 0..(1 << 20)).unwrap();
    let before = dst.as_slice().to_vec();
    // b never loaded a's metadata: through another peer's, a's address reaches nothing.
    let c = NixlAgent::new("md-c").unwrap();
    let other = b.connect(&c.metadata().unwrap()).unwrap();
    let e = b
        .read_into(&local, dst.as_mut_slice(), &other, &exposed.remote(), 0)
        .unwrap_err();
    assert_ne!(e.code(), ErrorCode::Unsupported, "{e}");
    assert!(dst.as_slice() == before.as_slice(), "a refused read wrote");
    // Nor does its own metadata (NIXL refuses to load it).
    assert!(b.connect(&b.metadata().unwrap()).is_err());
    // Metadata that is not NIXL's is refused, not trusted.
    for junk in [&b""[..], b"gpuio", &[0xff; 4096]] {
        assert!(
            b.connect(junk).is_err(),
            "{} junk bytes accepted",
            junk.len()
        );
    }
    // Metadata taken before a registration does not reach it: keys travel with the metadata.
    let early = b.connect(&a.metadata().unwrap()).unwrap();
    let later = filled(1 << 20, 5);
    let late = a.register(&later, 0..(1 << 20)).unwrap();
    let e = b
        .read_into(&local, dst.as_mut_slice(), &early, &late.remote(), 0)
        .unwrap_err();
    assert_ne!(e.code(), ErrorCode::Unsupported, "{e}");
    assert!(dst.as_slice() == before.as_slice(), "a refused read wrote");
    b.forget(&early).unwrap();
    let fresh = b.connect(&a.metadata().unwrap()).unwrap();
    b.read_into(&local, dst.as_mut_slice(), &fresh, &late.remote(), 0)
        .unwrap();
    assert!(dst.as_slice() == later.as_slice());
    // Nor does it reach memory past a registration.
    let outside = NixlRemote {
        addr: late.remote().addr + (1 << 20),
        len: 1 << 20,
        mem: NixlMem::Host,
    };
    let e = b
        .read_into(&local, dst.as_mut_slice(), &fresh, &outside, 0)
        .unwrap_err();
    assert_ne!(e.code(), ErrorCode::Unsupported, "{e}");
}
