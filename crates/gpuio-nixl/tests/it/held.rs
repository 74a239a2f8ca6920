//! Host buffers kept registered (`read_kept` / `write_kept`): registered once, whole, whatever
//! range a transfer moves; an entry goes before the agent's next transfer once its buffer is
//! gone or swapped for another; a buffer too large to keep, or bytes outside the buffer
//! named, still move (registered for the call).

use gpuio_hal::{HostAllocOptions, HostBuffer, SharedHostBuffer};
use gpuio_nixl::{NixlAgent, NixlPeer, NixlRemote};

const LEN: usize = 8 << 20;

fn shared(len: usize) -> SharedHostBuffer {
    SharedHostBuffer::new(HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap())
}

/// Reads `len` bytes at `remote_off` into `at..` of `mem`, as RemoteIO does: under the
/// range's guard, which names the buffer.
fn read(
    b: &NixlAgent,
    (peer, remote): (&NixlPeer, &NixlRemote),
    mem: &SharedHostBuffer,
    at: usize,
    len: usize,
    remote_off: u64,
) {
    let mut dst = mem.write_range(at, len).unwrap();
    let whole = dst.buffer();
    b.read_kept(&whole, &mut dst, peer, remote, remote_off)
        .unwrap();
}

#[test]
fn a_host_buffer_is_registered_once_and_forgotten_when_gone() {
    if crate::nixl().is_none() {
        return;
    }
    let (a, b) = (
        NixlAgent::new("kept-a").unwrap(),
        NixlAgent::new("kept-b").unwrap(),
    );
    let src = crate::transfers::filled(LEN, 21);
    let exposed = a.register(&src, 0..LEN).unwrap();
    let peer = b.connect(&a.metadata().unwrap()).unwrap();
    let remote = exposed.remote();
    let far = (&peer, &remote);
    let want = |off: usize, len: usize| &src.as_slice()[off..off + len];

    // Several ranges of one buffer: one registration, every byte right.
    let mem = shared(LEN);
    for (at, len, off) in [(0, LEN, 0), (4096, 1 << 20, 77), (LEN - 5, 5, 3)] {
        read(&b, far, &mem, at, len, off as u64);
        assert!(
            mem.read()[at..at + len] == *want(off, len),
            "{len} bytes at {at}"
        );
    }
    assert_eq!(b.host_registrations(), 1);

    // A write from it, in place.
    for (i, x) in mem.write().as_mut_slice()[..1000].iter_mut().enumerate() {
        *x = i as u8;
    }
    {
        let g = mem.read_range(0, 1000).unwrap();
        b.write_kept(&g.buffer(), &g, &peer, &remote, 4000).unwrap();
    }
    assert!(src.as_slice()[4000..5000] == mem.read()[..1000]);
    assert_eq!(b.host_registrations(), 1);

    // A second buffer is a second entry; once the first is dropped, the next transfer
    // (here a hit on the second) forgets it.
    let other = shared(LEN / 2);
    read(&b, far, &other, 0, LEN / 2, 0);
    assert_eq!(b.host_registrations(), 2);
    drop(mem);
    read(&b, far, &other, 100, 1000, 9);
    assert!(other.read()[100..1100] == *want(9, 1000));
    assert_eq!(
        b.host_registrations(),
        1,
        "the dropped buffer's entry stayed"
    );

    // A buffer swapped for another: the new one is registered, the old entry goes.
    *other.write() = HostBuffer::alloc(LEN / 4, &HostAllocOptions::default()).unwrap();
    read(&b, far, &other, 0, LEN / 4, 1);
    assert!(other.read()[..] == *want(1, LEN / 4));
    assert_eq!(b.host_registrations(), 1);

    // Bytes outside the buffer named (here, a plain vector) are registered for the call.
    let whole = other.read_range(0, 1).unwrap().buffer();
    let mut plain = vec![0u8; 3 << 20];
    b.read_kept(&whole, &mut plain, &peer, &remote, 11).unwrap();
    assert!(plain[..] == *want(11, 3 << 20));

    // A buffer past the largest kept (1 GiB) is registered per call (its pages untouched
    // but the few read).
    let huge = shared((1 << 30) + 4096);
    read(&b, far, &huge, 1 << 30, 4096, 5);
    assert!(huge.read_range(1 << 30, 4096).unwrap()[..] == *want(5, 4096));
    assert_eq!(b.host_registrations(), 1);
}
