//! The resident row server (`Gpu::resident_rows`) on the probed backend — the resident block
//! on the GPU machine, the host backend's copy of its jobs in CI — against the pools it reads:
//! plain and hot jobs in one call for each piece width, calls one after another, a call after
//! the block left (its linger passed), a device-wide wait and a drop while the block waits
//! (neither may wait out its linger), calls of changing shapes, and the refusals.

use super::first_gpu as gpu;
use super::hot_rows::{ROWS, pool, rows_of};
use gpuio_hal::{
    Backend, DeviceBuffer, Gpu, HalError, HostAllocOptions, HostBuffer, RESIDENT_MAX_BYTES,
    RESIDENT_MAX_ROWS, ResidentJob, pattern,
};
use std::time::{Duration, Instant};

/// A job of `indices` from `pool`, no hot rows, into `dst` from its start.
fn plain<'a>(pool: &'a HostBuffer, indices: &'a [u64], dst: &'a DeviceBuffer) -> ResidentJob<'a> {
    ResidentJob {
        pool,
        hot: None,
        indices,
        dst,
        dst_offset: 0,
    }
}

fn ids(n: usize, seed: u64) -> Vec<u64> {
    (0..n as u64)
        .map(|i| pattern::mix64(i ^ seed << 32) % ROWS as u64)
        .collect()
}

#[test]
fn plain_and_hot_jobs_are_gathered_call_after_call() {
    let gpu = gpu();
    let stream = gpu.stream().unwrap();
    let server = gpu.resident_rows(Duration::from_millis(50)).unwrap();
    // Each piece width: 16, 8, 4 and 1 bytes.
    for row in [48usize, 24, 20, 7] {
        let (mut a, mut b) = (
            pool(&gpu, row, row as u64),
            pool(&gpu, row, 100 + row as u64),
        );
        let keep: Vec<u64> = (0..ROWS as u64).filter(|r| r % 3 == 0).collect();
        let hot = stream.keep_hot(&b, row, &keep).unwrap();
        // Kept rows read as their copies: rewrite the pool after keeping it.
        let before = b.as_slice().to_vec();
        pattern::fill(&mut b, 0, 200 + row as u64);
        let dst = gpu.alloc(700 * row).unwrap();
        for call in 0..4u64 {
            // The pool changes between calls while the block stays: nothing is served stale.
            pattern::fill(&mut a, 0, 1000 * row as u64 + call);
            let (plain, hot_ids) = (ids(5 + 40 * call as usize, call), ids(24, 50 + call));
            stream.fill_pattern(&dst, 0, 700 * row, 3).unwrap();
            let jobs = [
                ResidentJob {
                    pool: &a,
                    hot: None,
                    indices: &plain,
                    dst: &dst,
                    dst_offset: 2 * row,
                },
                ResidentJob {
                    pool: &b,
                    hot: Some(&hot),
                    indices: &hot_ids,
                    dst: &dst,
                    dst_offset: 400 * row,
                },
            ];
            server.gather(&jobs, row).unwrap();
            let mut got = vec![0u8; plain.len() * row];
            stream.download(&dst, 2 * row, &mut got).unwrap();
            assert_eq!(
                got,
                rows_of(a.as_slice(), row, &plain),
                "row {row}, call {call}"
            );
            let want: Vec<u8> = hot_ids
                .iter()
                .flat_map(|&i| {
                    let src = if i % 3 == 0 {
                        &before[..]
                    } else {
                        b.as_slice()
                    };
                    rows_of(src, row, &[i])
                })
                .collect();
            let mut got = vec![0u8; hot_ids.len() * row];
            stream.download(&dst, 400 * row, &mut got).unwrap();
            assert_eq!(got, want, "row {row}, call {call}, hot job");
            // Nothing else was written.
            let mut head = vec![0u8; 2 * row];
            stream.download(&dst, 0, &mut head).unwrap();
            assert_eq!(pattern::first_deviation(&head, 0, 3), None, "row {row}");
        }
    }
    let stats = server.stats();
    assert_eq!(stats.calls, 16);
    // A free of device memory sends the block home (the loop frees `dst`); other tests' frees
    // may too.
    let launched = if cuda(&gpu) { 1..=16 } else { 0..=0 };
    assert!(launched.contains(&stats.launches), "{stats:?}");
}

