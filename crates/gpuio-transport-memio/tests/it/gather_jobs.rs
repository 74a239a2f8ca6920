//! Gathers through hot rows of several pools in one call (`MemIo::gather_hot_jobs`), on the
//! probed backend: every path a caller can force and `Auto`, for rows whose index list the
//! kernel reads in pinned memory and rows whose list is copied to the device; each job's rows
//! checked against its pool (kept rows read as their copies where the GPU moved them), bad
//! indices reported at their place in the lists taken together, and the refusals.

use super::gather::{download, engine, pool, random_indices, seed};
use gpuio_hal::{DeviceBuffer, HalError, HostBuffer, HotRows, pattern};
use gpuio_transport_memio::{GatherOptions, GatherStrategy, HotLookup, MemIo, MemIoError};

/// Two pools, each with hot copies of some rows taken before its rows were rewritten: what
/// the pool held then (its copies), and holds now.
struct Tables {
    pools: Vec<HostBuffer>,
    hot: Vec<HotRows>,
    old: Vec<Vec<u8>>,
}

impl Tables {
    /// Job `k`: `indices` of pool `k` through its hot rows, into `dst` at `dst_offset`.
    fn lookup<'a>(
        &'a self,
        k: usize,
        indices: &'a [u64],
        dst: &'a DeviceBuffer,
        dst_offset: usize,
    ) -> HotLookup<'a> {
        HotLookup {
            pool: &self.pools[k],
            hot: &self.hot[k],
            indices,
            dst,
            dst_offset,
        }
    }
}

fn tables(io: &MemIo, rb: usize, rows: usize) -> Tables {
    let gpu = io.gpu(0).unwrap().clone();
    let stream = gpu.stream().unwrap();
    let mut t = Tables {
        pools: Vec::new(),
        hot: Vec::new(),
        old: Vec::new(),
    };
    for k in 0..2u64 {
        let mut p = pool(io, rows * rb, seed() ^ k, true);
        let keep: Vec<u64> = (0..rows as u64).filter(|r| r % (k + 2) == 0).collect();
        t.hot.push(stream.keep_hot(&p, rb, &keep).unwrap());
        t.old.push(p.as_slice().to_vec());
        pattern::fill(&mut p, 0, seed() ^ 0xfeed ^ k);
        t.pools.push(p);
    }
    t
}

/// What job `k` reads: rows the GPU moved (`gpu_rows` of its list) from the copies where
/// kept, every other row from the pool as it is now.
fn expected(t: &Tables, k: usize, rb: usize, ids: &[u64], gpu_rows: usize) -> Vec<u8> {
    ids.iter()
        .enumerate()
        .flat_map(|(i, &r)| {
            let kept = r % (k as u64 + 2) == 0 && i < gpu_rows;
            let from = if kept {
                &t.old[k]
            } else {
                t.pools[k].as_slice()
            };
            from[r as usize * rb..(r as usize + 1) * rb].to_vec()
        })
        .collect()
}

#[test]
fn every_path_gathers_each_pools_rows_through_its_hot_rows() {
    let io = engine();
    let gpu = io.gpu(0).unwrap().clone();
    // 48-byte rows: the kernel reads the lists in pinned memory; 1040-byte rows: the lists
    // are copied to the device first.
    for (rb, rows) in [(48usize, 4096usize), (1040, 512)] {
        let t = tables(&io, rb, rows);
        let ids = [
            random_indices(24, rows, seed()),
            random_indices(999, rows, seed() ^ 1),
        ];
        let dst = gpu.alloc((ids[0].len() + 3) * rb).unwrap();
        let other = gpu.alloc(ids[1].len() * rb).unwrap();
        let jobs = [
            t.lookup(0, &ids[0], &dst, 3 * rb),
            t.lookup(1, &ids[1], &other, 0),
        ];
        let check = |gpu_share: f64, what: &str| {
            for (k, (buf, off)) in [(&dst, 3 * rb), (&other, 0)].into_iter().enumerate() {
                let n = ids[k].len();
                let gpu_rows = (n as f64 * gpu_share).round() as usize;
                assert_eq!(
                    download(&io, buf, off, n * rb),
                    expected(&t, k, rb, &ids[k], gpu_rows),
                    "{what}, job {k}, rows of {rb} B"
                );
            }
        };
        for (strategy, share) in [
            (GatherStrategy::ZeroCopy, 1.0),
            (GatherStrategy::CpuStaged, 0.0),
            (GatherStrategy::Hybrid, 0.5),
        ] {
            let opts = GatherOptions {
                strategy,
                gpu_share: (strategy == GatherStrategy::Hybrid).then_some(share),
                ..GatherOptions::default()
            };
            let reports = io.gather_hot_jobs(&jobs, &opts).unwrap();
            assert_eq!(reports.len(), 2);
            assert!(reports.iter().all(|r| r.strategy == strategy));
            assert_eq!((reports[0].rows, reports[1].rows), (24, 999));
            check(share, &format!("{strategy:?}"));
        }
        // Auto tries the paths and settles on one; never the sorted one. Zero-copy reads
        // every kept row from its copy, CPU-staged none; a hybrid call (at a share of its
        // own) the kept rows of a first part of each list: where its first kept row read from
        // the pool is.
        for _ in 0..12 {
            let r = io
                .gather_hot_jobs(&jobs, &GatherOptions::default())
                .unwrap();
            for (k, (buf, off)) in [(&dst, 3 * rb), (&other, 0)].into_iter().enumerate() {
                let got = download(&io, buf, off, ids[k].len() * rb);
                let now = t.pools[k].as_slice();
                let gpu_rows = match r[k].strategy {
                    GatherStrategy::ZeroCopy => ids[k].len(),
                    GatherStrategy::CpuStaged => 0,
                    GatherStrategy::Hybrid => ids[k]
                        .iter()
                        .enumerate()
                        .position(|(i, &r)| {
                            let (row, at) = (r as usize * rb, i * rb);
                            r % (k as u64 + 2) == 0
                                && t.old[k][row..row + rb] != now[row..row + rb]
                                && got[at..at + rb] == now[row..row + rb]
                        })
                        .unwrap_or(ids[k].len()),
                    other => panic!("Auto picked {other:?} for a gather through hot rows"),
                };
                assert_eq!(
                    got,
                    expected(&t, k, rb, &ids[k], gpu_rows),
                    "Auto ({:?}), job {k}, rows of {rb} B",
                    r[k].strategy
                );
            }
        }
    }
}

