//! The GPU→host request ring end to end on the host backend: host threads post requests
//! through the same protocol GPU threads follow (`HostProducer`), a `RingProxy` serves them
//! through the engines from real files and host memory into device buffers.

use crate::common;

use gpuio_core::ring::{RingConfig, RingProxy, WaitPolicy};
use gpuio_core::{Endpoint, Engines, ErrorCode};
use gpuio_hal::{BackendPreference, DeviceBuffer, Gpu, HalError, pattern, probe};
use gpuio_ring::{self as ring, RingPost};
use gpuio_transport_localio::{FileHandle, LocalIo, LocalIoConfig, OpenOptions};
use gpuio_transport_memio::{MemIo, MemIoConfig};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const TIMEOUT: Option<Duration> = Some(Duration::from_secs(20));

/// Host-backend engines and the device their buffers belong to.
fn setup() -> (Engines, Gpu) {
    let p = probe(BackendPreference::Host).unwrap();
    let gpu = p.gpus[0].clone();
    let memio = MemIo::new(p.gpus, MemIoConfig::default()).unwrap();
    let localio = LocalIo::new(LocalIoConfig {
        chunk_size: 256 << 10,
        lanes: 2,
        ..LocalIoConfig::default()
    })
    .unwrap();
    (Engines::new(Arc::new(memio), Arc::new(localio)), gpu)
}

fn proxy(engines: &Engines, gpu: &Gpu, slots: usize, threads: usize) -> RingProxy {
    let cfg = RingConfig {
        slots,
        threads,
        ..RingConfig::default()
    };
    RingProxy::new(engines.clone(), gpu, cfg).unwrap()
}

/// A file of `len` pattern bytes of `seed`.
fn pattern_file(dir: &tempfile::TempDir, name: &str, len: usize, seed: u64) -> FileHandle {
    let path = dir.path().join(name);
    let mut bytes = vec![0u8; len];
    pattern::fill(&mut bytes, 0, seed);
    std::fs::write(&path, &bytes).unwrap();
    let opts = OpenOptions {
        write: true,
        ..OpenOptions::READ
    };
    FileHandle::open(&path, opts).unwrap()
}

fn download(gpu: &Gpu, buf: &DeviceBuffer, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    gpu.stream()
        .unwrap()
        .download(buf, offset, &mut out)
        .unwrap();
    out
}

fn upload_pattern(gpu: &Gpu, buf: &DeviceBuffer, offset: usize, len: usize, seed: u64) {
    let mut bytes = vec![0u8; len];
    pattern::fill(&mut bytes, 0, seed);
    gpu.stream().unwrap().upload(&bytes, buf, offset).unwrap();
}

/// Runs `f` on a thread and fails the test if it has not finished within `limit` (a hang in
/// the protocol must fail, not stall CI).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => {
            worker.join().unwrap();
            v
        }
        Err(_) => {
            // Either a hang or a panic: a panic shows through join.
            if worker.is_finished() {
                worker.join().unwrap();
            }
            panic!("the test did not finish within {limit:?}");
        }
    }
}