/// Whether the block really runs (the CUDA backend); the host backend runs its jobs inline.
fn cuda(gpu: &Gpu) -> bool {
    gpu.backend() == Backend::Cuda
}

#[test]
fn a_call_after_the_linger_brings_the_block_back() {
    let gpu = gpu();
    let stream = gpu.stream().unwrap();
    let linger = Duration::from_millis(1);
    let server = gpu.resident_rows(linger).unwrap();
    let row = 64;
    let a = pool(&gpu, row, 7);
    let dst = gpu.alloc(64 * row).unwrap();
    // Calls spaced below, near and past the linger: the block is there, leaving, or gone.
    for (k, pause_us) in [0u64, 2000, 900, 1000, 1100, 5000, 0]
        .into_iter()
        .enumerate()
    {
        std::thread::sleep(Duration::from_micros(pause_us));
        let list = ids(1 + 9 * k, k as u64);
        let job = plain(&a, &list, &dst);
        server.gather(&[job], row).unwrap();
        let mut got = vec![0u8; list.len() * row];
        stream.download(&dst, 0, &mut got).unwrap();
        assert_eq!(got, rows_of(a.as_slice(), row, &list), "call {k}");
    }
    // Launched for the first call, and again after each pause past the linger at least.
    let stats = server.stats();
    assert_eq!(stats.calls, 7);
    let launched = if cuda(&gpu) { 3..=7 } else { 0..=0 };
    assert!(launched.contains(&stats.launches), "{stats:?}");
}

/// A block lingering for 30 s must not hold a device-wide wait, a free or the server's drop
/// that long.
#[test]
fn a_device_wide_wait_a_free_and_a_drop_send_the_block_home() {
    let gpu = gpu();
    let stream = gpu.stream().unwrap();
    let server = gpu.resident_rows(Duration::from_secs(30)).unwrap();
    let a = pool(&gpu, 16, 1);
    let dst = gpu.alloc(16).unwrap();
    for (k, row) in [3u64, 9].into_iter().enumerate() {
        server.gather(&[plain(&a, &[row], &dst)], 16).unwrap();
        let mut got = vec![0u8; 16];
        stream.download(&dst, 0, &mut got).unwrap();
        assert_eq!(got, rows_of(a.as_slice(), 16, &[row]), "call {k}");
        // The next call comes after the block was sent home: it launches it again. A free
        // waits for the device as a synchronize does.
        let spare = gpu.alloc(64).unwrap();
        let t = Instant::now();
        if k == 0 {
            gpu.synchronize().unwrap();
        } else {
            drop(spare);
        }
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }
    let job = plain(&a, &[5], &dst);
    server.gather(&[job], 16).unwrap();
    // Each call after a wait launched the block again (other tests' frees may add more).
    let stats = server.stats();
    let launched = if cuda(&gpu) { 3..=u64::MAX } else { 0..=0 };
    assert!(launched.contains(&stats.launches), "{stats:?}");
    let t = Instant::now();
    drop(server);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

/// Calls from one thread while another waits for the device again and again: every call is
/// answered (a wait's stop never loses a posted call) and right.
#[test]
fn calls_survive_device_wide_waits_from_another_thread() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let gpu = gpu();
    let server = Arc::new(gpu.resident_rows(Duration::from_secs(10)).unwrap());
    let row = 32;
    let a = Arc::new(pool(&gpu, row, 11));
    let dst = Arc::new(gpu.alloc(8 * row).unwrap());
    let done = Arc::new(AtomicBool::new(false));
    let waits = {
        let (gpu, done) = (gpu.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                gpu.synchronize().unwrap();
            }
        })
    };
    // Detached: a call that never returns fails the test below rather than hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let (gpu, server, a, dst) = (gpu.clone(), server.clone(), a.clone(), dst.clone());
        std::thread::spawn(move || {
            let stream = gpu.stream().unwrap();
            for k in 0..2000u64 {
                let list = ids(1 + (k % 8) as usize, k);
                let job = plain(&a, &list, &dst);
                server.gather(&[job], row).unwrap();
                if k % 97 == 0 {
                    let mut got = vec![0u8; list.len() * row];
                    stream.download(&dst, 0, &mut got).unwrap();
                    assert_eq!(got, rows_of(a.as_slice(), row, &list), "call {k}");
                }
            }
            let _ = tx.send(());
        });
    }
    let answered = rx.recv_timeout(Duration::from_secs(120));
    done.store(true, Ordering::Relaxed);
    assert!(
        answered.is_ok(),
        "2000 calls beside device-wide waits: not all answered in 120 s"
    );
    waits.join().unwrap();
    assert_eq!(server.stats().calls, 2000);
}