/// A pool unpinned after its rows were kept can only be gathered by the CPU: every call takes
/// that path (as one-pool gathers of unpinned pools do), a forced GPU path too.
#[test]
fn an_unpinned_pool_is_gathered_by_the_cpu() {
    let io = engine();
    let gpu = io.gpu(0).unwrap().clone();
    let (rb, rows) = (64usize, 256usize);
    let mut t = tables(&io, rb, rows);
    t.pools[1].unpin();
    let ids = [
        random_indices(30, rows, seed()),
        random_indices(20, rows, seed() ^ 3),
    ];
    let dst = gpu.alloc(50 * rb).unwrap();
    let jobs = [
        t.lookup(0, &ids[0], &dst, 0),
        t.lookup(1, &ids[1], &dst, 30 * rb),
    ];
    for _ in 0..6 {
        let r = io
            .gather_hot_jobs(&jobs, &GatherOptions::default())
            .unwrap();
        assert!(
            r.iter().all(|r| r.strategy == GatherStrategy::CpuStaged),
            "{r:?}"
        );
        assert_eq!(
            download(&io, &dst, 0, 30 * rb),
            expected(&t, 0, rb, &ids[0], 0)
        );
        assert_eq!(
            download(&io, &dst, 30 * rb, 20 * rb),
            expected(&t, 1, rb, &ids[1], 0)
        );
    }
    let zero_copy = GatherOptions {
        strategy: GatherStrategy::ZeroCopy,
        ..GatherOptions::default()
    };
    let r = io.gather_hot_jobs(&jobs, &zero_copy).unwrap();
    assert!(
        r.iter().all(|r| r.strategy == GatherStrategy::CpuStaged),
        "{r:?}"
    );
}

#[test]
fn a_bad_index_is_reported_at_its_place_in_the_lists_together() {
    let io = engine();
    let gpu = io.gpu(0).unwrap().clone();
    let (rb, rows) = (64usize, 256usize);
    let t = tables(&io, rb, rows);
    let first = random_indices(10, rows, seed());
    let mut second = random_indices(30, rows, seed() ^ 2);
    second[20] = rows as u64;
    let dst = gpu.alloc(40 * rb).unwrap();
    let jobs = [
        t.lookup(0, &first, &dst, 0),
        t.lookup(1, &second, &dst, 10 * rb),
    ];
    for (strategy, share) in [
        (GatherStrategy::ZeroCopy, None),
        (GatherStrategy::CpuStaged, None),
        (GatherStrategy::Hybrid, Some(0.5)),
        (GatherStrategy::Hybrid, Some(0.8)),
    ] {
        let opts = GatherOptions {
            strategy,
            gpu_share: share,
            ..GatherOptions::default()
        };
        match io.gather_hot_jobs(&jobs, &opts) {
            Err(MemIoError::Hal(HalError::IndexOutOfRange {
                position: 30,
                rows: r,
            })) => {
                assert_eq!(r, rows as u64, "{strategy:?} {share:?}")
            }
            other => panic!("{strategy:?} {share:?}: a row past the pool gave {other:?}"),
        }
    }
}

#[test]
fn what_a_gather_of_several_pools_cannot_run_is_refused() {
    let io = engine();
    let gpu = io.gpu(0).unwrap().clone();
    // Leaked: the closure below hands out lookups borrowing either set.
    let t: &'static Tables = Box::leak(Box::new(tables(&io, 32, 128)));
    let u: &'static Tables = Box::leak(Box::new(tables(&io, 16, 128)));
    let ids = [1u64, 2, 3];
    let dst = gpu.alloc(6 * 32).unwrap();
    let job = |k: usize, t: &'static Tables, pool: usize, dst_offset| HotLookup {
        pool: &t.pools[pool],
        hot: &t.hot[k],
        indices: &ids,
        dst: &dst,
        dst_offset,
    };
    let refused = |jobs: &[HotLookup<'_>], opts: GatherOptions, why: &str| {
        let err = io.gather_hot_jobs(jobs, &opts).unwrap_err();
        assert!(err.to_string().contains(why), "{why}: {err}");
    };
    let plain = GatherOptions::default();
    refused(&[], plain, "needs a job");
    refused(&[job(0, t, 0, 0); 9], plain, "more than 8");
    refused(&[job(0, t, 0, 0), job(0, u, 0, 0)], plain, "one size");
    refused(&[job(0, t, 0, 0), job(1, t, 0, 0)], plain, "another pool");
    refused(
        &[job(0, t, 0, 0), job(1, t, 1, 4 * 32)],
        plain,
        "gather destination",
    );
    let sorted = GatherOptions {
        strategy: GatherStrategy::Sorted,
        ..plain
    };
    refused(&[job(0, t, 0, 0), job(1, t, 1, 0)], sorted, "sorted");
    let share = GatherOptions {
        gpu_share: Some(1.5),
        ..plain
    };
    refused(
        &[job(0, t, 0, 0), job(1, t, 1, 0)],
        share,
        "between 0 and 1",
    );
}