#[test]
fn reads_and_writes_round_trip_from_files_host_and_device_memory() {
    within(Duration::from_secs(60), || {
        let (engines, gpu) = setup();
        let mut proxy = proxy(&engines, &gpu, 8, 2);
        let dir = tempfile::tempdir().unwrap();
        const FILE_LEN: usize = 1 << 20;
        let file = pattern_file(&dir, "data", FILE_LEN, 11);
        let host = common::host(FILE_LEN, 12);
        let dev_src = gpu.alloc(FILE_LEN).unwrap();
        upload_pattern(&gpu, &dev_src, 0, FILE_LEN, 13);
        // The file is registered at an origin of 4096: request offsets count from there.
        let file_h = proxy.register(Endpoint::file(&file, 4096)).unwrap();
        let host_h = proxy.register(Endpoint::host(&host, 0)).unwrap();
        let dev_h = proxy.register(Endpoint::device(&dev_src, 0)).unwrap();
        assert_eq!((file_h, host_h, dev_h), (1, 2, 3));

        let dst = gpu.alloc(FILE_LEN).unwrap();
        proxy.register_device(&dst).unwrap();
        let p = proxy.host_producer().unwrap();

        let sizes = [1usize, 7, 64, 4095, 4096, 65_537, 300_000];
        let mut moved = 0u64;
        for (i, &len) in sizes.iter().enumerate() {
            let off = (i * 3001) % 10_000;
            let dst_off = (i * 777) % 4096;
            let dst_addr = dst.device_addr() + dst_off as u64;
            let check = |seed: u64, first: u64| {
                let got = download(&gpu, &dst, dst_off, len);
                assert_eq!(
                    pattern::first_deviation(&got, first, seed),
                    None,
                    "{len} bytes from offset {first} of seed {seed}"
                );
            };
            // READ: file → device.
            let n = p.read(file_h, off as u64, len as u64, dst_addr, TIMEOUT);
            assert_eq!(n.unwrap(), len as u64);
            check(11, 4096 + off as u64);
            // READ: host memory → device.
            assert_eq!(
                p.read(host_h, off as u64, len as u64, dst_addr, TIMEOUT)
                    .unwrap(),
                len as u64
            );
            check(12, off as u64);
            // READ: device → device.
            assert_eq!(
                p.read(dev_h, off as u64, len as u64, dst_addr, TIMEOUT)
                    .unwrap(),
                len as u64
            );
            check(13, off as u64);
            // WRITE: device → file, then device → host memory.
            upload_pattern(&gpu, &dst, dst_off, len, 100 + i as u64);
            let file_off = 500_000 + off as u64;
            assert_eq!(
                p.write(file_h, file_off, len as u64, dst_addr, TIMEOUT)
                    .unwrap(),
                len as u64
            );
            let on_disk = std::fs::read(file.path()).unwrap();
            let at = 4096 + file_off as usize;
            assert_eq!(
                pattern::first_deviation(&on_disk[at..at + len], 0, 100 + i as u64),
                None
            );
            // (Past the range the reads use, so that they keep seeing the pattern.)
            let host_off = 600_000 + off;
            assert_eq!(
                p.write(host_h, host_off as u64, len as u64, dst_addr, TIMEOUT)
                    .unwrap(),
                len as u64
            );
            let h = host.read();
            assert_eq!(
                pattern::first_deviation(&h[host_off..host_off + len], 0, 100 + i as u64),
                None
            );
            moved += 5 * len as u64;
        }
        // A durable write (fsync before completion) goes through the same path.
        let mut tok = p
            .post(&RingPost {
                op: ring::OP_WRITE,
                resource: file_h,
                flags: ring::FLAG_DURABLE,
                offset: 0,
                len: 4096,
                dev_addr: dst.device_addr(),
            })
            .unwrap();
        assert_eq!(p.wait(&mut tok, TIMEOUT).unwrap(), 4096);
        moved += 4096;

        let stats = proxy.shutdown().unwrap();
        assert_eq!(stats.served, sizes.len() as u64 * 5 + 1);
        assert_eq!((stats.failed, stats.swept), (0, 0));
        assert_eq!(stats.bytes, moved);
    });
}

