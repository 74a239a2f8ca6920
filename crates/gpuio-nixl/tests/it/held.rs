//! Shared host buffers kept registered (`read_held` / `write_held`): registered once, whole,
//! whatever range a transfer moves; an entry is dropped once its buffer is gone or swapped
//! for another; bytes outside what was held still move (registered for the call).

use gpuio_hal::{HeldMapping, HostAllocOptions, HostBuffer, SharedHostBuffer};
use gpuio_nixl::{NixlAgent, NixlPeer, NixlRemote};
use std::sync::Arc;

const LEN: usize = 8 << 20;

fn shared(len: usize) -> Arc<SharedHostBuffer> {
    let buf = HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap();
    Arc::new(SharedHostBuffer::new(buf))
}

/// Reads `len` bytes at `remote_off` into `at..` of `mem`, as RemoteIO does: the addresses
/// held first, then the range's guard.
fn read(
    b: &NixlAgent,
    (peer, remote): (&NixlPeer, &NixlRemote),
    mem: &Arc<SharedHostBuffer>,
    at: usize,
    len: usize,
    remote_off: u64,
) {
    let held: HeldMapping = mem.hold_whole(at, len).unwrap();
    let mut dst = mem.write_range(at, len).unwrap();
    b.read_held(mem, &held, &mut dst, peer, remote, remote_off)
        .unwrap();
}

#[test]
fn a_shared_buffer_is_registered_once_and_dropped_when_gone() {
    if crate::nixl().is_none() {
        return;
    }
    let (a, b) = (
        NixlAgent::new("held-a").unwrap(),
        NixlAgent::new("held-b").unwrap(),
    );
    let src = crate::transfers::filled(LEN, 21);
    let exposed = a.register(&src, 0..LEN).unwrap();
    let peer = b.connect(&a.metadata().unwrap()).unwrap();
    let remote = exposed.remote();
    let far = (&peer, &remote);

    // Several ranges of one buffer: one registration, every byte right.
    let mem = shared(LEN);
    for (at, len, off) in [(0, LEN, 0u64), (4096, 1 << 20, 77), (LEN - 5, 5, 3)] {
        read(&b, far, &mem, at, len, off);
        let got = mem.read();
        let want = &src.as_slice()[off as usize..off as usize + len];
        assert!(&got[at..at + len] == want, "{len} bytes at {at}");
    }
    assert_eq!(b.host_registrations(), 1);

    // A write from it, in place.
    {
        let mut g = mem.write();
        for (i, x) in g.as_mut_slice()[..1000].iter_mut().enumerate() {
            *x = i as u8;
        }
    }
    let held = mem.hold_whole(0, 1000).unwrap();
    let src_bytes = mem.read_range(0, 1000).unwrap();
    b.write_held(&mem, &held, &src_bytes, &peer, &remote, 4000)
        .unwrap();
    drop((src_bytes, held));
    assert!(src.as_slice()[4000..5000] == mem.read()[..1000]);
    assert_eq!(b.host_registrations(), 1);

    // A second buffer is a second entry; once the first is dropped, the next miss forgets it.
    let other = shared(LEN / 2);
    read(&b, far, &other, 0, LEN / 2, 0);
    assert_eq!(b.host_registrations(), 2);
    drop(mem);
    let third = shared(LEN / 4);
    read(&b, far, &third, 100, 1000, 9);
    assert!(third.read()[100..1100] == src.as_slice()[9..1009]);
    assert_eq!(
        b.host_registrations(),
        2,
        "the dropped buffer's entry stayed"
    );

    // A buffer swapped for another: the new one is registered, the old entry goes.
    *third.write() = HostBuffer::alloc(LEN / 4, &HostAllocOptions::default()).unwrap();
    read(&b, far, &third, 0, LEN / 4, 1);
    assert!(third.read()[..] == src.as_slice()[1..1 + LEN / 4]);
    assert_eq!(b.host_registrations(), 2);

    // Bytes outside what was held (here, another buffer's) are registered for the call.
    let held = other.hold_whole(0, 1).unwrap();
    let mut plain = vec![0u8; 3 << 20];
    b.read_held(&other, &held, &mut plain, &peer, &remote, 11)
        .unwrap();
    assert!(plain[..] == src.as_slice()[11..11 + (3 << 20)]);
    assert_eq!(b.host_registrations(), 2);
}