#[test]
fn a_resident_gather_refuses_what_it_cannot_run() {
    let gpu = gpu();
    let stream = gpu.stream().unwrap();
    let err = gpu.resident_rows(Duration::from_micros(999)).unwrap_err();
    assert!(err.to_string().contains("under a millisecond"), "{err}");
    let server = gpu.resident_rows(Duration::from_millis(20)).unwrap();
    let (a, b) = (pool(&gpu, 32, 1), pool(&gpu, 32, 2));
    let hot_a = stream.keep_hot(&a, 32, &[1, 2]).unwrap();
    let hot_16 = stream.keep_hot(&a, 16, &[1]).unwrap();
    let dst = gpu.alloc(2048 * 32).unwrap();
    let two = [1u64, 2];
    let job = |pool, hot, indices, dst_offset| ResidentJob {
        pool,
        hot,
        indices,
        dst: &dst,
        dst_offset,
    };
    let refused = |jobs: &[ResidentJob<'_>], row: usize, why: &str| {
        let err = server.gather(jobs, row).unwrap_err();
        assert!(err.to_string().contains(why), "{err}");
    };
    refused(&[job(&a, None, &two, 0)], 0, "must have bytes");
    refused(&[job(&a, None, &two, 0); 9], 32, "more than 8");
    let many = vec![1u64; RESIDENT_MAX_ROWS + 1];
    refused(&[job(&a, None, &many, 0)], 32, "resident gather");
    let big = HostBuffer::alloc_pinned(2 << 20, &HostAllocOptions::default(), &gpu).unwrap();
    let big_dst = gpu.alloc(RESIDENT_MAX_BYTES + (1 << 20)).unwrap();
    let three = [0u64; 3];
    let too_big = plain(&big, &three, &big_dst);
    refused(&[too_big], 2 << 20, "resident gather");
    refused(&[job(&b, Some(&hot_a), &two, 0)], 32, "another pool");
    refused(&[job(&a, Some(&hot_16), &two, 0)], 32, "hot rows of 16 B");
    refused(
        &[job(&a, None, &two, 0), job(&a, None, &two, 32)],
        32,
        "overlap",
    );
    let unpinned = HostBuffer::alloc(ROWS * 32, &HostAllocOptions::default()).unwrap();
    refused(&[job(&unpinned, None, &two, 0)], 32, "pinned");
    let err = server
        .gather(&[job(&a, None, &two, 2047 * 32)], 32)
        .unwrap_err();
    assert!(
        matches!(err, HalError::OutOfRange { what: "rows", .. }),
        "{err}"
    );
    // A row past its pool is reported at its position over all jobs, naming its own pool's
    // rows; the other rows are gathered, and the server serves the next call.
    let small = pool(&gpu, 32, 5);
    let mut bigger =
        HostBuffer::alloc_pinned(2 * ROWS * 32, &HostAllocOptions::default(), &gpu).unwrap();
    pattern::fill(&mut bigger, 0, 6);
    let (first, second) = ([4u64, 8], [3u64, ROWS as u64 + 1, 9]);
    stream.fill_pattern(&dst, 0, 2048 * 32, 9).unwrap();
    match server.gather(
        &[
            job(&bigger, None, &first, 0),
            job(&small, None, &second, 64),
        ],
        32,
    ) {
        Err(HalError::IndexOutOfRange { position, rows }) => {
            assert_eq!((position, rows), (3, ROWS as u64));
        }
        other => panic!("{other:?}"),
    }
    let mut got = vec![0u8; 5 * 32];
    stream.download(&dst, 0, &mut got).unwrap();
    assert_eq!(got[..64], rows_of(bigger.as_slice(), 32, &first));
    assert_eq!(got[64..96], rows_of(small.as_slice(), 32, &[3]));
    assert_eq!(got[128..], rows_of(small.as_slice(), 32, &[9]));
    server.gather(&[job(&small, None, &[7], 0)], 32).unwrap();
    stream.download(&dst, 0, &mut got[..32]).unwrap();
    assert_eq!(got[..32], rows_of(small.as_slice(), 32, &[7]));
    // Indices far past the pool are reported too, never read as some smaller row: 2^48 + 3
    // is not row 3.
    let wide = [5u64, (1 << 48) + 3, u64::MAX];
    match server.gather(&[job(&small, None, &wide, 0)], 32) {
        Err(HalError::IndexOutOfRange { position, rows }) => {
            assert_eq!((position, rows), (1, ROWS as u64));
        }
        other => panic!("{other:?}"),
    }
}