#[test]
fn many_producers_share_a_small_ring() {
    within(Duration::from_secs(60), || {
        let (engines, gpu) = setup();
        // 4 slots for 8 producers: posts wait for free slots all the time.
        let mut proxy = proxy(&engines, &gpu, 4, 2);
        let dir = tempfile::tempdir().unwrap();
        const LEN: usize = 256 << 10;
        let file = pattern_file(&dir, "data", LEN, 21);
        let host = common::host(LEN, 22);
        let file_h = proxy.register(Endpoint::file(&file, 0)).unwrap();
        let host_h = proxy.register(Endpoint::host(&host, 0)).unwrap();
        const PRODUCERS: usize = 8;
        const PER_PRODUCER: u64 = 100;
        const REGION: usize = 16 << 10;
        let dst = gpu.alloc(PRODUCERS * REGION).unwrap();
        proxy.register_device(&dst).unwrap();
        let p = proxy.host_producer().unwrap().with_wait(WaitPolicy {
            spins: 16,
            yields: 8,
            max_sleep: Duration::from_micros(100),
        });
        let threads: Vec<_> = (0..PRODUCERS)
            .map(|t| {
                let (p, gpu, dst) = (p.clone(), gpu.clone(), dst.clone());
                std::thread::spawn(move || {
                    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ t as u64;
                    let mut bytes = 0;
                    for i in 0..PER_PRODUCER {
                        x = pattern::mix64(x);
                        let len = 1 + (x % REGION as u64) as usize;
                        let off = (x >> 32) % (LEN - len) as u64;
                        let (h, seed) = if i % 2 == 0 {
                            (file_h, 21)
                        } else {
                            (host_h, 22)
                        };
                        let dst_off = t * REGION;
                        let n = p
                            .read(
                                h,
                                off,
                                len as u64,
                                dst.device_addr() + dst_off as u64,
                                TIMEOUT,
                            )
                            .unwrap();
                        assert_eq!(n, len as u64);
                        let got = download(&gpu, &dst, dst_off, len);
                        assert_eq!(pattern::first_deviation(&got, off, seed), None);
                        bytes += n;
                    }
                    bytes
                })
            })
            .collect();
        let bytes: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        let stats = proxy.shutdown().unwrap();
        assert_eq!(stats.served, PRODUCERS as u64 * PER_PRODUCER);
        assert_eq!(stats.bytes, bytes);
        assert_eq!((stats.failed, stats.swept), (0, 0));
    });
}

