//! RDMA verbs on a real device (soft-RoCE in the QEMU guest: `cargo xtask qemu-rdma`): two
//! queue pairs on one device connected to each other; one-sided reads and writes (through
//! owned buffers and in place in registered ranges), send and receive, compare-and-swap and
//! fetch-and-add, threads sharing a queue pair, a timed-out verb stopping its queue pair, and
//! the NIC refusing what a region does not permit. Without a device the tests say so and pass,
//! unless `GPUIO_REQUIRE_RDMA=1`.

use gpuio_hal::{ErrorCode, HostAllocOptions, HostBuffer, pattern};
use gpuio_rdma::{HostRegion, QueuePair, RdmaAccess, RdmaBuffer, RdmaDevice, device_names};
use gpuio_testkit::Requirement;
use std::sync::Arc;
use std::time::Duration;

fn device() -> Option<Arc<RdmaDevice>> {
    let names = device_names().unwrap_or_default();
    if names.is_empty() {
        Requirement::Rdma.missing("no RDMA device");
        return None;
    }
    Some(
        RdmaDevice::open(None, 1)
            .or_else(|_| RdmaDevice::open(None, 0))
            .unwrap(),
    )
}

/// Two connected queue pairs on one device.
fn pair(dev: &Arc<RdmaDevice>) -> (QueuePair, QueuePair) {
    pair_with(dev, Duration::from_secs(5))
}

fn pair_with(dev: &Arc<RdmaDevice>, t: Duration) -> (QueuePair, QueuePair) {
    let (mut a, mut b) = (
        QueuePair::new(dev, t).unwrap(),
        QueuePair::new(dev, t).unwrap(),
    );
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb).unwrap();
    b.connect(&ea).unwrap();
    (a, b)
}

/// A buffer of `len` pattern bytes (`seed`) exposed to peers with every right.
fn exposed_pattern(dev: &Arc<RdmaDevice>, len: usize, seed: u64) -> (HostBuffer, HostRegion) {
    let mut target = HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut target, 0, seed);
    let all = RdmaAccess {
        remote_read: true,
        remote_write: true,
        remote_atomic: true,
    };
    let exposed = HostRegion::new(dev, &target, 0..len, all).unwrap();
    (target, exposed)
}

#[test]
fn one_sided_reads_writes_and_atomics() {
    let Some(dev) = device() else { return };
    let (a, _b) = pair(&dev);
    let (mut target, exposed) = exposed_pattern(&dev, 1 << 20, 3);
    let remote = exposed.remote();
    let mut local = RdmaBuffer::new(&dev, 256 << 10).unwrap();
    // Read 100 KiB at an odd offset.
    a.read(&mut local, 0, &remote, 12_345, 100_000).unwrap();
    assert_eq!(
        pattern::first_deviation(&local.as_slice()[..100_000], 12_345, 3),
        None
    );
    // Write, and see it in the target.
    pattern::fill(local.as_mut_slice(), 0, 4);
    a.write(&local, 0, &remote, 500_000, 200_000).unwrap();
    assert!(target[500_000..700_000] == local.as_slice()[..200_000]);
    // Atomics on an 8-aligned word.
    target.as_mut_slice()[64..72].copy_from_slice(&41u64.to_ne_bytes());
    let mut scratch = RdmaBuffer::new(&dev, 8).unwrap();
    assert_eq!(a.fetch_add(&mut scratch, &remote, 64, 1).unwrap(), 41);
    assert_eq!(
        a.compare_swap(&mut scratch, &remote, 64, 42, 7).unwrap(),
        42
    );
    assert_eq!(a.compare_swap(&mut scratch, &remote, 64, 42, 9).unwrap(), 7);
    assert_eq!(u64::from_ne_bytes(target[64..72].try_into().unwrap()), 7);
    // Out of the region's bounds: refused before posting.
    let err = a
        .read(&mut local, 0, &remote, (1 << 20) - 10, 100)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg);
    assert!(a.fetch_add(&mut scratch, &remote, 3, 1).is_err());
}

#[test]
fn the_nic_refuses_what_a_region_does_not_permit() {
    let Some(dev) = device() else { return };
    let (a, _b) = pair(&dev);
    let target = HostBuffer::alloc(64 << 10, &HostAllocOptions::default()).unwrap();
    let read_only = HostRegion::new(
        &dev,
        &target,
        0..target.len(),
        RdmaAccess {
            remote_read: true,
            ..RdmaAccess::default()
        },
    )
    .unwrap();
    let mut local = RdmaBuffer::new(&dev, 4096).unwrap();
    a.read(&mut local, 0, &read_only.remote(), 0, 4096).unwrap();
    let err = a
        .write(&local, 0, &read_only.remote(), 0, 4096)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Permission, "{err}");
    assert!(target.iter().all(|&b| b == 0));
}

