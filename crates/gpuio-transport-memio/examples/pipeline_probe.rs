//! Measures the primitives the staging pipeline is made of, to see where a pipelined copy's
//! time goes on a machine: thread-pool dispatch, one chunk's async DMA round trip, CPU copies
//! from cold pageable memory into pinned memory (one thread and all lanes at once), and the
//! whole pipeline — each printed in microseconds or GB/s.
//!
//! ```text
//! cargo run --release -p gpuio-transport-memio --example pipeline_probe
//! ```

use gpuio_hal::{BackendPreference, HostAllocOptions, HostBuffer, pattern, probe};
use gpuio_transport_memio::{MemIo, MemIoConfig};
use rayon::prelude::*;
use std::time::{Duration, Instant};

fn median_us(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<Duration> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed()
        })
        .collect();
    t.sort();
    t[reps / 2].as_secs_f64() * 1e6
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let p = probe(BackendPreference::Auto)?;
    let gpu = p.gpus[0].clone();
    let lanes = MemIoConfig::default().threads;
    println!("device: {gpu}, {lanes} lanes");
    let pool = rayon::ThreadPoolBuilder::new().num_threads(lanes).build()?;
    let items: Vec<usize> = (0..lanes).collect();
    let us = median_us(101, || {
        pool.install(|| items.par_iter().with_max_len(1).for_each(|_| {}))
    });
    println!("pool.install + {lanes} no-op tasks: {us:.1} us");
    std::thread::sleep(Duration::from_millis(50));
    let us = median_us(21, || {
        std::thread::sleep(Duration::from_millis(5));
        pool.install(|| items.par_iter().with_max_len(1).for_each(|_| {}))
    });
    println!("  same after 5 ms idle (incl. the sleep 5000 us): {us:.1} us");

    let stream = gpu.stream()?;
    for chunk in [256usize << 10, 512 << 10, 2 << 20] {
        let dev = gpu.alloc(chunk)?;
        let mut buf = Some(HostBuffer::alloc_pinned(
            chunk,
            &HostAllocOptions::default(),
            &gpu,
        )?);
        let us = median_us(101, || {
            let b = buf.take().unwrap();
            let inflight = stream.upload_async(b, 0..chunk, &dev, 0).unwrap();
            buf = Some(inflight.wait().unwrap());
        });
        println!(
            "upload_async + wait, {} KiB pinned: {us:.1} us ({:.1} GB/s)",
            chunk >> 10,
            chunk as f64 / us / 1e3
        );
    }

    // CPU copies from cold pageable memory (rotating over 1 GiB) into pinned staging.
    let src_total = 1usize << 30;
    let mut src = vec![0u8; src_total];
    src.par_chunks_mut(1 << 20)
        .enumerate()
        .for_each(|(i, c)| pattern::fill(c, (i << 20) as u64, 1));
    for chunk in [256usize << 10, 512 << 10, 2 << 20] {
        let mut dst = HostBuffer::alloc_pinned(chunk, &HostAllocOptions::default(), &gpu)?;
        let mut at = 0;
        let us = median_us(201, || {
            at = (at + chunk) % src_total;
            dst.copy_from_slice(&src[at..at + chunk]);
        });
        println!(
            "memcpy cold pageable -> pinned, 1 thread, {} KiB: {us:.1} us ({:.1} GB/s)",
            chunk >> 10,
            chunk as f64 / us / 1e3
        );
        let mut dsts: Vec<HostBuffer> = (0..lanes)
            .map(|_| HostBuffer::alloc_pinned(chunk, &HostAllocOptions::default(), &gpu))
            .collect::<Result<_, _>>()?;
        let mut round = 0;
        let us = median_us(51, || {
            round += 1;
            pool.install(|| {
                dsts.par_iter_mut()
                    .with_max_len(1)
                    .enumerate()
                    .for_each(|(l, d)| {
                        let at = ((round * lanes + l) * chunk) % (src_total - chunk);
                        d.copy_from_slice(&src[at..at + chunk]);
                    })
            })
        });
        println!(
            "  {lanes} threads at once: {us:.1} us ({:.1} GB/s aggregate)",
            (lanes * chunk) as f64 / us / 1e3
        );
    }

    for size in [4usize << 20, 16 << 20, 64 << 20] {
        let io = MemIo::new(vec![gpu.clone()], MemIoConfig::default())?;
        let dev = gpu.alloc(size)?;
        let mut at = 0;
        let us = median_us(31, || {
            at = (at + size) % (src_total - size);
            io.upload_staged(&src[at..at + size], &dev, 0).unwrap();
        });
        let ideal_copy = size as f64 / 55e9 * 1e6;
        println!(
            "upload_staged {} MiB (chunk {} KiB): {us:.0} us = {:.1} GB/s (PCIe alone: {ideal_copy:.0} us)",
            size >> 20,
            io.chunk_for(size) >> 10,
            size as f64 / us / 1e3
        );
    }
    Ok(())
}