#[test]
fn bad_requests_complete_with_typed_errors_and_touch_nothing() {
    within(Duration::from_secs(60), || {
        let (engines, gpu) = setup();
        let mut proxy = proxy(&engines, &gpu, 4, 1);
        let dir = tempfile::tempdir().unwrap();
        let file = pattern_file(&dir, "data", 8192, 31);
        let host = common::host(8192, 32);
        let file_h = proxy.register(Endpoint::file(&file, 0)).unwrap();
        let host_h = proxy.register(Endpoint::host(&host, 0)).unwrap();
        let gone_h = proxy.register(Endpoint::host(&host, 0)).unwrap();
        proxy.unregister(gone_h).unwrap();
        assert!(proxy.unregister(gone_h).is_err());
        assert!(proxy.unregister(0).is_err());

        let dst = gpu.alloc(4096).unwrap();
        proxy.register_device(&dst).unwrap();
        let outside = gpu.alloc(4096).unwrap();
        upload_pattern(&gpu, &outside, 0, 4096, 33);
        let dropped = gpu.alloc(4096).unwrap();
        upload_pattern(&gpu, &dropped, 0, 4096, 34);
        proxy.register_device(&dropped).unwrap();
        assert!(proxy.unregister_device(&dropped));
        assert!(!proxy.unregister_device(&dropped));
        upload_pattern(&gpu, &dst, 0, 4096, 35);

        let p = proxy.host_producer().unwrap();
        let base = dst.device_addr();
        let post = |op: u32, resource: u32, flags: u32, offset: u64, len: u64, dev_addr: u64| {
            let mut tok = p
                .post(&RingPost {
                    op,
                    resource,
                    flags,
                    offset,
                    len,
                    dev_addr,
                })
                .unwrap();
            p.wait(&mut tok, TIMEOUT)
        };
        let code = |r: Result<u64, HalError>| match r {
            Err(HalError::RingRequest { code }) => code,
            other => panic!("expected a failed request, got {other:?}"),
        };
        let (read, write) = (ring::OP_READ, ring::OP_WRITE);
        let not_found = ring::result_of(ErrorCode::NotFound);
        let invalid = ring::result_of(ErrorCode::InvalidArg);
        // What, op, resource, flags, offset, len, device address, expected result.
        type Case = (&'static str, u32, u32, u32, u64, u64, u64, i64);
        let cases: &[Case] = &[
            ("unknown handle", read, 999, 0, 0, 16, base, not_found),
            ("handle 0", read, 0, 0, 0, 16, base, not_found),
            (
                "unregistered handle",
                read,
                gone_h,
                0,
                0,
                16,
                base,
                not_found,
            ),
            ("bad op", 7, host_h, 0, 0, 16, base, invalid),
            ("op 0", 0, host_h, 0, 0, 16, base, invalid),
            ("unknown flag", read, host_h, 0x80, 0, 16, base, invalid),
            ("zero length", read, host_h, 0, 0, 0, base, invalid),
            ("huge length", read, host_h, 0, 0, u64::MAX, base, invalid),
            (
                "host range past the end",
                read,
                host_h,
                0,
                8000,
                300,
                base,
                invalid,
            ),
            (
                "host offset overflow",
                read,
                host_h,
                0,
                u64::MAX,
                16,
                base,
                invalid,
            ),
            (
                "file range past EOF",
                read,
                file_h,
                0,
                8000,
                300,
                base,
                invalid,
            ),
            (
                "file offset overflow",
                read,
                file_h,
                0,
                u64::MAX - 4,
                16,
                base,
                invalid,
            ),
            (
                "file offset past off_t",
                write,
                file_h,
                0,
                i64::MAX as u64,
                16,
                base,
                invalid,
            ),
            (
                "destination straddles the buffer's end",
                read,
                host_h,
                0,
                0,
                64,
                base + 4096 - 32,
                ring::RESULT_UNREGISTERED,
            ),
            (
                "destination in an unregistered buffer",
                read,
                host_h,
                0,
                0,
                64,
                outside.device_addr(),
                ring::RESULT_UNREGISTERED,
            ),
            (
                "destination in a buffer unregistered again",
                read,
                host_h,
                0,
                0,
                64,
                dropped.device_addr(),
                ring::RESULT_UNREGISTERED,
            ),
            (
                "source in an unregistered buffer",
                write,
                host_h,
                0,
                0,
                64,
                outside.device_addr(),
                ring::RESULT_UNREGISTERED,
            ),
            (
                "null device address",
                read,
                host_h,
                0,
                0,
                64,
                0,
                ring::RESULT_UNREGISTERED,
            ),
        ];
        for &(what, op, res, flags, offset, len, addr, expected) in cases {
            let got = code(post(op, res, flags, offset, len, addr));
            assert_eq!(
                got,
                expected,
                "{what}: got {} ({got})",
                ring::result_name(got)
            );
        }
        // The error maps to the error code too.
        let err = post(read, 999, 0, 0, 16, base).unwrap_err();
        assert_eq!(err.code(), ErrorCode::NotFound);

        // Nothing was written anywhere a failed request pointed at.
        for (buf, seed) in [(&outside, 33), (&dropped, 34), (&dst, 35)] {
            let got = download(&gpu, buf, 0, 4096);
            assert_eq!(pattern::first_deviation(&got, 0, seed), None);
        }
        let h = host.read();
        assert_eq!(pattern::first_deviation(&h, 0, 32), None);
        drop(h);
        let on_disk = std::fs::read(file.path()).unwrap();
        assert_eq!(pattern::first_deviation(&on_disk, 0, 31), None);

        // The proxy still serves good requests after all that.
        assert_eq!(p.read(host_h, 0, 4096, base, TIMEOUT).unwrap(), 4096);
        let stats = proxy.shutdown().unwrap();
        assert_eq!(stats.failed, cases.len() as u64 + 1);
        assert_eq!(stats.served, 1);
    });
}

#[test]
fn shutdown_mid_flight_completes_or_refuses_every_request() {
    within(Duration::from_secs(60), || {
        let (engines, gpu) = setup();
        let mut proxy = proxy(&engines, &gpu, 8, 2);
        let dir = tempfile::tempdir().unwrap();
        const LEN: usize = 512 << 10;
        let file = pattern_file(&dir, "data", LEN, 41);
        let host = common::host(LEN, 42);
        let file_h = proxy.register(Endpoint::file(&file, 0)).unwrap();
        let host_h = proxy.register(Endpoint::host(&host, 0)).unwrap();
        const PRODUCERS: usize = 6;
        const REGION: usize = 64 << 10;
        let dst = gpu.alloc(PRODUCERS * REGION).unwrap();
        proxy.register_device(&dst).unwrap();
        let p = proxy.host_producer().unwrap();
        let ok = Arc::new(AtomicU64::new(0));
        let shut = Arc::new(AtomicU64::new(0));
        let started = Arc::new(AtomicBool::new(false));
        let threads: Vec<_> = (0..PRODUCERS)
            .map(|t| {
                let (p, gpu, dst) = (p.clone(), gpu.clone(), dst.clone());
                let (ok, shut, started) = (ok.clone(), shut.clone(), started.clone());
                std::thread::spawn(move || {
                    let mut x = 77 + t as u64;
                    let dst_off = t * REGION;
                    let addr = dst.device_addr() + dst_off as u64;
                    loop {
                        x = pattern::mix64(x);
                        let len = 1 + (x % REGION as u64) as usize;
                        let off = (x >> 40) % (LEN - len) as u64;
                        let (h, seed) = if x & 1 == 0 {
                            (file_h, 41)
                        } else {
                            (host_h, 42)
                        };
                        // Some requests are left in flight a while (poll), some waited at once.
                        let mut tok = match p.post_read(h, off, len as u64, addr) {
                            Ok(tok) => tok,
                            Err(HalError::RingShutDown) => return,
                            Err(e) => panic!("post: {e}"),
                        };
                        let polled = if x & 2 == 0 {
                            std::thread::yield_now();
                            p.poll(&mut tok)
                        } else {
                            Ok(None)
                        };
                        let result = match polled {
                            Ok(Some(n)) => Ok(n),
                            Ok(None) => p.wait(&mut tok, TIMEOUT),
                            Err(e) => Err(e),
                        };
                        match result {
                            Ok(n) => {
                                assert_eq!(n, len as u64);
                                let got = download(&gpu, &dst, dst_off, len);
                                assert_eq!(pattern::first_deviation(&got, off, seed), None);
                                ok.fetch_add(1, Ordering::Relaxed);
                                started.store(true, Ordering::Relaxed);
                            }
                            Err(HalError::RingShutDown) => {
                                shut.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("request failed: {e}"),
                        }
                    }
                })
            })
            .collect();
        let t0 = Instant::now();
        while !started.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(30));
        let stats = proxy.shutdown().unwrap();
        for t in threads {
            t.join().unwrap();
        }
        let ok = ok.load(Ordering::Relaxed);
        eprintln!(
            "served {ok}, shut down {}, swept {}",
            shut.load(Ordering::Relaxed),
            stats.swept
        );
        assert!(ok > 0, "requests were served before the shutdown");
        assert_eq!(
            stats.served, ok,
            "every served request reached its producer"
        );
        assert_eq!(stats.failed, 0);
        // Swept requests were posted and never served; each producer saw its own.
        assert!(shut.load(Ordering::Relaxed) >= stats.swept);
        assert_eq!(proxy.ring().state(), gpuio_ring::RingState::Closed);
        // Once closed, posting is refused at once.
        assert!(matches!(
            p.post_read(host_h, 0, 1, dst.device_addr()),
            Err(HalError::RingShutDown)
        ));
    });
}

#[test]
fn dropping_the_proxy_releases_producers_waiting_for_slots_and_completions() {
    within(Duration::from_secs(30), || {
        let (engines, gpu) = setup();
        // One slot pair, one thread, and a producer holding both slots without collecting:
        // the next post waits for a free slot until the proxy goes away.
        let proxy = proxy(&engines, &gpu, 2, 1);
        let host = common::host(4096, 51);
        let host_h = proxy.register(Endpoint::host(&host, 0)).unwrap();
        let dst = gpu.alloc(4096).unwrap();
        proxy.register_device(&dst).unwrap();
        let p = proxy.host_producer().unwrap();
        let held: Vec<_> = (0..2)
            .map(|_| p.post_read(host_h, 0, 64, dst.device_addr()).unwrap())
            .collect();
        let waiter = {
            let p = p.clone();
            let addr = dst.device_addr();
            std::thread::spawn(move || p.post_read(host_h, 0, 64, addr).map(|_| ()))
        };
        // Both held requests served (DONE, not collected), the waiter blocked on a full ring.
        let t0 = Instant::now();
        while (0..2).any(|i| proxy.ring().slot_view(i).unwrap().state != ring::SLOT_DONE) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "requests were not served"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(10));
        assert!(!waiter.is_finished());
        drop(proxy);
        assert!(matches!(
            waiter.join().unwrap(),
            Err(HalError::RingShutDown)
        ));
        // The held requests were served before the shutdown; their results are still there.
        for mut tok in held {
            assert_eq!(p.wait(&mut tok, TIMEOUT).unwrap(), 64);
        }
    });
}

