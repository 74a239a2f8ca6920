//! Device buffers between two agents in one process: registered and moved as GPU memory on
//! CUDA (from the first GPU into the last, `cuda_ipc` or `cuda_copy` as UCX picks), as host
//! memory on the host backend, whose stand-in devices are host memory. Every byte checked.

use gpuio_hal::{Backend, BackendPreference, ErrorCode, pattern};
use gpuio_nixl::{NixlAgent, NixlMem};

#[test]
fn device_buffers_move_as_the_memory_they_are() {
    if crate::nixl().is_none() {
        return;
    }
    const LEN: usize = 16 << 20;
    let probe = gpuio_hal::probe(BackendPreference::Auto).unwrap();
    let (from, to) = (&probe.gpus[0], probe.gpus.last().unwrap());
    let src = from.alloc(LEN).unwrap();
    let mut init = vec![0u8; LEN];
    pattern::fill(&mut init, 0, 3);
    from.stream().unwrap().upload(&init, &src, 0).unwrap();
    let dst = to.alloc(LEN).unwrap();

    let (a, b) = (
        NixlAgent::new("it-dev-a").unwrap(),
        NixlAgent::new("it-dev-b").unwrap(),
    );
    let exposed = a.register_device(&src, 0..LEN).unwrap();
    let remote = exposed.remote();
    let want = match from.backend() {
        Backend::Cuda => NixlMem::Gpu(from.ordinal()),
        Backend::Host => NixlMem::Host,
    };
    assert_eq!(remote.mem, want);
    let peer = b.connect(&a.metadata().unwrap()).unwrap();

    // Into the other device, at odd offsets on both sides.
    b.read_device(&dst, 17..17 + 5_000_001, &peer, &remote, 333)
        .unwrap();
    let mut back = vec![0u8; 5_000_001];
    let stream = to.stream().unwrap();
    stream.download(&dst, 17, &mut back).unwrap();
    assert_eq!(pattern::first_deviation(&back, 333, 3), None);

    // And a write from it into the exposed buffer.
    let data: Vec<u8> = (0..3_000_017).map(|i| (i % 233) as u8).collect();
    stream.upload(&data, &dst, 1).unwrap();
    b.write_device(&dst, 1..1 + data.len(), &peer, &remote, 4097)
        .unwrap();
    let mut now = vec![0u8; data.len()];
    from.stream()
        .unwrap()
        .download(&src, 4097, &mut now)
        .unwrap();
    assert!(now == data, "the write's bytes differ");

    // Into a registered region of it, registered once.
    let region = b.register_device(&dst, 0..LEN).unwrap();
    b.read_region(&region, 4096..4096 + (1 << 20), &peer, &remote, 0)
        .unwrap();
    let mut head = vec![0u8; 1 << 20];
    stream.download(&dst, 4096, &mut head).unwrap();
    assert!(head[..4097] == init[..4097] && head[4097..] == data[..(1 << 20) - 4097]);
    let e = b
        .read_region(&region, LEN - 1..LEN + 1, &peer, &remote, 0)
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");

    // Ranges past either buffer are refused before anything is posted.
    let e = b
        .read_device(&dst, LEN - 10..LEN + 1, &peer, &remote, 0)
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
    let e = b
        .read_device(&dst, 0..11, &peer, &remote, LEN as u64 - 10)
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");

    // One registration serves every transfer into an allocation; a freed allocation's never
    // serves the next one, even at the same addresses (which the driver may hand out again).
    assert_eq!(b.device_registrations(), 1, "dst's allocation");
    for round in 0..3u64 {
        let tmp = to.alloc(1 << 20).unwrap();
        for i in 0..4u64 {
            let at = (4 << 20) + (round * 4 + i) * 65536; // past the write above
            b.read_device(&tmp, 0..65536, &peer, &remote, at).unwrap();
            let mut got = vec![0u8; 65536];
            stream.download(&tmp, 0, &mut got).unwrap();
            assert!(
                got[..] == init[at as usize..at as usize + 65536],
                "round {round}, {i}"
            );
        }
        // dst's and this round's; on the host backend, whose freed allocations the driver
        // cannot be asked about, earlier rounds' may stay until a new one overlaps them.
        let kept = b.device_registrations();
        match to.backend() {
            Backend::Cuda => assert_eq!(kept, 2, "dst's and this round's"),
            Backend::Host => assert!((2..=2 + round as usize).contains(&kept), "{kept}"),
        }
    }
}