/// Calls whose shapes change from one to the next (one or two jobs, 1 to 600 rows; the block
/// reads each call's words afresh), each checked.
#[test]
fn calls_of_changing_shapes_read_their_own_words() {
    let gpu = gpu();
    let stream = gpu.stream().unwrap();
    let server = gpu.resident_rows(Duration::from_secs(5)).unwrap();
    let row = 16;
    let (a, b) = (pool(&gpu, row, 21), pool(&gpu, row, 22));
    let keep: Vec<u64> = (0..ROWS as u64).filter(|r| r % 2 == 0).collect();
    let hot = stream.keep_hot(&b, row, &keep).unwrap();
    let dst = gpu.alloc(2 * RESIDENT_MAX_ROWS * row).unwrap();
    let calls = 2000;
    for k in 0..calls as u64 {
        let n = [1usize, 64, 3, 600, 24][(k % 5) as usize];
        let (first, second) = (ids(n, k), ids(1 + (k % 7) as usize * 8, k + 7));
        let one = plain(&a, &first, &dst);
        let two = ResidentJob {
            pool: &b,
            hot: Some(&hot),
            indices: &second,
            dst: &dst,
            dst_offset: RESIDENT_MAX_ROWS * row,
        };
        let jobs = if k % 3 == 0 {
            vec![one]
        } else {
            vec![one, two]
        };
        server.gather(&jobs, row).unwrap();
        let mut got = vec![0u8; n * row];
        stream.download(&dst, 0, &mut got).unwrap();
        assert!(got == rows_of(a.as_slice(), row, &first), "call {k}");
        if k % 3 != 0 {
            let mut got = vec![0u8; second.len() * row];
            stream
                .download(&dst, RESIDENT_MAX_ROWS * row, &mut got)
                .unwrap();
            assert!(
                got == rows_of(b.as_slice(), row, &second),
                "call {k}, hot job"
            );
        }
    }
    assert_eq!(server.stats().calls, calls as u64);
}