#[test]
fn configuration_and_exclusivity_are_checked() {
    let (engines, gpu) = setup();
    for (slots, threads) in [(3, 1), (0, 1), (4, 0), (4, 1000)] {
        let cfg = RingConfig {
            slots,
            threads,
            ..RingConfig::default()
        };
        let err = RingProxy::new(engines.clone(), &gpu, cfg).unwrap_err();
        assert_eq!(
            err.code(),
            ErrorCode::InvalidArg,
            "{slots} {threads}: {err}"
        );
    }
    let mut proxy = proxy(&engines, &gpu, 4, 1);
    let d = proxy.device().unwrap();
    assert_eq!((d.nslots, d.mask), (4, 3));
    assert!(proxy.host_producer().is_err(), "kernels feed this ring");
    let ring = proxy.ring().clone();
    proxy.shutdown().unwrap();
    proxy.shutdown().unwrap();
    let again = RingProxy::with_ring(engines, ring, RingConfig::default());
    assert!(again.is_err(), "a closed ring is not served again");
    let empty = gpu.alloc(0).unwrap();
    assert!(proxy.register_device(&empty).is_err());
}

#[test]
fn staged_reads_arrive_in_the_slot_bounce_buffer() {
    let (engines, gpu) = setup();
    let dir = tempfile::tempdir().unwrap();
    let file = pattern_file(&dir, "staged.bin", 1 << 20, 11);
    let host = gpuio_core::HostMemory::new({
        let mut b = gpuio_hal::HostBuffer::alloc(64 << 10, &gpuio_hal::HostAllocOptions::default())
            .unwrap();
        pattern::fill(&mut b, 0, 12);
        b
    });
    let cfg = RingConfig {
        slots: 8,
        bounce_bytes: 4096,
        threads: 3,
        ..RingConfig::default()
    };
    let proxy = RingProxy::new(engines, &gpu, cfg).unwrap();
    assert_eq!(proxy.ring().bounce_bytes(), 4096);
    let from_file = proxy.register(Endpoint::file(&file, 0)).unwrap();
    let from_host = proxy.register(Endpoint::host(&host, 0)).unwrap();
    let producer = proxy.host_producer().unwrap();
    within(Duration::from_secs(20), move || {
        // Reads of up to 8 bytes come back inline in the slot; 9 through the bounce buffer.
        for len in 1..=9u64 {
            let got = producer
                .read_staged(from_file, 1000 + len, len, TIMEOUT)
                .unwrap();
            assert_eq!(got.len() as u64, len);
            assert_eq!(
                pattern::first_deviation(&got, 1000 + len, 11),
                None,
                "{len} bytes"
            );
        }
        // Many staged reads through 8 slots, of every size up to the bounce buffer.
        for k in 0..200u64 {
            let len = 1 + (pattern::mix64(k) % 4096);
            let off = pattern::mix64(k ^ 7) % ((1 << 20) - len);
            let got = producer.read_staged(from_file, off, len, TIMEOUT).unwrap();
            assert_eq!(got.len() as u64, len);
            assert_eq!(pattern::first_deviation(&got, off, 11), None, "read {k}");
            let hoff = off % ((64 << 10) - len);
            let got = producer.read_staged(from_host, hoff, len, TIMEOUT).unwrap();
            assert_eq!(
                pattern::first_deviation(&got, hoff, 12),
                None,
                "host read {k}"
            );
        }
        // Larger than the bounce buffer: it goes to the device address, here none.
        let e = producer
            .read_staged(from_file, 0, 4097, TIMEOUT)
            .unwrap_err();
        assert!(
            matches!(e, HalError::RingRequest { code } if code == ring::RESULT_UNREGISTERED),
            "{e}"
        );
    });
}