#[test]
fn send_and_receive() {
    let Some(dev) = device() else { return };
    let (a, b) = pair(&dev);
    let mut msg = RdmaBuffer::new(&dev, 4096).unwrap();
    msg.as_mut_slice()[..11].copy_from_slice(b"hello, rxe!");
    let mut inbox = RdmaBuffer::new(&dev, 4096).unwrap();
    std::thread::scope(|s| {
        let rx = s.spawn(|| b.recv(&mut inbox, 0, 4096).unwrap());
        // The receive must be posted first; RNR retries cover a send that comes early.
        std::thread::sleep(Duration::from_millis(50));
        a.send(&msg, 0, 11).unwrap();
        assert_eq!(rx.join().unwrap(), 11);
    });
    assert_eq!(&inbox.as_slice()[..11], b"hello, rxe!");
}

#[test]
fn verbs_in_place_in_a_registered_range() {
    let Some(dev) = device() else { return };
    let (a, _b) = pair(&dev);
    let (target, exposed) = exposed_pattern(&dev, 4 << 20, 5);
    let remote = exposed.remote();
    // The caller's memory: only its middle is registered, for local use.
    let mut mine = HostBuffer::alloc(3 << 20, &HostAllocOptions::default()).unwrap();
    let region =
        HostRegion::new(&dev, &mine, 4096..(3 << 20) - 4096, RdmaAccess::default()).unwrap();
    a.read_into(&region, &mut mine[4096..4096 + 2_000_001], &remote, 777)
        .unwrap();
    assert_eq!(
        pattern::first_deviation(&mine[4096..4096 + 2_000_001], 777, 5),
        None
    );
    pattern::fill(&mut mine, 0, 6);
    let err = a
        .write_from(
            &region,
            &mine[8192..8192 + 1_000_000],
            &remote,
            (4 << 20) - 1000,
        )
        .unwrap_err();
    assert_eq!(
        err.code(),
        ErrorCode::InvalidArg,
        "past the remote end: {err}"
    );
    a.write_from(&region, &mine[8192..8192 + 1_000_000], &remote, 1 << 20)
        .unwrap();
    assert!(target[1 << 20..(1 << 20) + 1_000_000] == mine[8192..8192 + 1_000_000]);
    // Slices outside the registered range are refused before anything is posted.
    let err = a
        .read_into(&region, &mut mine[..100], &remote, 0)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");
    let end = mine.len();
    let err = a
        .write_from(&region, &mine[end - 5000..end - 3000], &remote, 0)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");
    assert!(!a.is_failed());
}

#[test]
fn threads_share_a_queue_pair() {
    let Some(dev) = device() else { return };
    let (a, _b) = pair(&dev);
    let (target, exposed) = exposed_pattern(&dev, 1 << 20, 8);
    let remote = exposed.remote();
    // Eight threads on one queue pair, each reading its own slice and counting on one word:
    // the completion thread hands every verb its own completions.
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (a, dev) = (&a, &dev);
            s.spawn(move || {
                let mut local = RdmaBuffer::new(dev, 64 << 10).unwrap();
                let mut scratch = RdmaBuffer::new(dev, 8).unwrap();
                for i in 0..50u64 {
                    let at = 4096 + (t * 50 + i) * 1000;
                    a.read(&mut local, 0, &remote, at, 60_000).unwrap();
                    assert_eq!(
                        pattern::first_deviation(&local.as_slice()[..60_000], at, 8),
                        None
                    );
                    a.fetch_add(&mut scratch, &remote, 0, 1).unwrap();
                }
            });
        }
    });
    let start = u64::from_ne_bytes({
        let mut b = vec![0u8; 8];
        pattern::fill(&mut b, 0, 8);
        b.try_into().unwrap()
    });
    let now = u64::from_ne_bytes(target[..8].try_into().unwrap());
    assert_eq!(now.wrapping_sub(start), 400);
}

#[test]
fn a_timed_out_verb_stops_its_queue_pair() {
    let Some(dev) = device() else { return };
    let (a, _b) = pair_with(&dev, Duration::from_millis(200));
    let mut inbox = RdmaBuffer::new(&dev, 4096).unwrap();
    // Nothing is ever sent: the receive times out, and the queue pair is moved to the error
    // state before the buffer is given back.
    let err = a.recv(&mut inbox, 0, 4096).unwrap_err();
    assert_eq!(err.code(), ErrorCode::Timeout, "{err}");
    assert!(a.is_failed());
    let target = HostBuffer::alloc(4096, &HostAllocOptions::default()).unwrap();
    let exposed = HostRegion::new(
        &dev,
        &target,
        0..4096,
        RdmaAccess {
            remote_read: true,
            ..RdmaAccess::default()
        },
    )
    .unwrap();
    let err = a.read(&mut inbox, 0, &exposed.remote(), 0, 16).unwrap_err();
    assert_eq!(err.code(), ErrorCode::Network, "{err}");
    // The device serves new queue pairs as before.
    let (c, _d) = pair(&dev);
    c.read(&mut inbox, 0, &exposed.remote(), 0, 16).unwrap();
}
