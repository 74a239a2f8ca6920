//! Tiered gathers (`ai::gather_tiered`) against a CPU model, on the backend the probe finds
//! (CUDA on the GPU machine, the host backend elsewhere): rows from a hot device buffer or a
//! warm pinned pool, warm rows installed into hot rows on the way, several jobs per call; and
//! the refusals: codes outside their tier, overlapping buffers, an unpinned stage.

use gpuio_hal::gpu::tiered::{TieredRows, TieredSource, gather_tiered, tiered_stage_len};
use gpuio_hal::{
    BackendPreference, DeviceBuffer, ErrorCode, Gpu, HostAllocOptions, HostBuffer, Stream, probe,
};
use proptest::prelude::*;

fn gpus() -> Vec<Gpu> {
    probe(BackendPreference::Auto)
        .expect("probe never fails with Auto")
        .gpus
}

/// One job's buffers and the model of its hot tier.
struct Job {
    hot: DeviceBuffer,
    hot_model: Vec<u8>,
    warm: HostBuffer,
    dst: DeviceBuffer,
}

fn job(
    gpu: &Gpu,
    stream: &Stream,
    row: usize,
    hot_rows: usize,
    warm_rows: usize,
    seed: u64,
) -> Job {
    let hot = gpu.alloc(hot_rows * row).unwrap();
    stream.fill_pattern(&hot, 0, hot_rows * row, seed).unwrap();
    let mut hot_model = vec![0u8; hot_rows * row];
    stream.download(&hot, 0, &mut hot_model).unwrap();
    let mut warm =
        HostBuffer::alloc_pinned(warm_rows * row, &HostAllocOptions::default(), gpu).unwrap();
    gpuio_hal::pattern::fill(&mut warm, 0, seed ^ 0xabc);
    Job {
        hot,
        hot_model,
        warm,
        dst: gpu.alloc(64 * row + 16).unwrap(),
    }
}

/// The codes of one job: per output row, a hot row or a warm row, installs going to hot rows
/// no output row of the job reads and each taken once.
fn codes(hot_rows: usize, warm_rows: usize) -> impl Strategy<Value = Vec<TieredSource>> {
    prop::collection::vec((any::<bool>(), any::<u64>(), any::<bool>()), 1..48).prop_map(
        move |picks| {
            let mut installable: Vec<u64> = (0..hot_rows as u64).rev().collect();
            let read: Vec<u64> = picks
                .iter()
                .filter(|p| !p.0)
                .map(|p| p.1 % hot_rows as u64)
                .collect();
            installable.retain(|s| !read.contains(s));
            picks
                .into_iter()
                .map(|(warm, r, install)| {
                    if warm {
                        TieredSource::Warm {
                            row: r % warm_rows as u64,
                            install: install.then(|| installable.pop()).flatten(),
                        }
                    } else {
                        TieredSource::Hot(r % hot_rows as u64)
                    }
                })
                .collect()
        },
    )
}

fn write_codes(stage: &mut HostBuffer, all: &[TieredSource]) {
    for (i, s) in all.iter().enumerate() {
        stage[8 * i..8 * i + 8].copy_from_slice(&s.code().unwrap().to_le_bytes());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Every output row and every hot row afterwards equal the model's, for one to three jobs
    /// in one call, at destination offsets that force narrow pieces.
    #[test]
    fn tiered_gathers_match_the_model(
        row in prop::sample::select(vec![656usize, 64, 13, 4096]),
        jobs in prop::collection::vec(codes(24, 40), 1..4),
        shift in prop::sample::select(vec![0usize, 16, 3]),
    ) {
        for gpu in gpus() {
            let stream = gpu.stream().unwrap();
            let mut made: Vec<Job> = (0..jobs.len())
                .map(|k| job(&gpu, &stream, row, 24, 40, 11 + k as u64))
                .collect();
            let all: Vec<TieredSource> = jobs.iter().flatten().copied().collect();
            let len = tiered_stage_len(all.len(), jobs.len());
            let mut stage =
                HostBuffer::alloc_pinned(len, &HostAllocOptions::default(), &gpu).unwrap();
            write_codes(&mut stage, &all);
            let device = gpu.alloc(len).unwrap();
            let rows: Vec<TieredRows<'_>> = made
                .iter()
                .zip(&jobs)
                .map(|(j, c)| TieredRows {
                    hot: &j.hot,
                    warm: &j.warm,
                    dst: &j.dst,
                    dst_offset: shift,
                    count: c.len(),
                })
                .collect();
            gather_tiered(&stream, row, &rows, &mut stage, &device).unwrap();
            drop(rows);
            for (j, c) in made.iter_mut().zip(&jobs) {
                let mut want = Vec::new();
                for s in c {
                    let r = match *s {
                        TieredSource::Hot(h) => &j.hot_model[h as usize * row..][..row],
                        TieredSource::Warm { row: w, .. } => &j.warm[w as usize * row..][..row],
                    };
                    want.extend_from_slice(r);
                }
                for s in c {
                    if let TieredSource::Warm { row: w, install: Some(h) } = *s {
                        let from = j.warm[w as usize * row..][..row].to_vec();
                        j.hot_model[h as usize * row..][..row].copy_from_slice(&from);
                    }
                }
                let mut got = vec![0u8; want.len()];
                stream.download(&j.dst, shift, &mut got).unwrap();
                prop_assert!(got == want, "{}: output rows differ", gpu.info().name);
                let mut hot = vec![0u8; j.hot_model.len()];
                stream.download(&j.hot, 0, &mut hot).unwrap();
                prop_assert!(hot == j.hot_model, "{}: hot rows differ", gpu.info().name);
            }
        }
    }
}

/// A code outside its tier, hot buffers that overlap a destination, a stage too short or not
/// pinned: typed errors naming the cause.
#[test]
fn tiered_gathers_refuse_what_they_cannot_do() {
    for gpu in gpus() {
        let stream = gpu.stream().unwrap();
        let row = 64;
        let j = job(&gpu, &stream, row, 8, 8, 5);
        let len = tiered_stage_len(2, 1);
        let mut stage = HostBuffer::alloc_pinned(len, &HostAllocOptions::default(), &gpu).unwrap();
        let device = gpu.alloc(len).unwrap();
        let one = |count| TieredRows {
            hot: &j.hot,
            warm: &j.warm,
            dst: &j.dst,
            dst_offset: 0,
            count,
        };
        let far = TieredSource::Warm {
            row: 8,
            install: None,
        };
        write_codes(&mut stage, &[TieredSource::Hot(1), far]);
        let e = gather_tiered(&stream, row, &[one(2)], &mut stage, &device).unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
        assert!(e.to_string().contains("code 1"), "{e}");
        write_codes(&mut stage, &[TieredSource::Hot(8), TieredSource::Hot(0)]);
        let e = gather_tiered(&stream, row, &[one(2)], &mut stage, &device).unwrap_err();
        assert!(e.to_string().contains("code 0"), "{e}");
        // The hot buffer as its own destination.
        let onto_hot = TieredRows {
            dst: &j.hot,
            ..one(2)
        };
        let e = gather_tiered(&stream, row, &[onto_hot], &mut stage, &device).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        let e = gather_tiered(&stream, row, &[one(3)], &mut stage, &device).unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
        let mut pageable = HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap();
        let e = gather_tiered(&stream, row, &[one(2)], &mut pageable, &device).unwrap_err();
        assert!(e.to_string().contains("pinned"), "{e}");
        // Nothing to do is done.
        gather_tiered(&stream, row, &[one(0)], &mut stage, &device).unwrap();
    }
}