#[test]
fn staged_writes_go_from_the_slot_bounce_buffer() {
    let (engines, gpu) = setup();
    let dir = tempfile::tempdir().unwrap();
    let file = pattern_file(&dir, "written.bin", 1 << 20, 21);
    let host = gpuio_core::HostMemory::new(
        gpuio_hal::HostBuffer::alloc(64 << 10, &gpuio_hal::HostAllocOptions::default()).unwrap(),
    );
    let cfg = RingConfig {
        slots: 4,
        bounce_bytes: 4096,
        threads: 2,
        ..RingConfig::default()
    };
    let proxy = RingProxy::new(engines, &gpu, cfg).unwrap();
    let to_file = proxy.register(Endpoint::file(&file, 0)).unwrap();
    let to_host = proxy.register(Endpoint::host(&host, 0)).unwrap();
    let producer = proxy.host_producer().unwrap();
    let path = dir.path().join("written.bin");
    let host2 = host.clone();
    within(Duration::from_secs(20), move || {
        let mut want = std::fs::read(&path).unwrap();
        for k in 0..100u64 {
            let len = 1 + (pattern::mix64(k) % 4096) as usize;
            let off = pattern::mix64(k ^ 3) % ((1 << 20) - len as u64);
            let mut bytes = vec![0u8; len];
            pattern::fill(&mut bytes, off, 22 + k);
            let n = producer
                .write_staged(to_file, off, &bytes, TIMEOUT)
                .unwrap();
            assert_eq!(n, len as u64);
            want[off as usize..off as usize + len].copy_from_slice(&bytes);
            let hoff = off % ((64 << 10) - len as u64);
            producer
                .write_staged(to_host, hoff, &bytes, TIMEOUT)
                .unwrap();
            let g = host2.read();
            assert_eq!(
                &g[hoff as usize..hoff as usize + len],
                &bytes[..],
                "host write {k}"
            );
        }
        assert!(
            std::fs::read(&path).unwrap() == want,
            "the file holds every staged write"
        );
        // More than the bounce buffer holds is refused before anything is posted.
        let e = producer
            .write_staged(to_file, 0, &[0u8; 4097], TIMEOUT)
            .unwrap_err();
        assert!(matches!(e, HalError::InvalidArgument(_)), "{e}");
    });
}
