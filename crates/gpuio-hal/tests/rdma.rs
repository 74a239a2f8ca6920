//! RDMA verbs on a real device (soft-RoCE in the QEMU guest: `cargo xtask qemu-rdma`): two
//! queue pairs on one device connected to each other; one-sided reads and writes, send and
//! receive, compare-and-swap and fetch-and-add, and the NIC refusing what a region does not
//! permit. Without a device the tests say so and pass, unless `GPUIO_REQUIRE_RDMA=1`.
#![cfg(feature = "rdma")]

use gpuio_hal::rdma::{ExposedRegion, QueuePair, RdmaAccess, RdmaBuffer, RdmaDevice, device_names};
use gpuio_hal::{ErrorCode, HostAllocOptions, HostBuffer, pattern};
use std::sync::Arc;
use std::time::Duration;

fn device() -> Option<Arc<RdmaDevice>> {
    let names = device_names().unwrap_or_default();
    if names.is_empty() {
        assert!(
            std::env::var("GPUIO_REQUIRE_RDMA").as_deref() != Ok("1"),
            "an RDMA device is required (GPUIO_REQUIRE_RDMA=1)"
        );
        eprintln!("skipped: no RDMA device");
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
    let t = Duration::from_secs(5);
    let (mut a, mut b) = (
        QueuePair::new(dev, t).unwrap(),
        QueuePair::new(dev, t).unwrap(),
    );
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb).unwrap();
    b.connect(&ea).unwrap();
    (a, b)
}

#[test]
fn one_sided_reads_writes_and_atomics() {
    let Some(dev) = device() else { return };
    let (mut a, _b) = pair(&dev);
    let mut target = HostBuffer::alloc(1 << 20, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut target, 0, 3);
    let all = RdmaAccess {
        remote_read: true,
        remote_write: true,
        remote_atomic: true,
    };
    let exposed = ExposedRegion::new(&dev, &target, all).unwrap();
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
    let (mut a, _b) = pair(&dev);
    let target = HostBuffer::alloc(64 << 10, &HostAllocOptions::default()).unwrap();
    let read_only = ExposedRegion::new(
        &dev,
        &target,
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
    let (mut a, mut b) = pair(&dev);
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
