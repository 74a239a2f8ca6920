//! Sweeps the staging pipeline's chunk size and lane count for pageable host↔GPU copies and
//! prints each against `cudaMemcpy` from the same pageable memory, to tune
//! `MemIoConfig` on a new machine:
//!
//! ```text
//! cargo run --release -p gpuio-transport-memio --example pipeline_sweep -- [MiB ...]
//! ```

use gpuio_hal::{BackendPreference, HostAllocOptions, HostBuffer, pattern, probe};
use gpuio_transport_memio::{MemIo, MemIoConfig};
use std::time::Instant;

fn median_gbps(bytes: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    bytes as f64 / t[reps / 2] / 1e9
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse::<usize>().map(|m| m << 20))
        .collect::<Result<_, _>>()?;
    let sizes = if sizes.is_empty() {
        vec![64 << 20, 1 << 30]
    } else {
        sizes
    };
    let p = probe(BackendPreference::Auto)?;
    let gpu = p.gpus[0].clone();
    println!("device: {gpu}  cuda: {}", p.cuda.detail);
    for &len in &sizes {
        let reps = if len >= 512 << 20 { 5 } else { 11 };
        let dev = gpu.alloc(len)?;
        let mut src = vec![0u8; len];
        pattern::fill(&mut src, 0, 1);
        let mut dst = vec![0u8; len];
        let mut pinned = HostBuffer::alloc_pinned(len, &HostAllocOptions::default(), &gpu)?;
        pattern::fill(&mut pinned, 0, 1);
        let base_h2d = median_gbps(len, reps, || gpu.baseline_upload(&src, &dev, 0).unwrap());
        let base_d2h = median_gbps(len, reps, || {
            gpu.baseline_download(&dev, 0, &mut dst).unwrap()
        });
        let pin_h2d = median_gbps(len, reps, || gpu.baseline_upload(&pinned, &dev, 0).unwrap());
        println!(
            "{} MiB: cudaMemcpy pageable H2D {base_h2d:.1} GB/s, D2H {base_d2h:.1}; pinned H2D {pin_h2d:.1}",
            len >> 20
        );
        for chunk_kib in [512usize, 1024, 2048, 4096, 8192] {
            for threads in [4usize, 6, 8, 12] {
                let io = MemIo::new(
                    vec![gpu.clone()],
                    MemIoConfig {
                        chunk_size: chunk_kib << 10,
                        threads,
                        ..MemIoConfig::default()
                    },
                )?;
                let h2d = median_gbps(len, reps, || {
                    io.upload_staged(&src, &dev, 0).unwrap();
                });
                let d2h = median_gbps(len, reps, || {
                    io.download_staged(&dev, 0, &mut dst).unwrap();
                });
                println!(
                    "  chunk {chunk_kib:>5} KiB x {threads:>2} lanes: H2D {h2d:5.1} GB/s ({:.2}x)  D2H {d2h:5.1} GB/s ({:.2}x)",
                    h2d / base_h2d,
                    d2h / base_d2h
                );
            }
        }
        assert_eq!(
            pattern::first_deviation(&dst, 0, 1),
            None,
            "pipeline corrupted data"
        );
    }
    Ok(())
}
